"""The rollouts demo's records: a run's configuration (:class:`Config`, what the command line
builds), and what a run measured (:class:`IterationStats` per iteration, :class:`RunResult`).

Below both the loop (``_cli``) and the text output (``_report``), which read them."""

from __future__ import annotations

import dataclasses

from . import _backends as backends

__all__ = ["ATARI_DEFAULTS", "Config", "IterationStats", "RunResult", "run_label"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on. Defaults: ~1 minute on 2 cores, pixel-heavy trajectories
    (16 envs x 128 steps x 84x84 frames = 14 MiB per worker per iteration), 32 MiB of
    parameters broadcast per iteration. ``env``: ``"cartpole"`` (in ``jax.numpy``) or an ALE
    game (``"pong"``; stepped by gymnasium, the ``atari`` extra, or by envpool: ``engine``),
    whose defaults are :data:`ATARI_DEFAULTS` when made with :meth:`for_env`.
    ``cpus_per_actor``: the actors' CPU budget (``_cpus.plan``; None: automatic, 0: none)."""

    backend: str = "pool"
    env: str = "cartpole"
    address: str | None = None
    workers: int = 2
    iterations: int = 50
    envs: int = 16
    steps: int = 128
    frame_size: int = 84
    param_mb: float = 32.0
    hidden: int = 64
    lr: float = 0.003
    table_lr: float = 0.15
    gamma: float = 0.99
    entropy_coef: float = 0.01
    seed: int = 0
    warmup: int = 1
    task_timeout: float = 600.0
    max_lag: int = 1
    cpus_per_actor: int | None = None
    engine: str = "gymnasium"  # what steps an Atari game's environments (_atari.ENGINES)
    inference: str = "actor"  # where the Atari policy acts: each actor, or the learner's process (SEED RL)

    def validate(self) -> None:
        for name in ("workers", "iterations", "envs", "steps", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)!r}")
        if self.frame_size < 16:
            raise ValueError(f"--frame-size must be >= 16 pixels, got {self.frame_size!r}")
        if not self.param_mb > 0:
            raise ValueError(f"--param-mb must be > 0, got {self.param_mb!r}")
        if not self.task_timeout > 0:
            raise ValueError(f"--task-timeout must be > 0 seconds, got {self.task_timeout!r}")
        if self.max_lag < 0:
            raise ValueError(f"--max-lag must be >= 0, got {self.max_lag!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup!r}")
        if self.cpus_per_actor is not None and self.cpus_per_actor < 0:
            raise ValueError(f"--cpus-per-actor must be >= 0 (0: no budget), got {self.cpus_per_actor!r}")
        if self.backend not in backends.BACKENDS:
            raise ValueError(f"--backend must be one of {backends.BACKENDS}, got {self.backend!r}")
        if self.address is not None and self.backend != "ray":
            raise ValueError("--address names a Ray cluster: use it with --backend ray")
        if self.engine not in ("gymnasium", "envpool"):
            raise ValueError(f"--engine must be gymnasium or envpool, got {self.engine!r}")
        if self.engine != "gymnasium" and not self.atari:
            raise ValueError(f"--engine {self.engine} steps Atari games: use it with --env pong (or another ALE game)")
        if self.inference not in backends.INFERENCE:
            raise ValueError(f"--inference must be one of {backends.INFERENCE}, got {self.inference!r}")
        if self.inference == "learner" and (self.backend != "queue" or not self.atari):
            raise ValueError(
                "--inference learner (the actors' observations to the learner's process, actions back) "
                "runs with --backend queue and an ALE game (--env pong)"
            )
        if self.atari:
            from . import _conv as conv

            if self.frame_size < conv.MIN_FRAME:
                raise ValueError(
                    f"--frame-size must be >= {conv.MIN_FRAME} pixels for an Atari game, got {self.frame_size!r}"
                )
            if self.steps < 2:
                raise ValueError(
                    f"--steps must be >= 2 for an Atari game (the learner bootstraps each trajectory's returns "
                    f"from its last step, and trains on the others), got {self.steps!r}"
                )

    @property
    def atari(self) -> bool:
        """An ALE game (anything but ``cartpole``)."""
        return self.env != "cartpole"

    @classmethod
    def for_env(cls, env: str = "cartpole", **kwargs) -> Config:
        """A config for ``env`` whose unspecified sizes are that environment's defaults."""
        if env != "cartpole":
            kwargs = {**ATARI_DEFAULTS, **kwargs}
        return cls(env=env, **kwargs)


# An Atari iteration: 8 ALE environments x 64 steps per actor (x 4 frames skipped), 14 MiB of
# stacked frames per actor; the conv policy's ~0.2 MiB is broadcast.
ATARI_DEFAULTS = {"envs": 8, "steps": 64, "iterations": 30, "hidden": 64, "lr": 2.5e-4, "entropy_coef": 0.01}


@dataclasses.dataclass
class IterationStats:
    iteration: int
    mean_return: float  # mean return of the episodes that ended this iteration
    episodes: int  # how many ended (0: mean_return is the running episodes' mean so far)
    env_steps: int
    bytes_moved: int  # parameters to every worker + trajectories and carries back
    wall_s: float
    compute_s: float  # slowest worker's rollout, measured in the worker
    learner_s: float
    transport_s: float  # wall - compute - learner
    lag: float | None = None  # --backend queue: mean parameter versions behind the learner
    act_s: float | None = None  # Atari: slowest actor's time choosing actions (of compute_s)
    compute_mean_s: float | None = None  # the workers' mean rollout time (compute_s: the slowest)
    # CPU seconds the actors' processes spent in their rollouts, summed over the actors (None
    # where not measured): over compute_s, how many cores the actors kept busy.
    actor_cpu_s: float | None = None


@dataclasses.dataclass
class RunResult:
    backend: str
    transport: str
    config: Config
    param_bytes: int
    iterations: list[IterationStats]
    # SHA-256 of the learner's final parameters (every leaf's bytes, in tree order): two runs
    # whose every update was the same, bit for bit, end with the same digest.
    params_sha256: str = ""
    # Where things ran, as read at run time (``_report.describe_device``): the learner's JAX
    # device, the actors' (each actor's own report, grouped), where the first iteration's
    # trajectories arrived before the loop moved any, and the final parameters' device.
    learner_device: str = ""
    actor_devices: str = ""
    trajectories_on: str = ""
    params_on: str = ""
    # The actors' CPU budget (``_cpus``): cores per actor (0: none) and the report's line.
    cpus_per_actor: int = 0
    cpu_budget: str = ""

    @property
    def timed(self) -> list[IterationStats]:
        """The iterations after the warm-up ones (all of them if there are no others)."""
        rest = self.iterations[self.config.warmup :]
        return rest or self.iterations

    def total(self, field: str) -> float:
        return sum(getattr(it, field) for it in self.timed)

    @property
    def steps_per_s(self) -> float:
        return self.total("env_steps") / max(self.total("wall_s"), 1e-12)

    @property
    def returns(self) -> list[float]:
        return [it.mean_return for it in self.iterations]


def run_label(backend: str, transport: str) -> str:
    """How a run is named in its lines and tables: ``pool/stock``, ``queue/jaxtransport``, ...;
    ``threads`` (which moves nothing, so has no transport)."""
    return backend if backend == "threads" else f"{backend}/{transport}"
