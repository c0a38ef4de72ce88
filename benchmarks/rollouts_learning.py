"""Does the demo's Atari loop learn through every backend? The return over a long run (issue 50).

``python -m jaxtransport.rollouts --env pong --engine envpool`` (4 stacked 84x84 frames, the
small conv policy, the PPO learner on this process's default
JAX device), one run per backend from the same seed, each for the same number of iterations:

- ``threads``: cleanba's design (actor threads over envpool, acting on the learner's device);
- ``queue/jaxtransport`` and ``pool/jaxtransport``: actor processes through
  ``jaxtransport.multiprocessing`` and ``jaxtransport.Pool``;
- ``queue/stock``: the same actor processes through ``multiprocessing.Queue``.

Every row is one window of the run: its iterations cut into WINDOWS parts of equal length, the
mean return of the episodes that ended in it (``episodes`` of them), the env steps taken by its
end (the plot's x) and the run's wall time by then. A run ``learns`` when the mean return of the
episodes of its last window is above that of its first by more than twice the standard error of
the difference (each window's from the spread between its iterations' means, at least
MIN_EPISODES episodes in each); the check
prints each backend's verdict. A throughput run (``rollouts_engines``) is far too short for
this: a Pong episode lasts about a thousand steps and its return moves only after millions.

On a host with network: ``python -m benchmarks.rollouts_learning --actors 12 --iterations 400``;
on the accelerator host without one, ``benchmarks/device_engines.sh`` with ``LEARN=1`` (the
envpool bundle). ``--quick``: 2 actors, 6 iterations, to see that every backend runs.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import time

from jaxtransport import rollouts as demo

from .rollouts_engines import _backend

PLOT_X = "env_steps"
PLOT_XLABEL = "env steps taken (all actors)"
PLOT_XSCALE = "linear"
PLOT_XFORMAT = "{:,.0f}"
PLOT_Y = "mean_return"
PLOT_YLABEL = "mean return of the episodes that ended (higher is better)"
LIMIT_TRANSPORTS = ()
BASELINE = None
LABELS = {
    "threads": "actor threads over envpool (cleanba's design)",
    "queue/jaxtransport": "actor processes + jaxtransport.multiprocessing",
    "pool/jaxtransport": "jaxtransport.Pool",
    "queue/stock": "actor processes + multiprocessing.Queue",
}

ENGINE = "envpool"
RUNS = (("threads", "none"), ("queue", "jaxtransport"), ("pool", "jaxtransport"), ("queue", "stock"))
WINDOWS = 8
MIN_EPISODES = 10


def windows(iterations: list, count: int = WINDOWS) -> list[dict]:
    """The run's iterations cut into ``count`` windows of equal length (the last takes the
    remainder): each window's episodes' mean return, their count and spread, the env steps
    taken by its end and the wall seconds by then. Per-iteration means are weighted by the
    episodes that ended in them (an iteration where none ended counts for nothing)."""
    count = max(1, min(count, len(iterations)))
    size = len(iterations) // count
    out, steps, wall = [], 0, 0.0
    for w in range(count):
        part = iterations[w * size : (w + 1) * size if w < count - 1 else len(iterations)]
        steps += sum(it.env_steps for it in part)
        wall += sum(it.wall_s for it in part)
        ended = [(it.mean_return, it.episodes) for it in part if it.episodes]
        n = sum(k for _, k in ended)
        mean = sum(r * k for r, k in ended) / n if n else None
        # The standard error of that mean with each iteration's episodes as one group (only
        # their mean is recorded): the spread between the iterations' means, weighted as the
        # mean weighs them. None with fewer than two such iterations.
        m = len(ended)
        se = (math.sqrt(m / (m - 1) * sum((k / n) ** 2 * (r - mean) ** 2 for r, k in ended))
              if m > 1 and mean is not None else None)
        out.append({"window": w + 1, "iterations": len(part), "episodes": n, "mean_return": mean,
                    "return_se": se, "env_steps": steps, "wall_s": wall})
    return out


def learns(first: dict, last: dict) -> tuple[bool | str, float | None]:
    """Whether the last window's mean return is above the first's by more than twice the
    standard error of the difference; "too few episodes" when a window has fewer than
    MIN_EPISODES, "too few iterations with episodes" when one has no standard error. Returns
    (verdict, the difference)."""
    if min(first["episodes"], last["episodes"]) < MIN_EPISODES:
        return "too few episodes", None
    if first["return_se"] is None or last["return_se"] is None:
        return "too few iterations with episodes", None
    diff = last["mean_return"] - first["mean_return"]
    se = math.sqrt(first["return_se"] ** 2 + last["return_se"] ** 2)
    return bool(diff > 2 * se) if se > 0 else bool(diff > 0), diff


def run(quick: bool = False, actors: int | None = None, iterations: int | None = None,
        game: str = "pong", runs: tuple = RUNS) -> list[dict]:
    from jaxtransport.rollouts import _atari as atari

    missing = atari.available(ENGINE)
    if missing:
        print(f"# rollouts-learning: skipped: {missing}", flush=True)
        return []
    actors = actors or 2
    iterations = iterations or (6 if quick else 200)
    rows: list[dict] = []
    for backend, transport in runs:
        name = _backend(backend, transport)  # rollouts_engines' names for the same runs
        cfg = demo.Config.for_env(game, backend=backend, workers=actors, engine=ENGINE, iterations=iterations,
                                  warmup=0)
        print(f"# rollouts-learning: {game}, {name}, {actors} actors, {iterations} iterations", flush=True)
        t0 = time.perf_counter()
        res = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
        seconds = time.perf_counter() - t0
        parts = windows(res.iterations, 2 if quick else WINDOWS)
        verdict, diff = learns(parts[0], parts[-1])
        for w in parts:
            rows.append({"name": f"rollouts-learning-{game}", "size_bytes": 0, "transport": name,
                         "seconds": seconds, "actors": actors, "engine": ENGINE, **w,
                         "run_iterations": len(res.iterations), "learns": verdict,
                         "return_change": diff})
        print(f"  {name:20s} " + "  ".join(
            f"{w['mean_return']:.2f}({w['episodes']})" if w["mean_return"] is not None else "-( 0)" for w in parts)
              + f"  learns: {verdict}", flush=True)
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    """Each backend's verdict: its last window's return against its first's."""
    out = []
    for name in dict.fromkeys(r["transport"] for r in rows):
        mine = [r for r in rows if r["transport"] == name]
        first, last = mine[0], mine[-1]
        verdict = mine[-1]["learns"]
        if verdict is True or verdict is False:
            out.append(f"{'PASS' if verdict else 'MISS'} {name}: mean return {first['mean_return']:.2f} "
                       f"({first['episodes']} episodes) in the first window, {last['mean_return']:.2f} "
                       f"({last['episodes']}) in the last, after {last['env_steps']:,} env steps "
                       "(target: up by more than twice the standard error)")
        else:
            out.append(f"MISS {name}: {verdict} ({first['episodes']} / {last['episodes']} episodes in the first / "
                       f"last window, at least {MIN_EPISODES} each needed): run longer")
    return out


def merge(files: list[str], out: str, name: str = "rollouts_learning") -> list[dict]:
    """Write ``out``'s results from several runs' results files (one backend each, as
    ``benchmarks/device_engines.sh`` with ``RUNS`` writes them): their rows, the first run's
    environment and conditions before, the last's after, their seconds summed."""
    import json

    from benchmarks import run as runner

    runs = []
    for path in files:
        with open(path) as f:
            runs.append(json.load(f))
    rows = [r for data in runs for r in data["rows"]]
    names = [r["transport"] for data in runs for r in data["rows"][:1]]
    if len(names) != len(set(names)):
        raise SystemExit(f"the runs measured the same backend more than once ({names}): merge distinct runs")
    runner.write_merged(name, sys.modules[__name__], runs, rows, out)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 actors, 6 iterations: every backend runs")
    p.add_argument("--actors", type=int, help="actor processes or threads (default 2)")
    p.add_argument("--iterations", type=int, help="iterations per run (default 200)")
    p.add_argument("--game", default="pong", help="an ALE game envpool has (default pong)")
    p.add_argument("--runs", help="the backends to run, comma-separated (default: "
                   + ",".join(_backend(b, t) for b, t in RUNS) + ")")
    p.add_argument("--out", help="write rollouts_learning.{json,md,png} to this folder")
    p.add_argument("--name", default="rollouts_learning", help="the results files' name with --out")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write --out/--name from these runs' results files instead of running")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out or ".", args.name)
    t0 = time.perf_counter()
    runs = RUNS
    if args.runs:
        by_name = {_backend(b, t): (b, t) for b, t in RUNS}
        unknown = [n for n in args.runs.split(",") if n not in by_name]
        if unknown:
            p.error(f"--runs: no backend {', '.join(unknown)}; choose from {', '.join(by_name)}")
        runs = tuple(by_name[n] for n in args.runs.split(","))
    rows = run(args.quick, args.actors, args.iterations, args.game, runs)
    if not args.out:  # write_outputs prints them with the files
        for line in check_targets(rows):
            print(line)
    if args.out and rows:
        from benchmarks import run as runner

        runner.write_outputs(args.name, sys.modules[__name__], rows, args.out, time.perf_counter() - t0,
                             args.quick)
    return rows


if __name__ == "__main__":
    main()
