"""Rollouts: how many env steps/s does the learner-workers loop reach with jaxtransport vs stock?

The loop of ``python -m jaxtransport.rollouts`` (2 workers, pixel CartPole, REINFORCE learner)
on the Pool, Ray and streaming queue backends, with the stock transport (``multiprocessing.Pool`` spawn / Ray's
default serialization) and jaxtransport, measured in the same run with the same seed, at several
policy sizes (``--param-mb``). Per iteration it records the wall time and its split: compute
(slowest worker, measured in the worker), learner update, transport (the rest). Figures are
medians over the iterations after the warm-up, pooled over three alternating stock/jaxtransport
pairs at the default size (a Ray run's learner step varies from run to run; the per-pair
speedups are printed too). The "compute+learner limit" row is the env
steps/s the loop would reach if moving the arrays cost nothing.

Targets (issues 6 and 11), at the default sizes: jaxtransport >= 3x the env steps/s of stock on
the Pool and queue backends, >= 2x on Ray; the queue backend above the Pool backend.
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
LABELS = {
    "stock": "stock: multiprocessing.Pool (spawn) / Ray's default serialization",
    "jaxtransport": "jaxtransport: jaxtransport.Pool / jaxtransport.ray",
    "compute+learner limit": "compute + learner only (transport free: the limit)",
}
PLOT_TITLES = {"rollouts-pool": "Pool backend, 2 workers", "rollouts-ray": "Ray backend, 2 workers"}

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


def run(quick: bool = False, backends: list[str] | None = None,
        sizes: list[float] | None = None, iterations: int | None = None,
        rounds: int | None = None) -> list[dict]:
    """``rounds`` (default 3, quick 1) stock/jaxtransport pairs at the default policy size, one
    at the others. The pairs alternate which transport runs first; each figure is the median
    over the timed iterations of all of a transport's runs, and ``round_ratios`` lists each
    pair's own speedup (median iteration vs median iteration), so run-to-run spread shows."""
    sizes = sizes or ([DEFAULT_MB] if quick else [8.0, DEFAULT_MB, 128.0])
    iterations = iterations or (8 if quick else 16)
    rounds = rounds or (1 if quick else 3)
    rows: list[dict] = []
    for backend in backends or _backends():
        for mb in sizes:
            cfg = demo.Config(backend=backend, param_mb=mb, iterations=iterations, warmup=2)
            steps = cfg.workers * cfg.envs * cfg.steps
            results: dict[str, list[demo.RunResult]] = {"stock": [], "jaxtransport": []}
            same = True
            round_ratios = []
            n = rounds if mb == DEFAULT_MB else 1
            for k in range(n):
                order = ("stock", "jaxtransport") if k % 2 == 0 else ("jaxtransport", "stock")
                pair = {}
                for transport in order:
                    print(f"# rollouts: {backend}/{transport}, {mb:g} MiB policy, "
                          f"{iterations} iterations (round {k + 1}/{n})", flush=True)
                    pair[transport] = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
                    results[transport].append(pair[transport])
                same = same and pair["stock"].returns == pair["jaxtransport"].returns
                round_ratios.append(_median([pair["stock"]], "wall_s") / _median([pair["jaxtransport"]], "wall_s"))
            rate = {t: steps / _median(r, "wall_s") for t, r in results.items()}
            for transport, r in results.items():
                moved = _median(r, "bytes_moved")
                transport_s = _median(r, "transport_s")
                rows.append({
                    "name": f"rollouts-{backend}",
                    "size_bytes": int(moved),
                    "transport": transport,
                    "seconds": _median(r, "wall_s"),
                    "gbps": moved / transport_s / 1e9 if transport_s > 0 else float("inf"),
                    "ratio": rate[transport] / rate["stock"],
                    "env_steps_per_s": rate[transport],
                    "param_mb": mb,
                    "transport_s": transport_s,
                    "compute_s": _median(r, "compute_s"),
                    "learner_s": _median(r, "learner_s"),
                    "final_return": statistics.mean(r[0].returns[-3:]),
                    "curves_identical": same,
                    "runs": len(r),
                    "round_ratios": " ".join(f"{x:.2f}" for x in round_ratios) if transport == "jaxtransport" else "",
                })
                print(f"  {transport:13s} {rate[transport]:10,.0f} env steps/s  "
                      f"transport {transport_s:.3f}s  compute {rows[-1]['compute_s']:.3f}s  "
                      f"learner {rows[-1]['learner_s']:.3f}s  "
                      f"speedup {rows[-1]['ratio']:.2f}x"
                      + (f"  (per round: {rows[-1]['round_ratios']})" if rows[-1]["round_ratios"] else ""),
                      flush=True)
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
        curves = ("streaming: curves differ by design (actors do not wait for updates)" if backend == "queue"
                  else f"learning curves identical: {'yes' if r['curves_identical'] else 'NO'}")
        out.append(
            f"{'PASS' if ok else 'MISS'} {backend}: jaxtransport {r['env_steps_per_s']:,.0f} "
            f"env steps/s = {r['ratio']:.2f}x stock (target >= {target:g}x; {r['runs']} runs each, "
            f"per-pair speedups {r['round_ratios']}); {curves}"
        )
    # Issue 11: the streaming backend above the Pool backend's env steps/s in the same run.
    jt = {r["name"]: r for r in rows if r["transport"] == "jaxtransport" and r["param_mb"] == DEFAULT_MB}
    if "rollouts-queue" in jt and "rollouts-pool" in jt:
        q, p = jt["rollouts-queue"]["env_steps_per_s"], jt["rollouts-pool"]["env_steps_per_s"]
        out.append(f"{'PASS' if q > p else 'MISS'} queue: {q:,.0f} env steps/s vs the Pool backend's {p:,.0f} (> 1x)")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="default policy size only, 8 iterations")
    p.add_argument("--backend", action="append", choices=("pool", "ray", "queue"),
                   help="only this backend (repeatable)")
    args = p.parse_args(argv)
    rows = run(args.quick, backends=args.backend)
    for line in check_targets(rows):
        print(line)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
