"""Rollouts on Atari by engine: env steps/s of actor processes (jaxtransport, stock) against cleanba's stack (actor threads over envpool)?

The loop of ``python -m jaxtransport.rollouts --env pong`` (4 stacked 84x84 frames, a small
conv policy, the PPO learner in this process on its default
JAX device) at the given actor counts, with each environment engine (``--engine gymnasium``:
gymnasium's wrappers over ale-py, holding the GIL; ``--engine envpool``: envpool's C++ pool,
stepped with send/recv, the GIL released), on:

- ``threads``: actor threads in the learner's process, ``queue.Queue``, nothing serialized,
  acting on the learner's device. Over envpool this is cleanba's design (its ``rollout``
  threads, each with its own envpool, inference on the accelerator, the learner in the same
  process): the baseline;
- ``queue/jaxtransport``, ``pool/jaxtransport``: actor processes (acting on their own CPUs)
  through ``jaxtransport.multiprocessing`` and ``jaxtransport.Pool``;
- ``queue/stock``: the same actor processes through ``multiprocessing.Queue``;
- ``queue/jaxtransport+central-inference``: the queue's actor processes, acting through the
  learner's process (``--inference learner``, SEED RL's design): each step's observations go to
  it through ``jaxtransport.multiprocessing``, which runs the policy on its device for every
  actor waiting, and the actions come back; the acting share is then the round trips;
- ``limit``: the engine's stepping limit: the same number of actor processes, pinned to the
  cores the queue backend's actors get, each stepping its environments with random actions
  (no policy, no learner, nothing sent), all at once.

Each row gives env steps/s (the median iteration), its share of its engine's limit, the
slowest actor's split of an iteration's wall time into acting (the policy's forward pass and
sampling), stepping (the rest of its rollout: the engine and the trajectory's bookkeeping) and
waiting (the rest: for parameters, for the learner, for the queue), the learner's update time,
and whether learning progresses: the mean return of the episodes that ended in the later half
of the iterations in which any ended, against the earlier half (the same loop for every row; a
Pong episode lasts about a thousand steps and its return moves only after far more iterations
than a throughput run has: ``learns`` is then noise, or "too few episodes"). The streaming
backends run with ``--max-lag 1`` (cleanba's: an actor is at most one rollout ahead of the
learner's updates), and the jaxtransport queue once more with ``--max-lag 2``
(``queue/jaxtransport --max-lag 2``): an iteration waits for the slowest actor's rollout, and a
second rollout of slack lets the others run on meanwhile (on the TPU host, at 12 actors, it did
not raise the rate: docs/rollouts.md).

Targets (issue 50), at the most actors measured (12 on the accelerator host): jaxtransport's
best row >= 1.5x threads over envpool, and >= 80% of envpool's stepping limit.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import statistics
import sys
import time

from jaxtransport import rollouts as demo

PLOT_X = "actors"
PLOT_XLABEL = "actors (processes or threads), 8 ALE environments each"
PLOT_XFORMAT = "{:g}"
PLOT_Y = "env_steps_per_s"
PLOT_YLABEL = "env steps/s (higher is better)"
LIMIT_TRANSPORTS = ("envpool limit", "gymnasium limit")
BASELINE = "envpool threads"
NO_SPEEDUP = ("envpool limit", "gymnasium limit")
ANNOTATE = ("envpool queue/jaxtransport",)
LABELS = {
    "envpool threads": "envpool, actor threads (cleanba's design)",
    "gymnasium threads": "gymnasium, actor threads",
    "envpool queue/jaxtransport": "envpool, actor processes + jaxtransport.multiprocessing",
    "envpool queue/jaxtransport --max-lag 2": "envpool, actor processes + jaxtransport.multiprocessing, --max-lag 2",
    "gymnasium queue/jaxtransport --max-lag 2": (
        "gymnasium, actor processes + jaxtransport.multiprocessing, --max-lag 2"),
    "gymnasium queue/jaxtransport": "gymnasium, actor processes + jaxtransport.multiprocessing",
    "envpool pool/jaxtransport": "envpool, jaxtransport.Pool",
    "gymnasium pool/jaxtransport": "gymnasium, jaxtransport.Pool",
    "envpool queue/stock": "envpool, actor processes + multiprocessing.Queue",
    "envpool queue/jaxtransport+central-inference": "envpool, actor processes, acting in the learner's process",
    "gymnasium queue/jaxtransport+central-inference": "gymnasium, actor processes, acting in the learner's process",
    "gymnasium queue/stock": "gymnasium, actor processes + multiprocessing.Queue",
    "envpool limit": "envpool's stepping limit (random actions, no policy)",
    "gymnasium limit": "gymnasium's stepping limit (random actions, no policy)",
}
PLOT_TITLES = {"rollouts-engines-pong": "ALE Pong by engine, 8 envs x 64 steps per actor per update"}

GAME = "pong"
ENGINES = ("gymnasium", "envpool")
# (backend, transport, inference, max_lag): "learner" is --inference learner (SEED RL's central
# inference); max_lag is --max-lag (the streaming backends'; the Pool ignores it).
RUNS = (("threads", "none", "actor", 1), ("queue", "jaxtransport", "actor", 1), ("queue", "jaxtransport", "actor", 2),
        ("pool", "jaxtransport", "actor", 1), ("queue", "stock", "actor", 1), ("queue", "jaxtransport", "learner", 1))
TARGET_VS_THREADS = 1.5
TARGET_OF_LIMIT = 0.8


def _backend(backend: str, transport: str = "none", inference: str = "actor", max_lag: int = 1) -> str:
    name = backend if backend in ("threads", "limit") else f"{backend}/{transport}"
    name = f"{name}+central-inference" if inference == "learner" else name
    return name if max_lag == 1 else f"{name} --max-lag {max_lag}"


def _key(engine: str, backend: str, transport: str = "none", inference: str = "actor", max_lag: int = 1) -> str:
    return f"{engine} {_backend(backend, transport, inference, max_lag)}"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _limit_actor(engine: str, index: int, cpus, env: dict, steps: int, barrier, out) -> None:
    """One actor process of the limit row: pinned and set up as a queue actor is, it builds its
    environments, steps a few times, waits for the others, then steps ``steps`` times with
    random actions and puts its seconds on ``out``."""
    from jaxtransport._procenv import apply_environ
    from jaxtransport.rollouts import _atari as atari
    from jaxtransport.rollouts import _cpus

    _cpus.apply(cpus)
    apply_environ(env)
    cfg = demo.Config.for_env(GAME, engine=engine)
    spec = atari.Spec(atari.game_id(GAME, engine), cfg.envs, cfg.frame_size, cfg.seed, engine)
    actor = atari.make_actor(spec, index)
    try:
        actor.random_steps(8)
        barrier.wait(300)
        out.put(actor.random_steps(steps))
    finally:
        actor.close()


def stepping_limit(engine: str, actors: int, steps: int) -> float:
    """Env steps/s of ``actors`` processes stepping ``engine``'s environments at once with
    random actions, on the cores the queue backend's actors would get."""
    from jaxtransport.rollouts import _backends as backends
    from jaxtransport.rollouts import _cpus

    import jax

    budget = _cpus.plan(actors, None, _cpus.available()).for_backend("queue")
    # As the queue's actors: on the CPU when this process (the learner's) has an accelerator.
    env = backends.worker_env(actors, budget, learner_platform=jax.devices()[0].platform)
    per_actor = budget.actor_cpus if budget.on else [None] * actors
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(actors), ctx.Queue()
    procs = [ctx.Process(target=_limit_actor, args=(engine, i, per_actor[i], env, steps, barrier, out), daemon=True)
             for i in range(actors)]
    for p in procs:
        p.start()
    try:
        seconds = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    cfg = demo.Config.for_env(GAME)
    return actors * cfg.envs * steps / max(seconds)


def _returns(res) -> tuple[float | None, float | None, str]:
    """The mean return of the episodes that ended in the earlier half of the iterations in
    which any ended, of those in the later half (None: none), and how many ended in each."""
    its = [it for it in res.iterations if it.episodes]
    halves = (its[: len(its) // 2], its[len(its) // 2 :])
    means = []
    for half in halves:
        n = sum(it.episodes for it in half)
        means.append(sum(it.mean_return * it.episodes for it in half) / n if n else None)
    return means[0], means[1], "/".join(str(sum(it.episodes for it in h)) for h in halves)


def _row(engine: str, backend: str, transport: str, inference: str, max_lag: int, res, actors: int) -> dict:
    """A training run's row. The split is the slowest actor's, summed over the timed
    iterations, of its time: its rollouts (acting, then stepping: the rest of the rollout) and
    the rest of the wall time (waiting). Streaming actors roll out while the learner updates,
    so their rollouts can outlast an iteration: the split is then of the rollouts' time."""
    timed = res.timed
    wall = sum(it.wall_s for it in timed)
    compute = sum(it.compute_s for it in timed)
    act = sum(it.act_s or 0.0 for it in timed)
    total = max(wall, compute)
    early, late, episodes = _returns(res)
    return {
        "name": f"rollouts-engines-{GAME}",
        "size_bytes": int(statistics.median(it.bytes_moved for it in timed)),
        "transport": _key(engine, backend, transport, inference, max_lag),
        "seconds": statistics.median(it.wall_s for it in timed),
        "engine": engine,
        "backend": _backend(backend, transport, inference, max_lag),
        "actors": actors,
        "env_steps_per_s": timed[0].env_steps / statistics.median(it.wall_s for it in timed),
        "acting_share": act / total,
        "stepping_share": (compute - act) / total,
        "waiting_share": 1.0 - compute / total,
        "act_ms_per_step": 1e3 * act / (len(timed) * res.config.steps),
        "learner_s": statistics.median(it.learner_s for it in timed),
        "iterations": len(res.iterations),
        "return_early": early,
        "return_late": late,
        "episodes_early_late": episodes,
        "learns": (late > early) if early is not None and late is not None else "too few episodes",
    }


def run(quick: bool = False, actors: list[int] | None = None, iterations: int | None = None,
        engines: tuple[str, ...] = ENGINES, runs: tuple = RUNS, limit_steps: int | None = None) -> list[dict]:
    from jaxtransport.rollouts import _atari as atari

    engines = tuple(e for e in engines if _usable(atari, e))
    if not engines:
        return []
    actors = actors or [1, 2]
    iterations = iterations or (5 if quick else 12)
    limit_steps = limit_steps or (100 if quick else 600)
    rows: list[dict] = []
    for n in actors:
        for engine in engines:
            out: list[dict] = []
            loads = [_load()]
            print(f"# rollouts-engines: {engine} limit, {n} actors (load {loads[0]:.1f})", flush=True)
            limit = stepping_limit(engine, n, limit_steps)
            for backend, transport, inference, max_lag in runs:
                cfg = demo.Config.for_env(GAME, backend=backend, workers=n, engine=engine, inference=inference,
                                          iterations=iterations, warmup=2, max_lag=max_lag)
                print(f"# rollouts-engines: {_key(engine, backend, transport, inference, max_lag)}, {n} actors, "
                      f"{iterations} iterations (load {_load():.1f})", flush=True)
                loads.append(_load())
                res = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
                out.append(_row(engine, backend, transport, inference, max_lag, res, n))
            load = f"{min(loads):.1f}-{max(loads):.1f}"
            cfg = demo.Config.for_env(GAME)
            out.append({"name": f"rollouts-engines-{GAME}", "size_bytes": 0,
                        "transport": _key(engine, "limit"),
                        "seconds": n * cfg.envs * cfg.steps / limit, "engine": engine, "backend": "limit",
                        "actors": n, "env_steps_per_s": limit, "limit_steps": limit_steps})
            for r in out:
                r["load"] = load
                r["limit_share"] = r["env_steps_per_s"] / limit
            rows += out
        base = {r["engine"]: r for r in rows if r["actors"] == n and r["backend"] == "threads"}
        cleanba = base.get("envpool")
        for r in rows:
            if r["actors"] == n:
                r["ratio"] = r["env_steps_per_s"] / cleanba["env_steps_per_s"] if cleanba else ""
                own = base.get(r["engine"])
                r["vs_threads_same_engine"] = r["env_steps_per_s"] / own["env_steps_per_s"] if own else ""
                _print(r)
    return rows


def _usable(atari, engine: str) -> bool:
    missing = atari.available(engine)
    if missing is not None:
        print(f"# {engine}: skipped: {missing}", flush=True)
    return missing is None


def _print(r: dict) -> None:
    split = ""
    if "acting_share" in r:
        split = (f"  acting/stepping/waiting {100 * r['acting_share']:3.0f}/{100 * r['stepping_share']:3.0f}/"
                 f"{100 * r['waiting_share']:3.0f}%  learner {r['learner_s']:.3f}s  return "
                 f"{_num(r['return_early'])} -> {_num(r['return_late'])} "
                 f"({r['episodes_early_late']} episodes)")
    print(f"  {r['transport']:40s} {r['actors']:2d} actors {r['env_steps_per_s']:8,.0f} env steps/s  "
          f"{100 * r['limit_share']:3.0f}% of limit" + split, flush=True)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def check_targets(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    runs = sorted({r.get("run") or 0 for r in rows})
    if len(runs) > 1:  # --repeat: each run's verdicts
        return [f"run {k}: {line}" for k in runs for line in check_targets([r for r in rows if (r.get("run") or 0) == k])]
    n = max(r["actors"] for r in rows)
    at = {r["transport"]: r for r in rows if r["actors"] == n}
    cleanba, limit = at.get("envpool threads"), at.get("envpool limit")
    ours = [r for r in at.values() if "/jaxtransport" in r["backend"]]
    if not ours:
        return []
    best = max(ours, key=lambda r: r["env_steps_per_s"])
    out = []
    if cleanba:
        v = best["env_steps_per_s"] / cleanba["env_steps_per_s"]
        out.append(f"{'PASS' if v >= TARGET_VS_THREADS else 'MISS'} {n} actors: best jaxtransport row "
                   f"({best['transport']}) {best['env_steps_per_s']:,.0f} env steps/s = {v:.2f}x threads over "
                   f"envpool's {cleanba['env_steps_per_s']:,.0f} (target >= {TARGET_VS_THREADS:g}x; load {best['load']})")
    if limit:
        v = best["env_steps_per_s"] / limit["env_steps_per_s"]
        out.append(f"{'PASS' if v >= TARGET_OF_LIMIT else 'MISS'} {n} actors: {best['transport']} = "
                   f"{100 * v:.0f}% of envpool's stepping limit {limit['env_steps_per_s']:,.0f} "
                   f"(target >= {100 * TARGET_OF_LIMIT:.0f}%)")
    return out


def merge(folders: list[str], out: str, name: str = "rollouts_engines") -> list[dict]:
    """Write ``out``'s results from several runs' ``rollouts_engines.json`` (each actor count's
    rows are self-contained: ratios and shares are within it), by actor count (each run's own
    order within a count), with the first run's environment and conditions before, the last's
    after, and their seconds summed."""
    import json

    from benchmarks import run as runner

    import glob

    runs = []
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "rollouts_engines*.json")))
        if len(found) != 1:
            raise SystemExit(f"{folder}: expected one rollouts_engines*.json, found {found}")
        with open(found[0]) as f:
            runs.append(json.load(f))
    rows = sorted((r for data in runs for r in data["rows"]), key=lambda r: r["actors"])  # stable: each run's order
    counts = [r["actors"] for r in rows if r["backend"] == "limit"]
    if len(counts) != len(set(zip(counts, [r["engine"] for r in rows if r["backend"] == "limit"]))):
        raise SystemExit("the runs measured the same actor count and engine more than once: merge distinct runs")
    runner.write_merged(name, sys.modules[__name__], runs, rows, out)
    return rows


def _runs(text: str) -> tuple:
    """``RUNS`` entries named by ``text`` (their backend names, comma-separated), in RUNS' order."""
    names = {_backend(*r): r for r in RUNS}
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in names]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"unknown row {unknown or text!r}: choose from {', '.join(names)}")
    return tuple(r for name, r in names.items() if name in wanted)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 iterations, 100 limit steps")
    p.add_argument("--actors", type=lambda s: [int(x) for x in s.split(",")],
                   help="actor counts, comma-separated (default 1,2)")
    p.add_argument("--iterations", type=int, help="iterations per run (default 12, quick 5); the first 2 untimed")
    p.add_argument("--engine", action="append", choices=ENGINES, help="only this engine (repeatable)")
    p.add_argument("--limit-steps", type=int, help="steps per actor of the limit rows (default 600, quick 100)")
    p.add_argument("--runs", type=_runs,
                   help="only these rows, comma-separated by backend name (e.g. 'queue/jaxtransport,threads'; "
                   "the limit always runs): " + ", ".join(_backend(*r) for r in RUNS))
    p.add_argument("--repeat", type=int, default=1,
                   help="measure everything this many times, one after another; each row says its run (1, 2, ...)")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="measure nothing: write --out from the rollouts_engines.json of these folders (runs of "
                   "other actor counts, e.g. one device command each), their rows together")
    p.add_argument("--name", default="rollouts_engines",
                   help="the results files' name with --out (e.g. rollouts_engines_tpu for a device run "
                   "published beside this machine's)")
    p.add_argument("--out", help="write rollouts_engines.{json,md,png} to this folder, as `python -m benchmarks` "
                   "does (benchmarks/results: the published results)")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out or ".", args.name)
    if args.out:
        from benchmarks import run as runner

        before = runner.conditions()
    start = time.perf_counter()
    rows = []
    for k in range(1, args.repeat + 1):
        if args.repeat > 1:
            print(f"# rollouts-engines: run {k} of {args.repeat}", flush=True)
        got = run(args.quick, actors=args.actors, iterations=args.iterations, engines=tuple(args.engine or ENGINES),
                  runs=args.runs or RUNS, limit_steps=args.limit_steps)
        rows += [dict(r, run=k) for r in got] if args.repeat > 1 else got
    seconds = time.perf_counter() - start
    if args.out and rows:
        runner.write_outputs(args.name, sys.modules[__name__], rows, args.out, seconds, args.quick,
                             before=before, after=runner.conditions())
    else:
        for line in check_targets(rows):
            print(line)
    print(f"# {len(rows)} rows in {seconds:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
