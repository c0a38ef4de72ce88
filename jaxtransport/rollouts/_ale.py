"""What an Atari actor is, whichever engine steps its games (``_atari``: gymnasium;
``_envpool``: envpool): the run's description of its environments (:class:`Spec`), the
trajectory it sends (:class:`Trajectory`, :class:`Carry`), and the rollout loop
(:class:`Rollouts`), which acts with the policy and keeps the trajectory; an engine's actor
subclasses it and steps its environments (``_step``)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from .. import _copies

STACK = 4
FRAME_SKIP = 4
NOOP_MAX = 30


class Spec(NamedTuple):
    """What an actor needs to build its environments: the game's id in its engine's registry
    (gymnasium's ``ALE/Pong-v5``, envpool's ``Pong-v5``), how many, their frame size, the run's
    seed, and the engine that steps them (:data:`ENGINES`)."""

    game_id: str
    envs: int
    frame_size: int
    seed: int
    engine: str = "gymnasium"


class Trajectory(NamedTuple):
    frames: Any  # (T, E, STACK, S, S) uint8
    actions: Any  # (T, E) int32
    logp: Any  # (T, E) float32
    rewards: Any  # (T, E) float32 (unclipped)
    dones: Any  # (T, E) bool
    failures: Any  # (T, E) bool: terminated (not truncated)
    finished_return_sum: Any  # () float32
    finished_count: Any  # () int32


class Carry(NamedTuple):
    """What the learner hears of the environments between iterations: the running episodes'
    returns so far (their state stays in the actor)."""

    ep_return: Any  # (E,) float32


def camel_case(name: str) -> str:
    """``space_invaders`` -> ``SpaceInvaders`` (the games' names in both registries)."""
    return "".join(part[:1].upper() + part[1:] for part in name.replace("-", "_").split("_"))


def env_seed(spec: Spec, index: int) -> int:
    """The seed of actor ``index``'s first environment (the others: the next ones): distinct
    seeds for every environment of every actor of the run, the same in both engines."""
    return (spec.seed * 100_003 + index * spec.envs) % (1 << 31)


class Rollouts:
    """What an actor does with its environments, whichever engine steps them: a subclass
    builds them, sets ``spec``, ``index``, ``actions`` (the action set's size), ``_obs`` (the
    batch's current observations, ``(E, STACK, S, S)`` uint8) and ``_ep_return``, and
    implements :meth:`_step` (one step of every environment, auto-resetting) and
    :meth:`close`."""

    spec: Spec
    index: int
    actions: int
    _obs: np.ndarray
    _ep_return: np.ndarray

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(obs, reward, terminated, truncated)`` after one step of every environment with
        ``actions`` (environment order)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def rollout(self, params, key, steps: int, act=None):
        """``steps`` steps of every environment with the policy ``params``, actions sampled
        with ``key``. Returns ``(trajectory, carry, compute_s, act_s)``: ``compute_s`` is the
        whole rollout (stepping and acting, in this process, from the moment the parameters
        have landed), ``act_s`` the part spent choosing actions (the policy's forward pass and
        sampling, waited for). ``act(obs, t) -> (actions, logp)``: choose the actions
        elsewhere instead (``--inference learner``: ``act_s`` is then the round trips)."""
        import jax
        import jax.numpy as jnp

        from . import _conv as conv

        # Arguments that just arrived may still be landing (see _worker.rollout); numpy
        # parameters (the stock queue's) are put on the device once, not at every step.
        params = jax.tree.map(jnp.asarray, params)
        jax.block_until_ready((params, key))
        if act is None:

            def act(obs, t):
                return conv.act(params, obs, key, np.int32(t))

        e, s = self.spec.envs, self.spec.frame_size
        # Acting reads each step's observations from the trajectory's frames, 64-byte aligned
        # (JAX's CPU client copies an unaligned argument: _copies.aligned_empty), or from one
        # aligned buffer where a step's frames do not start on a boundary (a frame size that is
        # not a multiple of 4).
        frames = _copies.aligned_empty((steps, e, STACK, s, s), np.uint8)
        spare = None if frames[0].nbytes % _copies.ALIGN == 0 else _copies.aligned_empty(frames.shape[1:], np.uint8)
        actions = np.empty((steps, e), np.int32)
        logp = np.empty((steps, e), np.float32)
        rewards = np.empty((steps, e), np.float32)
        dones = np.empty((steps, e), bool)
        failures = np.empty((steps, e), bool)
        finished_sum, finished_count = 0.0, 0
        ep_return = self._ep_return
        start = time.perf_counter()
        act_s = 0.0
        obs = self._obs
        for t in range(steps):
            frames[t] = obs
            if spare is not None:
                spare[...] = obs
            a0 = time.perf_counter()
            a, lp = act(frames[t] if spare is None else spare, t)
            actions[t] = np.asarray(a)
            logp[t] = np.asarray(lp)
            act_s += time.perf_counter() - a0
            obs, reward, terminated, truncated = self._step(actions[t])
            rewards[t] = reward
            failures[t] = terminated
            dones[t] = done = terminated | truncated
            ep_return += rewards[t]
            if done.any():
                finished_sum += float(ep_return[done].sum(dtype=np.float64))
                finished_count += int(done.sum())
                ep_return[done] = 0.0
        self._obs = obs
        traj = Trajectory(
            frames=jax.device_put(frames),
            actions=jnp.asarray(actions),
            logp=jnp.asarray(logp),
            rewards=jnp.asarray(rewards),
            dones=jnp.asarray(dones),
            failures=jnp.asarray(failures),
            finished_return_sum=jnp.float32(finished_sum),
            finished_count=jnp.int32(finished_count),
        )
        carry = Carry(jnp.asarray(ep_return))
        jax.block_until_ready((traj, carry))
        return traj, carry, time.perf_counter() - start, act_s

    def random_steps(self, steps: int, seed: int = 0) -> float:
        """Step every environment ``steps`` times with uniformly random actions, keeping the
        observations as a rollout does, with no policy: the engine's stepping alone (the
        limit rows of ``benchmarks/rollouts_atari.py``). Returns the seconds it took. The
        episodes' returns are not kept: a rollout after this one reports them from 0."""
        rng = np.random.default_rng((seed, self.index))
        acts = rng.integers(0, self.actions, (steps, self.spec.envs), dtype=np.int32)
        frames = _copies.aligned_empty((steps, *self._obs.shape), np.uint8)  # as a rollout's
        start = time.perf_counter()
        for t in range(steps):
            frames[t] = self._obs
            self._obs = self._step(acts[t])[0]
        elapsed = time.perf_counter() - start
        self._ep_return[:] = 0.0
        return elapsed
