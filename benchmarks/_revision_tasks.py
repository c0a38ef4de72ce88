"""The child of ``benchmarks.revisions``: copied into a temporary folder that is on the path of
both revisions' processes, so their workers import these task functions by reference. Uses
only what every revision has (the public Pool API)."""

import gc
import json
import statistics
import time

_cache: dict = {}


def shape_of(x):
    return tuple(x.shape)


def cached_array(nbytes):
    import jax.numpy as jnp

    if nbytes not in _cache:
        _cache[nbytes] = jnp.arange(nbytes // 4, dtype=jnp.float32)
    return _cache[nbytes]


def child(sizes, pairs) -> None:
    """One revision's figures (its checkout first on sys.path), printed as one JSON line."""
    import multiprocessing

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxtransport as jt

    out: dict = {}
    ctx = multiprocessing.get_context("spawn")
    with jt.Pool(1) as pool, ctx.Pool(1) as mpool:
        for nbytes in sizes:
            x = jnp.arange(nbytes // 4, dtype=jnp.float32)
            src = np.ones(nbytes, np.uint8)
            dst = np.zeros(nbytes, np.uint8)
            np.copyto(dst, src)
            for name, fn, mfn in (
                ("argument", lambda: pool.apply(shape_of, (x,)), lambda: mpool.apply(shape_of, (x,))),
                ("result", lambda: jax.block_until_ready(pool.apply(cached_array, (nbytes,))),
                 lambda: jax.block_until_ready(mpool.apply(cached_array, (nbytes,)))),
            ):
                for _ in range(3):
                    fn()
                mfn()
                js, ms, ratios, mps = [], [], [], []
                for i in range(pairs):
                    gc.collect()
                    t = time.perf_counter()
                    np.copyto(dst, src)
                    m = time.perf_counter() - t
                    t = time.perf_counter()
                    fn()
                    j = time.perf_counter() - t
                    js.append(j)
                    ms.append(m)
                    ratios.append(j / m)
                    if i % 3 == 0:
                        t = time.perf_counter()
                        mfn()
                        mps.append(time.perf_counter() - t)
                out[f"{name} {nbytes}"] = {
                    "jt": statistics.median(js), "memcpy": statistics.median(ms),
                    "vs_memcpy": statistics.median(ratios), "mp": statistics.median(mps),
                }
            del x, src, dst
    print("REVISION-FIGURES " + json.dumps({"file": jt.__file__, "figures": out}), flush=True)
