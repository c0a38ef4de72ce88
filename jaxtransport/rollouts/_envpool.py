"""Atari through envpool: the same games, observations and actions as ``_atari``'s gymnasium
engine, stepped in C++ (``--engine envpool``).

Needs the ``envpool`` extra (``pip install 'jaxtransport[envpool]'``; envpool ships the ROMs).
Nothing here imports envpool before it is used: ``import jaxtransport.rollouts`` works without
it, and :func:`require` says what to install.

An actor (:class:`Actor`) owns one envpool of ``envs`` environments, stepped the way cleanba's
actors step theirs: ``async_reset`` once, then per step ``send(actions, env_id)`` and
``recv()``. envpool steps the batch on its own C++ thread (one per actor, ``THREADS``: one core
per actor, as the actor processes get), with the GIL released while ``recv`` waits: actor
threads in one process step their envpools at once, which gymnasium's Python wrappers do not.
The rollout loop, the policy and the trajectory are ``_ale.Rollouts``', shared with the
gymnasium engine.

The options are the gymnasium engine's (``_atari``: ``ALE/<Game>-v5`` with
``AtariPreprocessing`` and ``FrameStackObservation``), set explicitly where envpool's defaults
differ: frame skip 4 with a max over the last two frames, up to 30 no-ops at reset, grayscale
``frame_size`` square (area resize), the last 4 frames stacked, sticky actions with
probability 0.25 (envpool's default is 0), no FIRE at reset (envpool presses it by default),
no end of episode on a life lost, rewards unclipped, the minimal action set, episodes
truncated at 27,000 steps (108,000 frames, ``-v5``'s limit).

One difference remains, envpool's auto-reset: the step after an episode's last one resets
that environment (its action is ignored, its reward 0, its observation the new episode's
first), where gymnasium's ``SAME_STEP`` auto-reset returns the new episode's first observation
with the last step. So an envpool episode costs one more env step, counted as one (cleanba
counts it the same way).
"""

from __future__ import annotations

import numpy as np

from . import _ale as ale

# envpool's C++ threads per actor: one, so that an actor (thread or process) steps on one core,
# as every backend's actors are budgeted (envpool's default, 0, takes every core for each pool).
THREADS = 1
MAX_EPISODE_STEPS = 27_000  # ALE -v5: 108,000 frames at frame skip 4
STICKY = 0.25  # ALE -v5's repeat_action_probability (Machado et al. 2018)

_INSTALL = (
    "--engine envpool needs the 'envpool' extra: pip install 'jaxtransport[envpool]' "
    "(envpool, which ships the Atari ROMs; Linux, CPython 3.11 and later)"
)


def _envpool():
    try:
        import envpool
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from exc
    return envpool


def require() -> None:
    """Raise ImportError, saying what to install, unless envpool is installed."""
    _envpool()


def game_id(name: str) -> str:
    """envpool's id of an ALE game given as ``pong``, ``space_invaders``, ``SpaceInvaders``,
    ``ALE/Pong-v5`` or ``Pong-v5``; ValueError naming the flag when envpool has no such game."""
    ep = _envpool()
    base = name.split("/")[-1]
    gid = base if base.endswith("-v5") else f"{ale.camel_case(base)}-v5"
    games = [g for g in ep.list_all_envs() if g.endswith("-v5")]
    if gid not in games:
        raise ValueError(
            f"--env {name!r}: envpool has no Atari game {gid!r}. Use an ALE game: pong, breakout, "
            f"space_invaders, ... (envpool's <Game>-v5 ids, {len(games)} games, in snake_case or as the id)"
        )
    return gid


def _make(spec: ale.Spec, num_envs: int, seed: int):
    return _envpool().make(
        spec.game_id,
        env_type="gymnasium",
        num_envs=num_envs,
        batch_size=num_envs,
        num_threads=THREADS,
        seed=seed,
        img_height=spec.frame_size,
        img_width=spec.frame_size,
        stack_num=ale.STACK,
        frame_skip=ale.FRAME_SKIP,
        noop_max=ale.NOOP_MAX,
        gray_scale=True,
        repeat_action_probability=STICKY,
        use_fire_reset=False,
        episodic_life=False,
        reward_clip=False,
        full_action_space=False,
        max_episode_steps=MAX_EPISODE_STEPS,
    )


def num_actions(gid: str) -> int:
    """The size of the game's minimal action set."""
    envs = _make(ale.Spec(gid, 1, 84, 0, "envpool"), 1, 0)
    try:
        return int(envs.action_space.n)
    finally:
        envs.close()


class Actor(ale.Rollouts):
    """One actor's environments in one envpool (see the module docstring): the environments of
    actor ``index`` get the seeds the gymnasium engine gives them."""

    def __init__(self, spec: ale.Spec, index: int):
        self.spec, self.index = spec, index
        self._envs = _make(spec, spec.envs, ale.env_seed(spec, index))
        self.actions = int(self._envs.action_space.n)
        self._ep_return = np.zeros(spec.envs, np.float32)
        self._envs.async_reset()
        self._obs = self._recv()[0]

    def close(self) -> None:
        self._envs.close()

    def _recv(self):
        """The next batch (every environment: the batch size is the pool's size), in
        environment order; remembers the order envpool returned them in for ``send``."""
        obs, reward, terminated, truncated, info = self._envs.recv()
        env_id = np.asarray(info["env_id"])
        order = np.argsort(env_id)
        return obs[order], reward[order], terminated[order], truncated[order]

    def _step(self, actions):
        self._envs.send(actions, np.arange(self.spec.envs, dtype=np.int32))
        return self._recv()
