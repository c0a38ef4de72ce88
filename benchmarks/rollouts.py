"""Rollouts: how many env steps/s does the learner-workers loop reach with jaxtransport vs stock?

The loop of ``python -m jaxtransport.rollouts`` (2 workers, pixel CartPole, REINFORCE learner)
on the Pool, Ray and streaming queue backends, with the stock transport (``multiprocessing.Pool``
spawn, ``multiprocessing.Queue`` / Ray's default serialization) and jaxtransport, measured in the
same run with the same seed, at several policy sizes (``--param-mb``). Per iteration it records
the wall time and its split: compute (slowest worker, measured in the worker), learner update,
transport (the rest). Figures are medians over the iterations after the warm-up, pooled over
three rounds at the default size, each round alternating which transport runs first (a Ray run's
learner step varies from run to run; the per-round speedups are printed too). The
"compute+learner limit" row is the env steps/s the Pool and Ray loops would reach if moving the
arrays cost nothing (the queue backend's actors compute while the learner updates, so the sum is
no limit there and has no row).

The queue backend's rounds also run the Pool backend with jaxtransport (row
``pool/jaxtransport``), interleaved with the queue runs, so that the streaming design is compared
with the Pool under the same load, round by round.

Targets (issues 6 and 11), at the default sizes: jaxtransport >= 3x the env steps/s of stock on
the Pool and queue backends, >= 2x on Ray; the queue backend (default ``--max-lag 1``) above the
Pool backend's env steps/s in the same rounds.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys

from jaxtransport import rollouts as demo

PLOT_X = "param_mb"
PLOT_XLABEL = "policy size (MiB of parameters broadcast per iteration)"
PLOT_XFORMAT = "{:g} MiB"
PLOT_Y = "env_steps_per_s"
PLOT_YLABEL = "env steps/s (higher is better)"
LIMIT_TRANSPORTS = ("compute+learner limit",)
BASELINE = "stock"
ANNOTATE = ("jaxtransport",)
POOL_COMPARISON = "pool/jaxtransport"  # the queue backend's same-round comparison
NO_SPEEDUP = (POOL_COMPARISON,)
LABELS = {
    "stock": "stock: multiprocessing.Pool (spawn) / .Queue / Ray's default serialization",
    "jaxtransport": "jaxtransport: jaxtransport.Pool / .multiprocessing.Queue / jaxtransport.ray",
    "compute+learner limit": "compute + learner only (transport free: the limit)",
    POOL_COMPARISON: "the Pool backend with jaxtransport, in the same rounds",
}
PLOT_TITLES = {"rollouts-pool": "Pool backend, 2 workers", "rollouts-ray": "Ray backend, 2 workers",
               "rollouts-queue": "queue backend (streaming), 2 actors"}

DEFAULT_MB = demo.Config().param_mb
TARGETS = {"pool": 3.0, "ray": 2.0, "queue": 3.0}


def _backends() -> list[str]:
    out = ["pool", "queue"]
    try:
        import ray  # noqa: F401

        out.append("ray")
    except ImportError:
        print("# ray not installed: skipping the Ray backend", flush=True)
    return out


def _median(results: list[demo.RunResult], field: str) -> float:
    """Median of ``field`` over the timed iterations of every run in ``results``."""
    return statistics.median(getattr(it, field) for r in results for it in r.timed)


def _runs(backend: str, mb: float) -> list[tuple[str, str]]:
    """The (backend, transport) runs of one round: the backend's two transports, and on the
    queue backend at the default size the Pool backend with jaxtransport for comparison."""
    runs = [(backend, "stock"), (backend, "jaxtransport")]
    if backend == "queue" and mb == DEFAULT_MB:
        runs.append(("pool", "jaxtransport"))
    return runs


def _key(backend: str, run: tuple[str, str]) -> str:
    return run[1] if run[0] == backend else f"{run[0]}/{run[1]}"


def run(quick: bool = False, backends: list[str] | None = None,
        sizes: list[float] | None = None, iterations: int | None = None,
        rounds: int | None = None) -> list[dict]:
    """``rounds`` (default 3, quick 1) rounds at the default policy size, one at the others. A
    round runs stock and jaxtransport (and, on the queue backend, the Pool backend for
    comparison), rotating which runs first; each figure is the median over the timed iterations
    of all of a run's rounds, and ``round_ratios`` lists each round's own speedup (median
    iteration vs median iteration), so run-to-run spread shows."""
    sizes = sizes or ([DEFAULT_MB] if quick else [8.0, DEFAULT_MB, 128.0])
    iterations = iterations or (8 if quick else 16)
    rounds = rounds or (1 if quick else 3)
    rows: list[dict] = []
    for backend in backends or _backends():
        for mb in sizes:
            runs = _runs(backend, mb)
            steps = None
            results: dict[str, list[demo.RunResult]] = {_key(backend, r): [] for r in runs}
            same = True
            round_ratios: dict[str, list[float]] = {k: [] for k in results}
            n = rounds if mb == DEFAULT_MB else 1
            for k in range(n):
                order = runs[k % len(runs):] + runs[:k % len(runs)]
                pair = {}
                for b, transport in order:
                    cfg = demo.Config(backend=b, param_mb=mb, iterations=iterations, warmup=2)
                    steps = cfg.workers * cfg.envs * cfg.steps
                    print(f"# rollouts: {b}/{transport}, {mb:g} MiB policy, "
                          f"{iterations} iterations (round {k + 1}/{n})", flush=True)
                    key = _key(backend, (b, transport))
                    pair[key] = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
                    results[key].append(pair[key])
                same = same and pair["stock"].returns == pair["jaxtransport"].returns
                base = _median([pair["stock"]], "wall_s")
                for key in pair:
                    round_ratios[key].append(base / _median([pair[key]], "wall_s"))
            rate = {t: steps / _median(r, "wall_s") for t, r in results.items()}
            for transport, r in results.items():
                moved = _median(r, "bytes_moved")
                transport_s = _median(r, "transport_s")
                lags = [it.lag for res in r for it in res.timed if it.lag is not None]
                rows.append({
                    "name": f"rollouts-{backend}",
                    "size_bytes": int(moved),
                    "transport": transport,
                    "seconds": _median(r, "wall_s"),
                    # each run's (round's) median iteration: the runs' spread, stock included
                    "min": min(_median([x], "wall_s") for x in r),
                    "max": max(_median([x], "wall_s") for x in r),
                    "gbps": moved / transport_s / 1e9 if transport_s > 0 else float("inf"),
                    "ratio": rate[transport] / rate["stock"],
                    "env_steps_per_s": rate[transport],
                    "param_mb": mb,
                    "transport_s": transport_s,
                    "compute_s": _median(r, "compute_s"),
                    "learner_s": _median(r, "learner_s"),
                    "lag": statistics.mean(lags) if lags else "",
                    "final_return": statistics.mean(r[0].returns[-3:]),
                    "curves_identical": same,
                    "runs": len(r),
                    "round_ratios": (" ".join(f"{x:.2f}" for x in round_ratios[transport])
                                     if transport != "stock" else ""),
                })
                print(f"  {transport:17s} {rate[transport]:10,.0f} env steps/s  "
                      f"transport {transport_s:.3f}s  compute {rows[-1]['compute_s']:.3f}s  "
                      f"learner {rows[-1]['learner_s']:.3f}s  "
                      f"x{rows[-1]['ratio']:.2f} stock"
                      + (f"  (per round: {rows[-1]['round_ratios']})" if rows[-1]["round_ratios"] else ""),
                      flush=True)
            if POOL_COMPARISON in results:
                # env steps/s of the queue over the Pool's = the Pool's wall time over the queue's
                per_round = [_median([p], "wall_s") / _median([q], "wall_s")
                             for q, p in zip(results["jaxtransport"], results[POOL_COMPARISON])]
                row = next(r for r in rows[-len(results):] if r["transport"] == "jaxtransport")
                row["vs_pool_rounds"] = " ".join(f"{x:.2f}" for x in per_round)
                print(f"  queue/jaxtransport over pool/jaxtransport: "
                      f"{rate['jaxtransport'] / rate[POOL_COMPARISON]:.2f}x "
                      f"(per round: {row['vs_pool_rounds']})", flush=True)
            if backend == "queue":
                continue  # acting overlaps learning: compute + learner is no limit
            jt = results["jaxtransport"]
            free = _median(jt, "compute_s") + _median(jt, "learner_s")
            rows.append({
                "name": f"rollouts-{backend}",
                "size_bytes": int(_median(jt, "bytes_moved")),
                "transport": "compute+learner limit",
                "seconds": free,
                "env_steps_per_s": steps / free,
                "ratio": steps / free / rate["stock"],
                "param_mb": mb,
            })
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        backend = r["name"].removeprefix("rollouts-")
        if r["transport"] != "jaxtransport" or r["param_mb"] != DEFAULT_MB:
            continue
        target = TARGETS[backend]
        ok = r["ratio"] >= target
        curves = ("streaming: curves differ by design (trajectories arrive in varying order, one update stale)" if backend == "queue"
                  else f"learning curves identical: {'yes' if r['curves_identical'] else 'NO'}")
        out.append(
            f"{'PASS' if ok else 'MISS'} {backend}: jaxtransport {r['env_steps_per_s']:,.0f} "
            f"env steps/s = {r['ratio']:.2f}x stock (target >= {target:g}x; {r['runs']} runs each, "
            f"per-pair speedups {r['round_ratios']}); {curves}"
        )
    # Issue 11: the streaming backend above the Pool backend's env steps/s, in the same rounds.
    at = {(r["name"], r["transport"]): r for r in rows if r["param_mb"] == DEFAULT_MB}
    q, p = at.get(("rollouts-queue", "jaxtransport")), at.get(("rollouts-queue", POOL_COMPARISON))
    if q and p:
        qs, ps = q["env_steps_per_s"], p["env_steps_per_s"]
        lag = f"mean lag {q['lag']:.1f}; " if isinstance(q.get("lag"), float) else ""
        out.append(
            f"{'PASS' if qs > ps else 'MISS'} queue vs Pool: queue/jaxtransport {qs:,.0f} env "
            f"steps/s = {qs / ps:.2f}x pool/jaxtransport's {ps:,.0f} in the same rounds (target > 1x; "
            f"{lag}per round: {q.get('vs_pool_rounds', '')})"
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = argparse.ArgumentParser(add_help=False)
    env.add_argument("--env", default="cartpole")
    known, rest = env.parse_known_args(argv)
    if known.env != "cartpole":
        # Atari: actor threads against actor processes (benchmarks/rollouts_atari.py).
        from . import rollouts_atari

        rollouts_atari.GAME = known.env
        return rollouts_atari.main(rest)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="--env pong (or another ALE game): the Atari benchmark, "
                                "threads against processes (benchmarks/rollouts_atari.py)")
    p.add_argument("--quick", action="store_true", help="default policy size only, 8 iterations")
    p.add_argument("--backend", action="append", choices=("pool", "ray", "queue"),
                   help="only this backend (repeatable)")
    p.add_argument("--rounds", type=int, help="rounds at the default size (default 3, quick 1)")
    p.add_argument("--iterations", type=int, help="iterations per run (default 16, quick 8)")
    args = p.parse_args(argv)
    rows = run(args.quick, backends=args.backend, iterations=args.iterations, rounds=args.rounds)
    for line in check_targets(rows):
        print(line)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
