"""Rollouts on Atari: env steps/s of actor processes (jaxtransport, stock) against actor threads?

The loop of ``python -m jaxtransport.rollouts --env pong`` (ALE Pong through gymnasium, the
usual preprocessing, 4 stacked 84x84 frames, a small conv policy acting in each actor, the
PPO learner in this process) with 1 and 2 actors (and more
where the machine has the cores), on:

- ``threads``: actor threads and ``queue.Queue`` in the learner's process, nothing serialized
  (the design of cleanba and Sebulba): the baseline;
- ``queue/stock``: the same actors as spawned processes, ``multiprocessing.Queue``;
- ``pool/stock``: ``multiprocessing.Pool``, one rollout task per actor per update;
- ``queue/jaxtransport``, ``pool/jaxtransport``, ``ray/jaxtransport``: the same through
  ``jaxtransport.multiprocessing``, ``jaxtransport.Pool`` and ``jaxtransport.ray``.

The streaming backends (threads, queue) run with ``--max-lag 1`` (actors step while the
learner updates, as cleanba's and IMPALA's do); the Pool and Ray backends take turns. Every run
of a round has the same sizes and seed; rounds rotate which run goes first; figures are
medians over the timed iterations of all rounds (``round_ratios``: each round's own ratio to
the threads run of that round). The transport share is (wall - slowest actor's compute -
learner) / wall, summed over the timed iterations (0 when acting overlaps learning).

Targets (issue 24), at 2 actors: queue/jaxtransport >= 1.5x threads' env steps/s and >= 2x
stock multiprocessing's (queue/stock).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys

from jaxtransport import rollouts as demo

PLOT_X = "actors"
PLOT_XLABEL = "actors (processes or threads), 8 ALE environments each"
PLOT_XFORMAT = "{:g}"
PLOT_Y = "env_steps_per_s"
PLOT_YLABEL = "env steps/s (higher is better)"
LIMIT_TRANSPORTS = ()
BASELINE = "threads"
ANNOTATE = ("queue/jaxtransport", "queue/stock")
LABELS = {
    "threads": "threads: actor threads + queue.Queue, nothing serialized (cleanba/Sebulba)",
    "queue/stock": "stock multiprocessing: actor processes + multiprocessing.Queue",
    "pool/stock": "stock multiprocessing.Pool, a task per actor per update",
    "queue/jaxtransport": "jaxtransport.multiprocessing: actor processes + its Queue",
    "pool/jaxtransport": "jaxtransport.Pool, a task per actor per update",
    "ray/jaxtransport": "Ray actors with jaxtransport.ray",
}
PLOT_TITLES = {"rollouts-atari-pong": "ALE Pong, 8 envs x 64 steps per actor per update"}

GAME = "pong"
RUNS = (("threads", "none"), ("queue", "stock"), ("queue", "jaxtransport"), ("pool", "stock"),
        ("pool", "jaxtransport"), ("ray", "jaxtransport"))
TARGET_VS_THREADS = 1.5
TARGET_VS_STOCK = 2.0


def _key(backend: str, transport: str) -> str:
    return backend if backend == "threads" else f"{backend}/{transport}"


def _runs() -> list[tuple[str, str]]:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("# ray not installed: skipping the Ray backend", flush=True)
        return [r for r in RUNS if r[0] != "ray"]
    return list(RUNS)


def _actor_counts() -> list[int]:
    cores = os.cpu_count() or 1
    counts = [1, 2]
    n = 4
    while n <= cores:
        counts.append(n)
        n *= 2
    return counts


def _median(results: list, field: str) -> float:
    return statistics.median(getattr(it, field) for r in results for it in r.timed)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run(quick: bool = False, actors: list[int] | None = None, rounds: int | None = None,
        iterations: int | None = None, runs: list[tuple[str, str]] | None = None) -> list[dict]:
    """``rounds`` rounds (default 3; quick 1) at 2 actors, one at the other counts."""
    from jaxtransport.rollouts import _atari as atari

    missing = atari.available()
    if missing is not None:
        print(f"# skipped: {missing}", flush=True)
        return []
    actors = actors or _actor_counts()
    rounds = rounds or (1 if quick else 3)
    iterations = iterations or (5 if quick else 8)
    runs = runs or _runs()
    rows: list[dict] = []
    for n in actors:
        results: dict[str, list] = {_key(*r): [] for r in runs}
        ratios: dict[str, list[float]] = {k: [] for k in results}
        loads: list[float] = []
        same_params: list[bool] = []
        k_rounds = rounds if n == 2 else 1
        for k in range(k_rounds):
            order = runs[k % len(runs):] + runs[:k % len(runs)]
            this: dict[str, object] = {}
            for backend, transport in order:
                cfg = demo.Config.for_env(GAME, backend=backend, workers=n,
                                          iterations=iterations, warmup=2)
                key = _key(backend, transport)
                print(f"# rollouts-atari: {key}, {n} actors, {iterations} iterations "
                      f"(round {k + 1}/{k_rounds}, load {_load():.1f})", flush=True)
                loads.append(_load())
                res = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
                this[key] = res
                results[key].append(res)
            base = _median([this["threads"]], "wall_s") if "threads" in this else None
            for key, res in this.items():
                if base:
                    ratios[key].append(base / _median([res], "wall_s"))
            pools = [this.get("pool/stock"), this.get("pool/jaxtransport")]
            if all(pools):
                same_params.append(pools[0].params_sha256 == pools[1].params_sha256)
        cfg = demo.Config.for_env(GAME, workers=n)
        steps = n * cfg.envs * cfg.steps
        rate = {key: steps / _median(r, "wall_s") for key, r in results.items()}
        for key, r in results.items():
            wall = sum(it.wall_s for res in r for it in res.timed)
            transport = sum(it.transport_s for res in r for it in res.timed)
            acts = [it.act_s for res in r for it in res.timed if it.act_s is not None]
            row = {
                "name": f"rollouts-atari-{GAME}",
                "size_bytes": int(_median(r, "bytes_moved")),
                "transport": key,
                "seconds": _median(r, "wall_s"),
                "actors": n,
                "env_steps_per_s": rate[key],
                "ratio": rate[key] / rate["threads"] if "threads" in rate else "",
                "vs_stock_queue": (rate[key] / rate["queue/stock"]
                                   if "queue/stock" in rate else ""),
                "transport_share": transport / wall if wall else 0.0,
                "compute_s": _median(r, "compute_s"),
                "learner_s": _median(r, "learner_s"),
                "act_ms_per_step": (1e3 * statistics.median(acts) / cfg.steps if acts else ""),
                "runs": len(r),
                "round_ratios": " ".join(f"{x:.2f}" for x in ratios[key]) if key != "threads" else "",
                "load": f"{min(loads):.1f}-{max(loads):.1f}",
            }
            rows.append(row)
            print(f"  {key:19s} {n} actors {rate[key]:8,.0f} env steps/s  "
                  f"transport share {100 * row['transport_share']:3.0f}%  "
                  f"compute {row['compute_s']:.3f}s learner {row['learner_s']:.3f}s"
                  + (f"  x{row['ratio']:.2f} threads" if row["ratio"] != "" else "")
                  + (f" (rounds {row['round_ratios']})" if row["round_ratios"] else ""),
                  flush=True)
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    at = {(r["actors"], r["transport"]): r for r in rows}
    q = at.get((2, "queue/jaxtransport"))
    out = []
    if q is None:
        return out
    t, s = at.get((2, "threads")), at.get((2, "queue/stock"))
    if t:
        v = q["env_steps_per_s"] / t["env_steps_per_s"]
        out.append(f"{'PASS' if v >= TARGET_VS_THREADS else 'MISS'} 2 actors: queue/jaxtransport "
                   f"{q['env_steps_per_s']:,.0f} env steps/s = {v:.2f}x threads' "
                   f"{t['env_steps_per_s']:,.0f} (target >= {TARGET_VS_THREADS:g}x; per round: "
                   f"{q['round_ratios']}; load {q['load']})")
    if s:
        v = q["env_steps_per_s"] / s["env_steps_per_s"]
        out.append(f"{'PASS' if v >= TARGET_VS_STOCK else 'MISS'} 2 actors: queue/jaxtransport "
                   f"= {v:.2f}x stock multiprocessing's {s['env_steps_per_s']:,.0f} (queue/stock; "
                   f"target >= {TARGET_VS_STOCK:g}x)")
    return out


def stock_bound(rows: list[dict], trajectories: int = 8) -> str | None:
    """The most any transport could gain over ``queue/stock`` at 2 actors, by Amdahl's law:
    the CPU that ``multiprocessing.Queue`` spends on one actor's trajectory (the feeder's
    pickle, the pipe's copies, the learner's unpickle into arrays), measured here as process
    CPU time over a put and get in one process, is all a faster transport can give back to the
    actors and the learner, which keep the cores busy otherwise."""
    import multiprocessing
    import time

    import jax
    import numpy as np

    from jaxtransport.rollouts import _atari as atari

    at = {(r["actors"], r["transport"]): r for r in rows}
    s = at.get((2, "queue/stock"))
    if s is None:
        return None
    cfg = demo.Config.for_env(GAME, workers=2)
    traj = atari.trajectory_shape(atari.Spec(atari.game_id(GAME), cfg.envs, 84, 0), cfg.steps)
    frames = np.random.default_rng(0).integers(0, 256, traj.frames.shape, np.uint8)
    traj = traj._replace(frames=jax.device_put(frames))
    q = multiprocessing.get_context("spawn").Queue()
    q.put(traj)  # the feeder thread started, pickling warm
    jax.block_until_ready(q.get())
    cpu = time.process_time()
    for _ in range(trajectories):
        q.put(traj)
        jax.block_until_ready(jax.tree.map(jax.numpy.asarray, q.get()))
    cost = (time.process_time() - cpu) / trajectories
    q.close()
    q.join_thread()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = 2 * cost / (cores * s["seconds"])  # both actors' trajectories, of the cores' time per update
    bound = 1 / (1 - min(share, 0.99))
    return (f"INFO 2 actors: stock multiprocessing spends {1e3 * cost:.0f} ms of CPU per trajectory "
            f"({traj.frames.nbytes / 2**20:.0f} MiB; put and get, measured here), {100 * share:.1f}% of "
            f"{cores} cores' time per update ({s['seconds']:.2f} s): no transport can make queue/stock "
            f"more than {bound:.2f}x faster here (Amdahl)")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round, 5 iterations")
    p.add_argument("--actors", type=int, action="append", help="actor count (repeatable)")
    p.add_argument("--rounds", type=int, help="rounds at 2 actors (default 3, quick 1)")
    p.add_argument("--iterations", type=int, help="iterations per run (default 8, quick 5)")
    p.add_argument("--run", action="append", choices=[_key(*r) for r in RUNS],
                   help="only this run (repeatable; threads is always kept: the baseline)")
    args = p.parse_args(argv)
    runs = None
    if args.run:
        keep = set(args.run) | {"threads"}
        runs = [r for r in _runs() if _key(*r) in keep]
    rows = run(args.quick, actors=args.actors, rounds=args.rounds, iterations=args.iterations,
               runs=runs)
    for line in check_targets(rows):
        print(line)
    bound = stock_bound(rows)
    if bound:
        print(bound)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
