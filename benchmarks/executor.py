"""Does jaxtransport.Executor move arrays as fast as jaxtransport.Pool (the same engine)?

A 64 MiB and a 256 MiB jax.Array argument, returned unchanged (so the result travels back as a
handle to the parent's own slot), round trip after warm-up: ``Pool.apply`` against
``Executor.submit(...).result()``, one worker each, alternating call by call so both see the same
machine. Also the per-call cost of a tiny task (``submit`` + ``result`` against ``apply``).
ratio = Pool seconds / Executor seconds (1.0: the same; the target is "within noise").
"""

from __future__ import annotations

import statistics
import time

MIB = 1 << 20


def noop(x):
    return x


def run(quick: bool = False) -> list[dict]:
    import jax.numpy as jnp

    import jaxtransport as jt

    from . import _common

    reps = 7 if quick else 21
    rows = []
    with jt.Pool(1) as pool, jt.Executor(1) as ex:
        cases = [(f"{n} MiB round trip", n * MIB, jnp.arange(n * MIB // 4, dtype=jnp.float32))
                 for n in (64, 256)]
        cases.append(("tiny task", 8, 1))
        for name, size, x in cases:
            calls = {
                "jaxtransport.Pool": lambda a: pool.apply(noop, (a,)),
                "jaxtransport.Executor": lambda a: ex.submit(noop, a).result(),
            }
            # An array: a new one each call (the same one again goes by handle: forward.py).
            new = _common.fresh_copies(x) if size > 8 else (lambda: x)
            times: dict[str, list[float]] = {k: [] for k in calls}
            n = 200 if size == 8 else 1
            for _ in range(3):
                for call in calls.values():
                    call(new())
            for _ in range(reps):
                for k, call in calls.items():
                    args = [new() for _ in range(n)]
                    t0 = time.perf_counter()
                    for a in args:
                        call(a)
                    times[k].append((time.perf_counter() - t0) / n)
                    del args
            base = statistics.median(times["jaxtransport.Pool"])
            for k, ts in times.items():
                med = statistics.median(ts)
                rows.append(_common.row(name, size, k, med, ratio=base / med, min_s=min(ts), max_s=max(ts), reps=len(ts)))
                print(f"{name:18s} {k:24s} {med * 1e3:8.3f} ms (min {min(ts) * 1e3:.3f}, max {max(ts) * 1e3:.3f})"
                      f"  {base / med:.2f}x Pool")
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["transport"] == "jaxtransport.Executor":
            ok = r["ratio"] >= 0.9
            out.append(f"{'PASS' if ok else 'MISS'} Executor {r['name']}: {r['ratio']:.2f}x the Pool's speed (target: within noise, >= 0.9x)")
    return out
