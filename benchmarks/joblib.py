"""Does joblib run JAX work faster on the jaxtransport backend than on loky, its default?

``joblib.Parallel(n_jobs=2)`` on the ``"jaxtransport"`` backend (``jaxtransport.joblib``) against
loky, both with warm workers, in the same run, alternating case by case:

- 8 jax.Array **arguments** of 64 MiB (the task returns a scalar): loky pickles each through
  JAX's ``__reduce__``; jaxtransport moves them through shared memory;
- 8 jax.Array **results** of 64 MiB, made in the worker (compute included on both sides);
- 8 numpy arguments of 64 MiB: loky memory-maps them through ``/dev/shm`` files;
- 10,000 tiny tasks (``batch_size="auto"``): the per-task cost;
- the backend itself against ``jaxtransport.Pool.map`` on the same 8 jax.Array arguments;
- hashing a 1 GiB jax.Array with ``jaxtransport.joblib.hash`` against ``joblib.hash`` of the same
  numpy array (cache keys, ``jaxtransport.joblib.Memory``).

ratio = the baseline's median seconds / this row's (above 1: faster than the baseline).
``--quick`` shrinks the arrays (16 MiB, 256 MiB to hash) and the tiny tasks (2,000): for checking
direction only.
"""

from __future__ import annotations

import statistics
import time

MIB = 1 << 20


def _shape_of(x):
    return tuple(x.shape)


def _make(i, n):
    import jax.numpy as jnp

    return jnp.full((n,), i, dtype=jnp.float32)


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run(quick: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import joblib
    import numpy as np

    import jaxtransport as jt
    import jaxtransport.joblib as jtj

    from . import _common

    jtj.register()
    size = (16 if quick else 64) * MIB
    n = size // 4
    reps = 3 if quick else 7
    tiny = 2_000 if quick else 10_000
    hash_size = (256 if quick else 1024) * MIB
    xs = [jnp.full((n,), i, dtype=jnp.float32) for i in range(8)]
    jax.block_until_ready(xs)

    def renew():
        """New arrays in ``xs`` before each timed call, made outside it: a jaxtransport pool
        sends the same live array again by handle (``benchmarks/forward.py`` measures that)."""
        xs[:] = jax.block_until_ready([x + 0 for x in xs])
    nps = [np.full((n,), i, dtype=np.float32) for i in range(8)]
    rows: list[dict] = []

    def par(backend):
        return joblib.Parallel(n_jobs=2, backend=backend)

    def record(name, nbytes, runs, baseline):
        base = statistics.median(runs[baseline])
        for transport, ts in runs.items():
            med = statistics.median(ts)
            rows.append(_common.row(name, nbytes, transport, med, ratio=base / med, min_s=min(ts), max_s=max(ts),
                                    reps=len(ts), baseline=baseline))
            print(f"{name:34s} {transport:26s} {med:9.4f} s (min {min(ts):.4f}, max {max(ts):.4f})  "
                  f"{base / med:6.2f}x {baseline}", flush=True)

    cases = {
        f"8 jax.Array arguments of {size // MIB} MiB": (
            8 * size,
            lambda b: par(b)(joblib.delayed(_shape_of)(x) for x in xs),
        ),
        f"8 jax.Array results of {size // MIB} MiB": (
            8 * size,
            lambda b: jax.block_until_ready(par(b)(joblib.delayed(_make)(i, n) for i in range(8))),
        ),
        f"8 numpy arguments of {size // MIB} MiB": (
            8 * size,
            lambda b: par(b)(joblib.delayed(_shape_of)(x) for x in nps),
        ),
        f"{tiny:,} tiny tasks": (
            8,
            lambda b: par(b)(joblib.delayed(abs)(-i) for i in range(tiny)),
        ),
    }
    try:
        for name, (nbytes, call) in cases.items():
            for b in ("loky", "jaxtransport"):  # warm-up: workers started, JAX imported there
                call(b)
            runs: dict[str, list[float]] = {"loky": [], "jaxtransport backend": []}
            for _ in range(reps):
                renew()
                runs["loky"] += _timed(lambda: call("loky"), 1)
                renew()
                runs["jaxtransport backend"] += _timed(lambda: call("jaxtransport"), 1)
            record(name, nbytes, runs, "loky")

        with jt.Pool(2) as pool:
            pool.map(_shape_of, xs)
            par("jaxtransport")(joblib.delayed(_shape_of)(x) for x in xs)
            runs = {"jaxtransport.Pool.map": [], "jaxtransport backend": []}
            for _ in range(reps):
                renew()
                runs["jaxtransport.Pool.map"] += _timed(lambda: pool.map(_shape_of, xs, chunksize=1), 1)
                renew()
                runs["jaxtransport backend"] += _timed(
                    lambda: par("jaxtransport")(joblib.delayed(_shape_of)(x) for x in xs), 1
                )
            record(f"backend vs Pool.map, 8 x {size // MIB} MiB", 8 * size, runs, "jaxtransport.Pool.map")
    finally:
        jtj.shutdown()
        from joblib.externals.loky import get_reusable_executor

        get_reusable_executor().shutdown(wait=True)

    del xs, nps
    big = jnp.arange(hash_size // 4, dtype=jnp.float32)
    jax.block_until_ready(big)
    big_np = np.array(big)
    jtj.hash(big), joblib.hash(big_np)
    runs = {"joblib.hash (numpy)": [], "jaxtransport.joblib.hash (jax.Array)": []}
    for _ in range(reps):
        runs["joblib.hash (numpy)"] += _timed(lambda: joblib.hash(big_np), 1)
        runs["jaxtransport.joblib.hash (jax.Array)"] += _timed(lambda: jtj.hash(big), 1)
    record(f"hash a {hash_size // MIB} MiB array", hash_size, runs, "joblib.hash (numpy)")
    return rows


# (row name prefix, transport, minimum ratio = baseline seconds / this row's, the wording)
TARGETS = (
    ("8 jax.Array arguments", "jaxtransport backend", 10.0, ">= 10x loky"),
    ("8 jax.Array results", "jaxtransport backend", 3.0, ">= 3x loky"),
    ("8 numpy arguments", "jaxtransport backend", 2.0, ">= 2x loky's memory-mapping"),
    ("tiny tasks", "jaxtransport backend", 1 / 1.2, "<= 1.2x loky's time"),
    ("backend vs Pool.map", "jaxtransport backend", 1 / 1.1, "<= 1.1x jaxtransport.Pool.map's time"),
    ("hash a", "jaxtransport.joblib.hash (jax.Array)", 1 / 1.2, "<= 1.2x joblib.hash of numpy"),
)


def check_targets(rows: list[dict]) -> list[str]:
    out = []
    for prefix, transport, minimum, wording in TARGETS:
        for r in rows:
            if prefix in r["name"] and r["transport"] == transport:
                ok = r["ratio"] >= minimum
                out.append(
                    f"{'PASS' if ok else 'MISS'} {r['name']}: {r['ratio']:.2f}x {r['baseline']}'s speed "
                    f"(target: {wording})"
                )
    return out
