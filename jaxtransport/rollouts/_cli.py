"""The rollouts demo's training loop and command line (``python -m jaxtransport.rollouts``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence, TextIO

from . import _backends as backends
from . import _report as report

__all__ = ["Config", "IterationStats", "RunResult", "train", "main"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on. Defaults: ~1 minute on 2 cores, pixel-heavy trajectories
    (16 envs x 128 steps x 84x84 frames = 14 MiB per worker per iteration), 32 MiB of
    parameters broadcast per iteration."""

    backend: str = "pool"
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
        if self.backend not in backends.BACKENDS:
            raise ValueError(f"--backend must be one of {backends.BACKENDS}, got {self.backend!r}")
        if self.address is not None and self.backend != "ray":
            raise ValueError("--address names a Ray cluster: use it with --backend ray")


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


@dataclasses.dataclass
class RunResult:
    backend: str
    transport: str
    config: Config
    param_bytes: int
    iterations: list[IterationStats]

    @property
    def timed(self) -> list[IterationStats]:
        """The iterations after the warm-up ones (all of them if there are no others)."""
        rest = self.iterations[self.config.warmup:]
        return rest or self.iterations

    def total(self, field: str) -> float:
        return sum(getattr(it, field) for it in self.timed)

    @property
    def steps_per_s(self) -> float:
        return self.total("env_steps") / max(self.total("wall_s"), 1e-12)

    @property
    def returns(self) -> list[float]:
        return [it.mean_return for it in self.iterations]


def train(cfg: Config, transport: str, *, out: TextIO | None = None,
          err: TextIO | None = None, session: backends.RaySession | None = None) -> RunResult:
    """Run the loop with one transport; print a line per iteration to ``out`` and, when both
    ``out`` and ``err`` are terminals, a progress bar on ``err`` (``None``: stdout/stderr; pass
    ``io.StringIO()`` to silence). ``session``: the Ray connection for ``--backend ray``
    (:class:`~._backends.RaySession`; default: the run starts its own).

    Start-up (starting the workers, compiling the rollout in each and the learner here) is
    done and reported before the first iteration: no iteration, warm-up included, counts it."""
    import jax

    from . import _policy as policy
    from . import _worker as worker

    cfg.validate()
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    label = f"{cfg.backend}/{transport}"
    started = time.perf_counter()
    key = jax.random.key(cfg.seed)
    k_params, k_envs, k_steps = jax.random.split(key, 3)
    params = policy.init(k_params, cfg.param_mb, cfg.hidden)
    opt = policy.adam_init(params)
    param_bytes = policy.num_bytes(params)
    carries = [worker.initial_carry(k, cfg.envs) for k in jax.random.split(k_envs, cfg.workers)]
    rows = params["table"].shape[0]
    warm = (rows, cfg.hidden, cfg.envs, cfg.frame_size, cfg.steps)
    result = RunResult(cfg.backend, transport, cfg, param_bytes, [])
    bar = report.ProgressBar(cfg.iterations, err, label=label,
                             enabled=report.is_terminal(out) and report.is_terminal(err))

    print(
        f"# {label}: {cfg.workers} workers x {cfg.envs} envs x {cfg.steps} "
        f"steps, {cfg.frame_size}x{cfg.frame_size} frames, policy {param_bytes / report.MiB:.1f} MiB",
        file=out, flush=True,
    )
    print(f"start-up: starting {cfg.workers} {report.worker_noun(cfg.backend)} and compiling "
          "the rollout in each, and the learner here ...", file=out, flush=True)
    with backends.make(cfg.backend, transport, cfg.workers, address=cfg.address,
                       warm=warm, timeout=cfg.task_timeout, session=session,
                       seed=cfg.seed, max_lag=cfg.max_lag) as be:
        # The workers start and compile in the background while the learner compiles here.
        worker.warm_up_learner(
            params, opt, carries[0], cfg.workers, cfg.lr, cfg.table_lr,
            frame_size=cfg.frame_size, steps=cfg.steps, gamma=cfg.gamma,
            entropy_coef=cfg.entropy_coef,
        )
        be.wait_ready()
        print(f"start-up: done in {time.perf_counter() - started:.1f}s (not counted in any "
              "iteration)", file=out, flush=True)
        for it in range(cfg.iterations):
            keys = jax.random.split(jax.random.fold_in(k_steps, it), cfg.workers)
            tasks = [(carries[w], keys[w], cfg.frame_size, cfg.steps) for w in range(cfg.workers)]
            start = time.perf_counter()
            handle = be.broadcast(params)
            results = be.map(handle, tasks)
            be.release(handle)
            del handle
            # Stock unpickling may finish copying into JAX's buffers asynchronously: count
            # that as transport, not as the learner's time.
            jax.block_until_ready(results)
            gathered = time.perf_counter()
            trajs = [r[0] for r in results]
            carries = [r[1] for r in results]
            compute = max(float(r[2]) for r in results)
            # Streaming actors (--backend queue) report how many parameter versions behind the
            # learner each trajectory's policy was, and overlap compute with the learner.
            lag = sum(r[3] for r in results) / len(results) if len(results[0]) > 3 else None
            moved = param_bytes * cfg.workers + sum(
                policy.num_bytes(r[0]) + policy.num_bytes(r[1]) for r in results
            )
            finished = sum(float(t.finished_return_sum) for t in trajs)
            count = sum(int(t.finished_count) for t in trajs)
            if count:
                mean_return = finished / count
            else:  # nothing ended: the running episodes' returns so far (a lower bound)
                mean_return = sum(float(c.state.ep_return.mean()) for c in carries) / len(carries)
            params, opt, _ = worker.learn(
                params, opt, trajs, cfg.lr, cfg.table_lr, frame_size=cfg.frame_size,
                gamma=cfg.gamma, entropy_coef=cfg.entropy_coef,
            )
            jax.block_until_ready(params)
            del trajs, results
            done = time.perf_counter()
            wall, learner = done - start, done - gathered
            stats = IterationStats(
                iteration=it + 1,
                mean_return=mean_return,
                episodes=count,
                env_steps=cfg.workers * cfg.envs * cfg.steps,
                bytes_moved=moved,
                wall_s=wall,
                compute_s=compute,
                learner_s=learner,
                transport_s=max(wall - compute - learner, 0.0),
                lag=lag,
            )
            result.iterations.append(stats)
            bar.clear()
            print(report.iteration_line(stats, cfg, warmup=it < cfg.warmup), file=out, flush=True)
            bar.update(it + 1, stats)
    bar.finish()
    return result


def _parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m jaxtransport.rollouts",
        description="Distributed CartPole-from-pixels rollouts with a REINFORCE learner: "
        "measures how fast jax.Arrays move between the learner and its workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", choices=backends.BACKENDS, default=d.backend,
                   help="pool: jaxtransport.Pool / multiprocessing.Pool, no services; "
                   "ray: one Ray actor per worker; queue: long-lived actors streaming "
                   "trajectories through a jaxtransport.multiprocessing / multiprocessing Queue "
                   "and picking up new parameters as the learner publishes them")
    p.add_argument("--address", default=None,
                   help="address of a running Ray cluster (head:6379, or auto); this machine "
                   "must be one of its nodes (ray start --address=...); none: start a local "
                   "Ray with --workers CPUs")
    p.add_argument("--transport", choices=backends.TRANSPORTS, default="jaxtransport",
                   help="stock: multiprocessing's pickling / Ray's default serialization")
    p.add_argument("--compare", action="store_true",
                   help="run stock then jaxtransport with the same seed and print the speedup")
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes")
    p.add_argument("--iterations", type=int, default=d.iterations, help="learner updates")
    p.add_argument("--envs", type=int, default=d.envs, help="environments per worker")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per environment per iteration")
    p.add_argument("--frame-size", type=int, default=d.frame_size,
                   help="observation frames are SIZE x SIZE uint8 pixels")
    p.add_argument("--param-mb", type=float, default=d.param_mb,
                   help="policy size in MiB of float32 parameters (the embedding table grows)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="MLP width")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate (dense layers)")
    p.add_argument("--table-lr", type=float, default=d.table_lr,
                   help="per-sample SGD step of the embedding table")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="fixes the policy, the environments and the actions: runs repeat exactly")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="leading iterations left out of the throughput table (compilation, "
                   "worker start-up); they still train")
    p.add_argument("--max-lag", type=int, default=d.max_lag,
                   help="--backend queue: how many rollouts each actor may run ahead of the "
                   "learner's updates (0: on-policy, acting and learning take turns; 1: actors "
                   "step while the learner updates, on data one update old, which the learner "
                   "corrects with truncated importance weights)")
    p.add_argument("--task-timeout", type=float, default=d.task_timeout,
                   help="seconds an iteration's rollout tasks may take before the demo stops "
                   "with an error instead of waiting on a dead or hung worker")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = Config(
        backend=args.backend, address=args.address, workers=args.workers,
        iterations=args.iterations, envs=args.envs, steps=args.steps,
        frame_size=args.frame_size, param_mb=args.param_mb, hidden=args.hidden, lr=args.lr,
        table_lr=args.table_lr, task_timeout=args.task_timeout, max_lag=args.max_lag,
        seed=args.seed, warmup=args.warmup,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        _parser().error(str(exc))
    transports = ["stock", "jaxtransport"] if args.compare else [args.transport]
    runs = []
    session = None
    try:
        if cfg.backend == "ray":
            # Before this process initializes JAX: starting Ray forks (see RaySession).
            print(f"# starting Ray ({'a local Ray' if cfg.address is None else cfg.address}) "
                  "...", flush=True)
            session = backends.RaySession(cfg.workers, cfg.address, transports)
        for transport in transports:
            runs.append(train(cfg, transport, session=session))
            print(file=sys.stdout)
    except KeyboardInterrupt:
        print("\ninterrupted: the workers were stopped", file=sys.stderr)
        return 130
    finally:
        if session is not None:
            session.close()
    print(report.summary_table(runs), flush=True)
    return 0

