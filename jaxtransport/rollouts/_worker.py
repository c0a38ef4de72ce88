"""The two jitted halves of the demo's loop: a worker's rollout and the learner's update.

``rollout`` is the task every worker runs (a top-level function, so any backend can ship it by
reference). It runs ``envs`` environments for ``steps`` steps under ``lax.scan``, vmapped over
the environments, acting with the broadcast parameters, and returns the trajectory as jax arrays,
time-major: ``frames`` (steps + 1, envs, S, S) uint8 -- the previous frame of step 0, then each
step's observation --, ``firsts``/``dones``/``failures`` (steps, envs) bool, ``actions`` int32,
``rewards`` float32, ``logp`` float32 (the acting policy's log-probability of each action),
plus the environments' carry (to continue the episodes next iteration) and the seconds spent
computing (measured in the worker; the first call includes compiling).

``learn`` is the learner's jitted REINFORCE step. It reads the frames back: the policy's inputs
are recomputed from the pixels the workers sent, so the trajectory payload is what the gradient
is computed from. Each step's gradient is weighted by the truncated importance ratio
``min(1, pi(a|o) / mu(a|o))`` of the learner's policy ``pi`` over the policy ``mu`` that acted
(``logp``), as in IMPALA's policy-gradient term: 1 on-policy (the Pool and Ray backends), and a
correction for the streaming actors' stale parameters (``--max-lag``).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _os
from . import _atari as atari
from . import _env as env
from . import _policy as policy


class Rollout(NamedTuple):
    """One rollout's result as the training loop sees it, whichever backend carried it:
    the trajectory, the environments' carry, the seconds the rollout took in its actor
    (``compute_s``), of which choosing actions (``act_s``; ``None`` for CartPole, whose acting
    is fused into the jitted scan), and the off-policy lag in parameter versions (``None``
    where the data is on-policy by construction), and the CPU seconds the actor's process
    spent in the rollout, all its threads together (``cpu_s``; ``None`` where not measured:
    Atari, actor threads)."""

    traj: Any
    carry: Any
    compute_s: float
    act_s: float | None = None
    lag: float | None = None
    cpu_s: float | None = None


class ActorInfo(NamedTuple):
    """Where an actor runs, as it reads it itself once warmed up: its process, its JAX default
    device (``platform``, ``device_kind``) and the cores it may run on (None: the host has no
    affinity masks)."""

    pid: int
    platform: str
    device_kind: str
    cpus: tuple[int, ...] | None


def actor_info() -> ActorInfo:
    """This process's (or actor thread's) :class:`ActorInfo`; initialises JAX here."""
    device = jax.devices()[0]
    cpus = _os.cpu_affinity()
    return ActorInfo(os.getpid(), device.platform, device.device_kind, None if cpus is None else tuple(sorted(cpus)))


# Note [acting inline]
# An actor process runs one small computation at a time and waits for each: an Atari actor's
# acting step (``_conv.act``, a few hundred microseconds on 8 observations) between steps of
# its environments. JAX's CPU client dispatches a computation asynchronously by default: a
# thread of its own runs it while the caller's thread waits, so each step hands the work to
# another thread and back, and on an actor pinned to one core (``_cpus``) the two take turns
# on it. With ``jax_cpu_enable_async_dispatch`` off, the caller's thread runs the computation
# itself. Measured on a TPU v5e host, 12 actors over envpool each pinned to a core, acting on
# 8 Pong observations per step: 0.79 ms a step with the dispatch thread, 0.68-0.72 ms without
# (median actor, two runs each); in the demo's queue run (12 actors, the learner on the chip)
# the slowest actor's acting went from 1.05 to 0.86-0.87 ms a step. Actor processes only (the
# threads backend's actors share the learner's process, whose computations stay asynchronous).


def run_inline() -> None:
    """In an actor process, before JAX's CPU backend starts there: run CPU computations on the
    calling thread (Note [acting inline]). Nothing where this JAX has no such setting."""
    try:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    except AttributeError:  # a JAX without the option (it came after 0.4.30): dispatch stays as it is
        pass


class Carry(NamedTuple):
    """Where each environment stands between iterations (tiny: a few floats per env)."""

    state: env.EnvState  # the state the next step starts from
    prev_state: env.EnvState  # the state whose frame is the previous observation
    first: jax.Array  # (envs,) bool: the next observation starts an episode


class Trajectory(NamedTuple):
    frames: jax.Array  # (T + 1, E, S, S) uint8
    firsts: jax.Array  # (T, E) bool
    actions: jax.Array  # (T, E) int32
    logp: jax.Array  # (T, E) float32: log mu(action | obs), mu the policy that acted
    rewards: jax.Array  # (T, E) float32
    dones: jax.Array  # (T, E) bool: an episode ended at this step
    failures: jax.Array  # (T, E) bool: ... by failure (not by truncation at MAX_STEPS)
    finished_return_sum: jax.Array  # () float32: sum of returns of episodes ended this rollout
    finished_count: jax.Array  # () int32


def initial_carry(key: jax.Array, envs: int) -> Carry:
    state = env.reset_batch(key, envs)
    return Carry(state, state, jnp.ones((envs,), bool))


_render = jax.vmap(env.render, in_axes=(0, None))


@functools.partial(jax.jit, static_argnames=("frame_size", "steps"))
def _rollout(params, carry: Carry, key, *, frame_size: int, steps: int):
    envs = carry.first.shape[0]
    prev0 = _render(carry.prev_state, frame_size)

    def body(c, k):
        state, prev_seen, first = c
        k_act, k_reset = jax.random.split(k)
        cur = _render(state, frame_size)
        seen = env.read_frame(cur, frame_size)
        prev = jnp.where(first[:, None], seen, prev_seen)
        logits = policy.apply(params, env.features(prev, seen))
        action = jax.random.categorical(k_act, logits).astype(jnp.int32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
        nxt, reward, done, failed, finished = jax.vmap(env.step)(state, action, jax.random.split(k_reset, envs))
        out = (cur, first, action, logp, reward * jnp.ones((envs,), jnp.float32), done, failed, finished)
        return (nxt, seen, done), (out, state)

    init = (carry.state, env.read_frame(prev0, frame_size), carry.first)
    (state, _, first), ((frames, firsts, actions, logp, rewards, dones, failed, finished), states) = jax.lax.scan(
        body, init, jax.random.split(key, steps)
    )
    last = jax.tree.map(lambda s: s[-1], states)
    traj = Trajectory(
        frames=jnp.concatenate([prev0[None], frames]),
        firsts=firsts,
        actions=actions,
        logp=logp,
        rewards=rewards,
        dones=dones,
        failures=failed,
        finished_return_sum=finished.sum(),
        finished_count=dones.sum(dtype=jnp.int32),
    )
    return traj, Carry(state, last, first)


def rollout(params, carry: Carry, key, frame_size: int, steps: int):
    """Run one worker's share of an iteration. Returns ``(trajectory, carry, compute_seconds)``.

    ``compute_seconds`` covers the jitted rollout until its outputs are ready, in this process;
    it excludes receiving the arguments and sending the results (the transport).
    """
    # Arguments that just arrived may still be landing on the device (an unpickled array's
    # host-to-device copy runs asynchronously): that is receiving, not computing.
    jax.block_until_ready((params, carry, key))
    start, cpu = time.perf_counter(), time.process_time()
    traj, carry = _rollout(params, carry, key, frame_size=frame_size, steps=steps)
    jax.block_until_ready((traj, carry))
    _last_cpu[0] = time.process_time() - cpu
    return traj, carry, time.perf_counter() - start


_last_cpu: list[float | None] = [None]  # this process's CPU seconds in its last rollout()


def take_cpu_s() -> float | None:
    """The CPU seconds this process (all its threads) spent in its last :func:`rollout`, once
    (then None): how many cores an actor keeps busy, with its wall time. Meaningless in an
    actor thread, whose process is the learner's."""
    cpu, _last_cpu[0] = _last_cpu[0], None
    return cpu


def run_task(params, *task):
    """A worker's task, either environment (top level: every backend ships it by reference):
    ``(carry, key, frame_size, steps)`` runs :func:`rollout` (CartPole), ``(spec, slot, key,
    steps)`` with an ``_atari.Spec`` runs ``_atari.rollout_task``. Returns a :class:`Rollout`."""
    if task and isinstance(task[0], atari.Spec):
        return Rollout(*atari.rollout_task(params, *task))
    traj, carry, compute = rollout(params, *task)
    return Rollout(traj, carry, compute, cpu_s=take_cpu_s())


def _features(traj: Trajectory, frame_size: int) -> jax.Array:
    """The policy's inputs, recomputed from the frames: each frame is read once."""
    seen = env.read_frame(traj.frames, frame_size)  # (T + 1, E, 2)
    cur = seen[1:]
    prev = jnp.where(traj.firsts[..., None], cur, seen[:-1])
    return env.features(prev, cur)


@functools.partial(jax.jit, static_argnames=("frame_size", "gamma", "entropy_coef"), donate_argnums=(0, 1))
def learn(params, opt, trajs, lr, table_lr, *, frame_size: int, gamma: float, entropy_coef: float):
    """One REINFORCE step on the trajectories of all workers. Returns ``(params, opt, loss)``.

    Advantages are reward-to-go returns minus the mean at the same step, standardized (see
    ``_policy.update`` for the step). ``params`` and ``opt`` are donated: the table's
    sparse update happens in place.
    """
    feats, acts, logps, rets = [], [], [], []
    for traj in trajs:
        feats.append(_features(traj, frame_size))  # (T, E, 4)
        acts.append(traj.actions)
        logps.append(traj.logp)
        # Returns are cut at failures only: an episode truncated at MAX_STEPS could have gone
        # on, and treating the time limit as a terminal state would punish the actions that
        # led to it (Pardo et al. 2018, "Time Limits in Reinforcement Learning"). The next
        # episode's rewards stand in for the truncated one's future.
        rets.append(policy.discounted_returns(traj.rewards.T, traj.failures.T, gamma).T)
    f, a, lp, r = (jnp.concatenate(x, axis=1) for x in (feats, acts, logps, rets))
    batch = policy.Batch(f.reshape(-1, 4), a.reshape(-1), policy.advantages(r), lp.reshape(-1))
    return policy.update(params, opt, batch, lr, table_lr, entropy_coef)


def warm_up(rows: int, hidden: int, envs: int, frame_size: int, steps: int) -> None:
    """Compile :func:`rollout` for these shapes in this process (zeros in, result dropped)."""
    params = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        jax.eval_shape(lambda: policy.init(jax.random.key(0), 1.0, hidden)),
    )
    params["table"] = jnp.zeros((rows, hidden), jnp.float32)
    rollout(params, initial_carry(jax.random.key(0), envs), jax.random.key(0), frame_size, steps)


def warm_up_learner(
    params,
    opt,
    carry: Carry,
    workers: int,
    lr: float,
    table_lr: float,
    *,
    frame_size: int,
    steps: int,
    gamma: float,
    entropy_coef: float,
) -> None:
    """Compile :func:`learn` in this process for ``workers`` trajectories shaped like the ones
    :func:`rollout` returns from ``carry`` (zeros in, result dropped; ``params`` and ``opt``
    themselves are not donated, zero copies of them are)."""
    traj, _ = jax.eval_shape(
        functools.partial(_rollout, frame_size=frame_size, steps=steps),
        params,
        carry,
        jax.random.key(0),
    )

    def zeros(tree):
        return jax.tree.map(jnp.zeros_like, tree)

    out = learn(
        zeros(params),
        zeros(opt),
        [zeros(traj) for _ in range(workers)],
        lr,
        table_lr,
        frame_size=frame_size,
        gamma=gamma,
        entropy_coef=entropy_coef,
    )
    jax.block_until_ready(out)
