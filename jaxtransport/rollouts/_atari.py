"""Atari through the Arcade Learning Environment: the environments an actor steps, in Python.

Needs the ``atari`` extra (``pip install 'jaxtransport[atari]'``: gymnasium, ale-py with its
ROMs, OpenCV for the resize). Nothing here imports gymnasium before it is used:
``import jaxtransport.rollouts`` works without the extra, and :func:`require` says what to
install.

An actor (:class:`Actor`) owns ``envs`` ALE environments in one gymnasium ``SyncVectorEnv``,
with the usual preprocessing (``AtariPreprocessing``: frame skip 4 with a max over the last two
frames, up to 30 no-ops at reset, grayscale, ``frame_size`` square; ``FrameStackObservation``:
the last 4 frames), sticky actions (``-v5``: repeat probability 0.25, Machado et al. 2018) and
auto-reset in the same step (the observation after an episode's last step is the next
episode's first). Stepping them is ordinary Python and C++ code holding the GIL, which is what
makes processes matter: threads in one process step them one at a time.

:meth:`Actor.rollout` acts with the convolutional policy (``_conv.act``, jitted, one call per
step for the whole batch) and returns the trajectory as jax arrays, time-major: ``frames``
(T, E, 4, S, S) ``uint8`` (the stacked observation each action was chosen from: the bulk of
the bytes), ``actions``, ``logp`` (the acting policy's log-probability of each action),
``rewards``, ``dones`` (an episode ended), ``failures`` (... by termination, not by the time
limit), and the returns of the episodes that ended. The environments' state stays in the
actor's process (``Actor`` is not picklable): what travels is the trajectory.

Determinism: an actor's environments are seeded from ``(seed, index)`` and its actions from
the learner's keys, so the same actor index with the same parameters and keys gives the same
trajectory, in any process or thread.

The rollout loop and the records are engine-independent (``_ale``); this module is the
gymnasium engine and picks the engine of a run (:func:`make_actor`; ``_envpool``: envpool's).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# The engine-independent parts (the rollout loop and the records), here under their old names.
from ._ale import FRAME_SKIP, NOOP_MAX, STACK, Rollouts, Spec, Trajectory, camel_case, env_seed
from ._ale import Carry as Carry

_INSTALL = (
    "the Atari environments need the 'atari' extra: pip install 'jaxtransport[atari]' "
    "(gymnasium, ale-py with its ROMs, opencv-python-headless)"
)


ENGINES = ("gymnasium", "envpool")


class Warm(NamedTuple):
    """A worker's start-up for Atari (``_backends._warm_up``): build the actor for ``slot``
    when known (streaming actors, Ray actors), else (a Pool worker, whose tasks are not pinned
    to a process) one for each of the run's ``workers`` slots, so that no timed iteration
    builds environments; and compile the acting step for ``hidden`` units and ``actions``
    actions."""

    spec: Spec
    steps: int
    hidden: int
    actions: int
    workers: int
    slot: int | None = None


def _gym():
    try:
        import ale_py
        import cv2  # noqa: F401  (AtariPreprocessing resizes with it)
        import gymnasium
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from exc
    gymnasium.register_envs(ale_py)
    return gymnasium


def _other(engine: str):
    """The module of an engine other than gymnasium (``_envpool``), None for gymnasium;
    ValueError naming the flag for an unknown one."""
    if engine == "gymnasium":
        return None
    if engine == "envpool":
        from . import _envpool

        return _envpool
    raise ValueError(f"--engine must be one of {ENGINES}, got {engine!r}")


def available(engine: str = "gymnasium") -> str | None:
    """``None`` when ``engine``'s Atari environments can run here, else why not (for a skip
    reason)."""
    try:
        require(engine)
    except ImportError as exc:
        return str(exc)
    return None


def require(engine: str = "gymnasium") -> None:
    """Raise ImportError, saying what to install, unless ``engine``'s extra is installed."""
    other = _other(engine)
    if other is not None:
        other.require()
    else:
        _gym()


def game_id(name: str, engine: str = "gymnasium") -> str:
    """The id in ``engine``'s registry of an ALE game given as ``pong``, ``space_invaders``,
    ``SpaceInvaders`` or ``ALE/Pong-v5`` (gymnasium's: ``ALE/Pong-v5``); ValueError naming the
    flag when there is no such game."""
    other = _other(engine)
    if other is not None:
        return other.game_id(name)
    gym = _gym()
    if "/" in name:
        gid = name
    else:
        gid = f"ALE/{camel_case(name)}-v5"
    if gid not in gym.registry:
        games = sum(1 for k in gym.registry if k.startswith("ALE/") and k.endswith("-v5"))
        raise ValueError(
            f"--env {name!r}: no ALE game {gid!r} is registered. Use cartpole or an ALE game: "
            f"pong, breakout, space_invaders, seaquest, ... ({games} games: the ALE/<Game>-v5 "
            "ids of gymnasium's registry, in snake_case or as the id itself)"
        )
    return gid


def num_actions(gid: str, engine: str = "gymnasium") -> int:
    """The size of the game's action set (the minimal one, as both engines use by default)."""
    other = _other(engine)
    if other is not None:
        return other.num_actions(gid)
    gym = _gym()
    env = gym.make(gid)
    try:
        return int(env.action_space.n)
    finally:
        env.close()


def _make_one(gid: str, frame_size: int):
    gym = _gym()
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    env = gym.make(gid, frameskip=1)  # AtariPreprocessing skips frames (with its max-pool)
    env = AtariPreprocessing(env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=frame_size, grayscale_obs=True)
    return FrameStackObservation(env, STACK)


class Actor(Rollouts):
    """One actor's environments through gymnasium (see the module docstring). ``index`` tells
    actors apart: it picks the environments' seeds. Costs ~10 MiB of memory per environment
    (the emulator)."""

    def __init__(self, spec: Spec, index: int):
        gym = _gym()
        self.spec, self.index = spec, index
        self._envs = gym.vector.SyncVectorEnv(
            [lambda: _make_one(spec.game_id, spec.frame_size)] * spec.envs,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        self.actions = int(self._envs.single_action_space.n)
        self._obs, _ = self._envs.reset(seed=env_seed(spec, index))
        self._ep_return = np.zeros(spec.envs, np.float32)

    def close(self) -> None:
        self._envs.close()

    def _step(self, actions):
        obs, reward, terminated, truncated, _ = self._envs.step(actions)
        return obs, reward, terminated, truncated


def make_actor(spec: Spec, index: int) -> Rollouts:
    """Actor ``index``'s environments, stepped by ``spec.engine``."""
    other = _other(spec.engine)
    return Actor(spec, index) if other is None else other.Actor(spec, index)


# The actors of this process, by (spec, slot): a streaming or Ray actor process holds one; a
# Pool worker holds one per slot of the run (tasks are not pinned to processes: which copy of a
# slot steps next varies, so a Pool run is not repeatable bit for bit; the others are).
_ACTORS: dict[tuple[Spec, int], Rollouts] = {}


def actor(spec: Spec, slot: int) -> Rollouts:
    """This process's actor for ``slot`` of the run ``spec``, built on first use."""
    a = _ACTORS.get((spec, slot))
    if a is None:
        a = _ACTORS[(spec, slot)] = make_actor(spec, slot)
    return a


def rollout_task(params, spec: Spec, slot: int, key, steps: int):
    """A worker's task (top level: any backend ships it by reference): the next ``steps``
    steps of ``slot``'s environments in this process. See :meth:`Actor.rollout`."""
    return actor(spec, slot).rollout(params, key, steps)


def warm_up(warm: Warm) -> None:
    """Build ``warm.slot``'s environments (if given) and compile the acting step for these
    shapes in this process (zeros in, result dropped)."""

    for slot in range(warm.workers) if warm.slot is None else (warm.slot,):
        actor(warm.spec, slot)
    compile_act(warm)


def compile_act(warm: Warm) -> None:
    """Compile the acting step for ``warm``'s shapes in this process (zeros in, dropped)."""
    import jax
    import jax.numpy as jnp

    from . import _conv as conv

    spec = warm.spec
    params = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype),
        jax.eval_shape(lambda: conv.init(jax.random.key(0), warm.actions, warm.hidden, STACK, spec.frame_size)),
    )
    obs = np.zeros((spec.envs, STACK, spec.frame_size, spec.frame_size), np.uint8)
    jax.block_until_ready(conv.act(params, obs, jax.random.key(0), np.int32(0)))


def trajectory_shape(spec: Spec, steps: int):
    """Zeros shaped like one actor's trajectory (the learner's warm-up)."""
    import jax.numpy as jnp

    e, s = spec.envs, spec.frame_size
    return Trajectory(
        frames=jnp.zeros((steps, e, STACK, s, s), jnp.uint8),
        actions=jnp.zeros((steps, e), jnp.int32),
        logp=jnp.zeros((steps, e), jnp.float32),
        rewards=jnp.zeros((steps, e), jnp.float32),
        dones=jnp.zeros((steps, e), bool),
        failures=jnp.zeros((steps, e), bool),
        finished_return_sum=jnp.float32(0),
        finished_count=jnp.int32(0),
    )
