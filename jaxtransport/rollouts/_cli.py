"""The rollouts demo's training loop and command line (``python -m jaxtransport.rollouts``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from . import _backends as backends
from . import _cpus as cpus
from . import _report as report
from ._config import ATARI_DEFAULTS, Config, IterationStats, RunResult, run_label

__all__ = ["build_parser", "jnp_zeros_like", "main", "params_digest", "per_env", "train"]


def train(
    cfg: Config,
    transport: str,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    session: backends.RaySession | None = None,
) -> RunResult:
    """Run the loop with one transport; print a line per iteration to ``out`` and, when both
    ``out`` and ``err`` are terminals, a progress bar on ``err`` (``None``: stdout/stderr; pass
    ``io.StringIO()`` to silence). ``session``: the Ray connection for ``--backend ray``
    (:class:`~._backends.RaySession`; default: the run starts its own). ``--backend threads``
    moves nothing between processes: ``transport`` is only its label there.

    Start-up (starting the workers, compiling the rollout in each and the learner here) is
    done and reported before the first iteration: no iteration, warm-up included, counts it.

    The learner runs on this process's default JAX device (``jax.devices()[0]``: an
    accelerator where there is one); the actors on the CPU whenever that device is not a CPU
    (``_backends.worker_env``), pinned to cores of their own by ``cfg.cpus_per_actor``
    (``_cpus``). The result names the devices each side reported, and where the trajectories
    arrived (they are moved to the learner's device if they arrive elsewhere, as transport)."""
    import jax

    from . import _policy as policy
    from . import _worker as worker

    cfg.validate()
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    label = run_label(cfg.backend, transport)
    started = time.perf_counter()
    learner_device = jax.devices()[0]
    budget = cpus.plan(cfg.workers, cfg.cpus_per_actor, cpus.available()).for_backend(cfg.backend)
    key = jax.random.key(cfg.seed)
    k_params, k_envs, k_steps = jax.random.split(key, 3)
    if cfg.atari:
        from . import _atari as atari
        from . import _conv as conv

        spec = atari.Spec(atari.game_id(cfg.env, cfg.engine), cfg.envs, cfg.frame_size, cfg.seed, cfg.engine)
        actions = atari.num_actions(spec.game_id, cfg.engine)
        params = conv.init(k_params, actions, cfg.hidden, atari.STACK, cfg.frame_size)
        warm: tuple = atari.Warm(spec, cfg.steps, cfg.hidden, actions, cfg.workers)
        carries: list = [None] * cfg.workers
        what = f"{spec.game_id} through {cfg.engine} ({actions} actions), {atari.STACK} stacked"
        frames_desc = "stacked Atari frames"
    else:
        params = policy.init(k_params, cfg.param_mb, cfg.hidden)
        carries = [worker.initial_carry(k, cfg.envs) for k in jax.random.split(k_envs, cfg.workers)]
        warm = (params["table"].shape[0], cfg.hidden, cfg.envs, cfg.frame_size, cfg.steps)
        what = "CartPole,"
        frames_desc = "frames"
    opt = policy.adam_init(params)
    param_bytes = policy.num_bytes(params)
    result = RunResult(cfg.backend, transport, cfg, param_bytes, [])
    result.learner_device = report.device_of(learner_device)
    result.cpus_per_actor = budget.per_actor if budget.on else 0
    result.cpu_budget = budget.describe()
    bar = report.ProgressBar(
        cfg.iterations, err, label=label, enabled=report.is_terminal(out) and report.is_terminal(err)
    )

    def learn(params, opt, trajs):
        if cfg.atari:
            return conv.learn(params, opt, trajs, cfg.lr, gamma=cfg.gamma, entropy_coef=cfg.entropy_coef)
        return worker.learn(
            params,
            opt,
            trajs,
            cfg.lr,
            cfg.table_lr,
            frame_size=cfg.frame_size,
            gamma=cfg.gamma,
            entropy_coef=cfg.entropy_coef,
        )

    def warm_up_learner():
        if cfg.atari:
            zero_params, zero_opt = jax.tree.map(jnp_zeros_like, (params, opt))
            trajs = [atari.trajectory_shape(spec, cfg.steps) for _ in range(cfg.workers)]
            jax.block_until_ready(learn(zero_params, zero_opt, trajs))
        else:
            worker.warm_up_learner(
                params,
                opt,
                carries[0],
                cfg.workers,
                cfg.lr,
                cfg.table_lr,
                frame_size=cfg.frame_size,
                steps=cfg.steps,
                gamma=cfg.gamma,
                entropy_coef=cfg.entropy_coef,
            )

    print(
        f"# {label}: {cfg.workers} workers x {cfg.envs} envs x {cfg.steps} "
        f"steps, {what} {cfg.frame_size}x{cfg.frame_size} {frames_desc}, "
        f"policy {param_bytes / report.MiB:.1f} MiB",
        file=out,
        flush=True,
    )
    print(
        f"start-up: starting {cfg.workers} {report.worker_noun(cfg.backend)} and compiling "
        "the rollout in each, and the learner here ...",
        file=out,
        flush=True,
    )
    with backends.make(
        cfg.backend,
        transport,
        cfg.workers,
        address=cfg.address,
        warm=warm,
        timeout=cfg.task_timeout,
        session=session,
        seed=cfg.seed,
        max_lag=cfg.max_lag,
        budget=budget,
        learner_platform=learner_device.platform,
        inference=cfg.inference,
    ) as be:
        # The workers start and compile in the background while the learner compiles here.
        warm_up_learner()
        be.wait_ready()
        actors = getattr(be, "actors", ())
        result.actor_devices = report.actor_devices(actors, cfg.backend)
        unapplied = budget.unapplied([a.cpus for a in actors])
        if unapplied:  # read from the actors, not assumed
            result.cpu_budget += f"; {unapplied}"
        print(
            f"start-up: done in {time.perf_counter() - started:.1f}s (not counted in any iteration); "
            f"{report.devices_line(result.learner_device, result.actor_devices)}; CPU budget: {result.cpu_budget}",
            file=out,
            flush=True,
        )
        for it in range(cfg.iterations):
            keys = jax.random.split(jax.random.fold_in(k_steps, it), cfg.workers)
            tasks: list[tuple]
            if cfg.atari:
                tasks = [(spec, w, keys[w], cfg.steps) for w in range(cfg.workers)]
            else:
                tasks = [(carries[w], keys[w], cfg.frame_size, cfg.steps) for w in range(cfg.workers)]
            start = time.perf_counter()
            handle = be.broadcast(params)
            results = [worker.Rollout(*r) for r in be.map(handle, tasks)]
            be.release(handle)
            del handle
            # Stock unpickling may finish copying into JAX's buffers asynchronously: count
            # that as transport, not as the learner's time.
            jax.block_until_ready([(r.traj, r.carry) for r in results])
            if it == 0:
                result.trajectories_on = _devices_of([r.traj for r in results])
            # Received arrays land on this process's default device (the learner's); any that
            # did not are moved there, as part of the transport.
            trajs = [_on_device(r.traj, learner_device) for r in results]
            carries = [_on_device(r.carry, learner_device) for r in results]
            jax.block_until_ready((trajs, carries))
            gathered = time.perf_counter()
            slowest = max(results, key=lambda r: float(r.compute_s))
            compute = float(slowest.compute_s)
            compute_mean = sum(float(r.compute_s) for r in results) / len(results)
            # Generators, not filtered list comprehensions (Note [loops that end in a test]).
            cpu_s = list(float(r.cpu_s) for r in results if r.cpu_s is not None)  # noqa: C400
            actor_cpu = sum(cpu_s) if len(cpu_s) == len(results) else None
            act = None if slowest.act_s is None else float(slowest.act_s)
            # Streaming actors (--backend queue/threads) report how many parameter versions
            # behind the learner each trajectory's policy was, and overlap compute with the
            # learner.
            lags = list(r.lag for r in results if r.lag is not None)  # noqa: C400
            lag = sum(lags) / len(lags) if lags else None
            moved = param_bytes * cfg.workers + sum(
                policy.num_bytes(r.traj) + policy.num_bytes(r.carry) for r in results
            )
            finished = sum(float(t.finished_return_sum) for t in trajs)
            count = sum(int(t.finished_count) for t in trajs)
            if count:
                mean_return = finished / count
            else:  # nothing ended: the running episodes' returns so far (a bound)
                mean_return = sum(float(_running_returns(c).mean()) for c in carries) / len(carries)
            params, opt, _ = learn(params, opt, trajs)
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
                act_s=act,
                compute_mean_s=compute_mean,
                actor_cpu_s=actor_cpu,
            )
            result.iterations.append(stats)
            bar.clear()
            print(report.iteration_line(stats, cfg, warmup=it < cfg.warmup), file=out, flush=True)
            bar.update(it + 1, stats)
    bar.finish()
    result.params_on = _devices_of(params)
    result.params_sha256 = params_digest(params)
    return result


def _devices_of(tree) -> str:
    """The devices the jax.Arrays of ``tree`` are on (``_report.device_of``), or ``host``."""
    import jax

    found: dict[str, None] = {}
    for leaf in jax.tree.leaves(tree):
        for d in getattr(leaf, "devices", lambda: ())():
            found[report.device_of(d)] = None
    return ", ".join(found) or "host (numpy)"


def _on_device(tree, device):
    """``tree`` with every jax.Array that is not on ``device`` alone moved there."""
    import jax

    def put(x):
        devices = getattr(x, "devices", None)
        if devices is None or devices() == {device}:
            return x
        return jax.device_put(x, device)

    return jax.tree.map(put, tree)


def params_digest(params) -> str:
    """SHA-256 over every leaf's dtype, shape and bytes, in tree order."""
    import hashlib

    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def jnp_zeros_like(x):
    import jax.numpy as jnp

    return jnp.zeros_like(x)


def _running_returns(carry):
    """The running episodes' returns so far, from a carry of either environment."""
    ep_return = getattr(carry, "ep_return", None)
    return carry.state.ep_return if ep_return is None else ep_return


def per_env(p: argparse.ArgumentParser, name: str, kind: type, help: str) -> None:
    """Add ``--name``, whose default is Config's for CartPole and ATARI_DEFAULTS' for a game
    (None on the command line: ``main`` leaves it to ``Config.for_env``)."""
    both = f"(default {getattr(Config(), name):g}; Atari {ATARI_DEFAULTS[name]:g})"
    p.add_argument(f"--{name}", type=kind, default=None, help=f"{help} {both}")


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m jaxtransport.rollouts",
        description="Distributed rollouts (CartPole from pixels in jax.numpy, or an Atari game "
        "through the Arcade Learning Environment) with an importance-weighted policy-gradient "
        "learner (PPO on Atari): measures how fast jax.Arrays move between the learner and its actors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--env",
        default=d.env,
        help="cartpole (jax.numpy, in the workers' jitted scan) or an ALE game "
        "(pong, breakout, space_invaders, ...: gymnasium + ale-py, "
        "pip install 'jaxtransport[atari]'), stepped in Python by each actor",
    )
    p.add_argument(
        "--engine",
        choices=("gymnasium", "envpool"),
        default=d.engine,
        help="what steps an ALE game's environments: gymnasium's Python wrappers over ale-py "
        "(holding the GIL) or envpool's C++ pool (send/recv, the GIL released while it steps: "
        "cleanba's stack; pip install 'jaxtransport[envpool]'); the same observations, "
        "actions and options",
    )
    p.add_argument(
        "--inference",
        choices=backends.INFERENCE,
        default=d.inference,
        help="where the Atari policy chooses the actions: in each actor (on its CPU), or, with "
        "--backend queue, in the learner's process on its device, batched over the actors, "
        "which send each step's observations and get the actions back through the transport "
        "(SEED RL's design; the round trip is reported as acting)",
    )
    p.add_argument(
        "--backend",
        choices=backends.BACKENDS,
        default=d.backend,
        help="pool: jaxtransport.Pool / multiprocessing.Pool, no services; "
        "ray: one Ray actor per worker; queue: long-lived actors streaming "
        "trajectories through a jaxtransport.multiprocessing / multiprocessing Queue "
        "and picking up new parameters as the learner publishes them; threads: the "
        "same streaming actors as threads of this process with queue.Queue, nothing "
        "serialized, acting on this process's default device (the cleanba/Sebulba design; "
        "with --engine envpool, cleanba's stack; no --transport)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="address of a running Ray cluster (head:6379, or auto); this machine "
        "must be one of its nodes (ray start --address=...); none: start a local "
        "Ray with --workers CPUs",
    )
    p.add_argument(
        "--transport",
        choices=backends.TRANSPORTS,
        default="jaxtransport",
        help="stock: multiprocessing's pickling / Ray's default serialization",
    )
    p.add_argument(
        "--compare", action="store_true", help="run stock then jaxtransport with the same seed and print the speedup"
    )
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes (actors)")
    per_env(p, "iterations", int, "learner updates")
    per_env(p, "envs", int, "environments per worker")
    per_env(p, "steps", int, "steps per environment per iteration")
    p.add_argument(
        "--frame-size", type=int, default=d.frame_size, help="observation frames are SIZE x SIZE uint8 pixels"
    )
    p.add_argument(
        "--param-mb",
        type=float,
        default=d.param_mb,
        help="CartPole's policy size in MiB of float32 parameters (the embedding "
        "table grows); the Atari policy is a fixed small convolutional network",
    )
    p.add_argument("--hidden", type=int, default=d.hidden, help="width of the dense layer")
    per_env(p, "lr", float, "Adam learning rate")
    p.add_argument(
        "--table-lr", type=float, default=d.table_lr, help="CartPole: per-sample SGD step of the embedding table"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="fixes the policy, the environments and the actions: runs repeat exactly",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="leading iterations left out of the throughput table (compilation, worker start-up); they still train",
    )
    p.add_argument(
        "--max-lag",
        type=int,
        default=d.max_lag,
        help="--backend queue/threads: how many rollouts each actor may run ahead of "
        "the learner's updates (0: on-policy, acting and learning take turns; 1: "
        "actors step while the learner updates, on data one update old, which the "
        "learner corrects with truncated importance weights)",
    )
    p.add_argument(
        "--cpus-per-actor",
        type=int,
        default=None,
        metavar="N",
        help="the actors' CPU budget (--backend pool/queue, Linux): each actor process pinned to N "
        "cores of its own (sched_setaffinity, before JAX starts there; its XLA and OpenMP thread "
        "pools sized to N), the learner keeping the rest; 0: none; more than there are cores: "
        "actors share them round-robin. Default: automatic when the actors and the learner fill "
        "the cores (workers + 1 >= cores, 2 <= workers <= cores - 1): (cores - 1) // workers each",
    )
    p.add_argument(
        "--task-timeout",
        type=float,
        default=d.task_timeout,
        help="seconds an iteration's rollout tasks may take before the demo stops "
        "with an error instead of waiting on a dead or hung worker",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    env = args.env.lower() if args.env.lower() == "cartpole" else args.env
    given = {k: getattr(args, k) for k in ("iterations", "envs", "steps", "lr") if getattr(args, k) is not None}
    cfg = Config.for_env(
        env,
        backend=args.backend,
        address=args.address,
        workers=args.workers,
        frame_size=args.frame_size,
        param_mb=args.param_mb,
        hidden=args.hidden,
        table_lr=args.table_lr,
        task_timeout=args.task_timeout,
        max_lag=args.max_lag,
        cpus_per_actor=args.cpus_per_actor,
        engine=args.engine,
        inference=args.inference,
        seed=args.seed,
        warmup=args.warmup,
        **given,
    )
    try:
        cfg.validate()
        if cfg.backend == "threads" and (args.compare or args.transport == "stock"):
            raise ValueError(
                "--backend threads moves nothing between processes: it has no "
                "--transport and no --compare (run --backend queue --compare for "
                "the same actors as processes)"
            )
        if cfg.atari:
            from . import _atari as atari

            atari.game_id(cfg.env, cfg.engine)  # the extra is installed and the game exists
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    if cfg.backend == "threads":
        transports = ["none"]
    else:
        transports = ["stock", "jaxtransport"] if args.compare else [args.transport]
    runs = []
    session = None
    try:
        if cfg.backend == "ray":
            # Before this process initializes JAX: starting Ray forks (see RaySession).
            print(f"# starting Ray ({'a local Ray' if cfg.address is None else cfg.address}) ...", flush=True)
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
