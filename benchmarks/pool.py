"""How fast does jaxtransport.Pool move jax.Arrays, against multiprocessing.Pool and
concurrent.futures.ProcessPoolExecutor (spawn, stock pickling), and against a warm memcpy of the
same bytes measured in the same run?

Questions, one per row group:
- ``argument``/``result``: one array argument to a worker (worker returns its shape), or one array
  result back (the worker returns an array it already holds), 1 KiB ... 1 GiB. Each argument is
  a new array, made outside the timed region: the same live array sent again goes by handle, not
  copied (``benchmarks/forward.py`` measures that).
- ``steady``: the same >= 64 MiB round trip repeated (recycled memory, no fresh pages).
- (per-task cost, tasks sent one by one, is ``benchmarks/tasks.py``'s question: it replaced the
  ``tiny`` rows, a 10,000-item ``map`` at its default chunk size that timed a handful of chunks.)
- ``broadcast``: ``share(params)`` + one task per worker, on 1, 2 and 4 workers.

Run ``python -m benchmarks.pool [--quick] [--max-mib N]``. ``run(quick=...)`` returns the rows
(dicts with name, size_bytes, transport, seconds, gbps, ratio, vs_memcpy) for the lead's runner.
Every figure is the median of several repetitions (spread printed); ratio = baseline seconds /
jaxtransport seconds (higher is better) against multiprocessing.Pool.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import multiprocessing
import os
import platform
import statistics
import sys
import time

import numpy as np

from . import _common

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


# -- worker-side functions (importable: spawn re-imports this module)
def shape_of(x):
    return tuple(x.shape)


_CACHE: dict = {}


def cached_array(nbytes):
    import jax.numpy as jnp

    if nbytes not in _CACHE:
        _CACHE.clear()
        _CACHE[nbytes] = jnp.arange(nbytes // 4, dtype=jnp.float32)
    return _CACHE[nbytes]


def noop(x):
    return x


def read_param(args):
    tree, i = args
    return float(tree["w"][i])


# -- helpers
def _median(ts):
    return statistics.median(ts)


def _spread(ts):
    return (max(ts) - min(ts)) / 2 if len(ts) > 1 else 0.0


def _reps(nbytes, baseline=False):
    if nbytes >= 256 * MIB:
        return 2 if baseline else 3
    if nbytes >= 64 * MIB:
        return 5
    return 7


def memcpy_seconds(nbytes, reps=7):
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    return _median(_common.timed(lambda: np.copyto(dst, src), reps))


def environment() -> dict:
    import cloudpickle
    import jax

    cores = _common.usable_cores()
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":")[1].strip()
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "cloudpickle": cloudpickle.__version__,
        "platform": platform.platform(),
        "cores": cores,
        "memory": mem,
        "backend": jax.default_backend(),
    }


def _row(name, nbytes, transport, ts, base=None, memcpy=None, **extra):
    sec = _median(ts)
    row = {
        "name": name,
        "size_bytes": nbytes,
        "transport": transport,
        "seconds": sec,
        "spread": _spread(ts),
        "gbps": (nbytes / sec / 1e9) if nbytes and sec else None,
        "ratio": (base / sec) if base else None,
        "vs_memcpy": (sec / memcpy) if memcpy else None,
        "reps": len(ts),
    }
    row.update(extra)
    return row


def _print_row(r):
    size = r["size_bytes"]
    label = f"{size / MIB:8.3f} MiB" if size else "         -"
    gbps = f"{r['gbps']:7.2f} GB/s" if r["gbps"] else "           "
    ratio = f"  {r['ratio']:7.1f}x vs mp.Pool" if r.get("ratio") else ""
    vsm = f"  {r['vs_memcpy']:5.2f}x memcpy" if r.get("vs_memcpy") else ""
    print(f"{r['name']:<14} {label} {r['transport']:<22} {r['seconds'] * 1e3:10.3f} ms "
          f"(+-{r['spread'] * 1e3:.3f}) {gbps}{ratio}{vsm}", flush=True)


# -- the benchmarks
def bench_transfers(sizes, baselines_up_to, rows):
    import jax
    import jax.numpy as jnp

    import jaxtransport as jt

    ctx = multiprocessing.get_context("spawn")
    with jt.Pool(1) as jpool, ctx.Pool(1) as mpool, concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        for p in (lambda: jpool.apply(noop, (0,)), lambda: mpool.apply(noop, (0,)), lambda: ex.submit(noop, 0).result()):
            p()
        for nbytes in sizes:
            x = jnp.arange(nbytes // 4, dtype=jnp.float32)
            x.block_until_ready()
            mem = memcpy_seconds(nbytes)
            rows.append(_row("memcpy", nbytes, "memcpy", [mem]))
            _print_row(rows[-1])
            for direction in ("argument", "result"):
                prepare = None
                if direction == "argument":
                    # A new array each call (the same one again goes by handle: forward.py).
                    prepare = _common.fresh_copies(x)
                    jt_fn = lambda a: jpool.apply(shape_of, (a,))
                    mp_fn = lambda a: mpool.apply(shape_of, (a,))
                    ex_fn = lambda a: ex.submit(shape_of, a).result()
                else:
                    def jt_fn():
                        jax.block_until_ready(jpool.apply(cached_array, (nbytes,)))

                    def mp_fn():
                        jax.block_until_ready(mpool.apply(cached_array, (nbytes,)))

                    def ex_fn():
                        jax.block_until_ready(ex.submit(cached_array, nbytes).result())
                first = _common.timed(jt_fn, 1, warmup=0, prepare=prepare)[0]  # new segments, first touch
                jts = _common.timed(jt_fn, _reps(nbytes), warmup=1, prepare=prepare)
                base = None
                if nbytes <= baselines_up_to:
                    warm = 1 if nbytes <= 64 * MIB else 0
                    mps = _common.timed(mp_fn, _reps(nbytes, True), warmup=warm, prepare=prepare)
                    exs = _common.timed(ex_fn, _reps(nbytes, True), warmup=warm, prepare=prepare)
                    base = _median(mps)
                    rows.append(_row(direction, nbytes, "multiprocessing.Pool", mps, memcpy=mem))
                    _print_row(rows[-1])
                    rows.append(_row(direction, nbytes, "ProcessPoolExecutor", exs, memcpy=mem))
                    _print_row(rows[-1])
                rows.append(_row(direction, nbytes, "jaxtransport.Pool", jts, base=base, memcpy=mem,
                                 first_seconds=first))
                _print_row(rows[-1])
            del x
            gc.collect()


def bench_steady(sizes, rows, loops=15):
    """Each round trip is timed right after a warm memcpy of the same bytes (the pair
    alternates with gc in between): ``vs_memcpy`` is the median of the per-pair ratios, so a
    noisy moment hits both sides of a pair alike."""
    import jax
    import jax.numpy as jnp

    import jaxtransport as jt

    with jt.Pool(1) as pool:
        for nbytes in sizes:
            x = jnp.arange(nbytes // 4, dtype=jnp.float32)
            src = np.ones(nbytes, np.uint8)
            dst = np.zeros(nbytes, np.uint8)
            np.copyto(dst, src)
            fresh = _common.fresh_copies(x)  # a new array each call (the same one: by handle)
            for _ in range(2):
                pool.apply(shape_of, (fresh(),))
                jax.block_until_ready(pool.apply(cached_array, (nbytes,)))
            for direction, fn, prepare in (
                ("steady_argument", lambda a: pool.apply(shape_of, (a,)), fresh),
                ("steady_result", lambda: jax.block_until_ready(pool.apply(cached_array, (nbytes,))), None),
            ):
                _common.timed(fn, 0, warmup=2, prepare=prepare)
                ts, mems = [], []
                for _ in range(loops):
                    mems.extend(_common.timed(lambda: np.copyto(dst, src), 1, warmup=0))
                    ts.extend(_common.timed(fn, 1, warmup=0, prepare=prepare))
                row = _row(direction, nbytes, "jaxtransport.Pool", ts, memcpy=_median(mems))
                row["vs_memcpy"] = _median([t / m for t, m in zip(ts, mems)])
                rows.append(row)
                _print_row(rows[-1])
            del x, src, dst


def sleep_for(seconds):
    time.sleep(seconds)
    return seconds


def array_sum(x):
    return float(x.sum())


def bench_beside_long(rows, quick_tasks=20, long_s=1.0, reps=7):
    """Quick tasks (300 KB numpy argument, through the pipe) submitted right after one long task
    on a 2-worker pool: seconds until all quick ones are done (issue 10, item 1)."""
    import numpy as np

    import jaxtransport as jt

    ctx = multiprocessing.get_context("spawn")
    arg = np.ones(300_000 // 8)

    def once(pool):
        long = pool.apply_async(sleep_for, (long_s,))
        time.sleep(0.1)
        t0 = time.perf_counter()
        rs = [pool.apply_async(array_sum, (arg,)) for _ in range(quick_tasks)]
        for r in rs:
            r.get()
        dt = time.perf_counter() - t0
        long.get()
        return dt

    with jt.Pool(2) as jpool, ctx.Pool(2) as mpool:
        jpool.map(noop, range(10))
        mpool.map(noop, range(10))
        mts, jts = [], []
        for k in range(reps):
            for out, pool in (((mts, mpool), (jts, jpool)) if k % 2 == 0 else ((jts, jpool), (mts, mpool))):
                out.append(once(pool))
    rows.append(_row("beside_long", 300_000, "multiprocessing.Pool", mts, tasks=quick_tasks))
    _print_row(rows[-1])
    rows.append(_row("beside_long", 300_000, "jaxtransport.Pool", jts, base=_median(mts), tasks=quick_tasks))
    _print_row(rows[-1])


def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


def bench_stopped(rows, quick_tasks=20, reps=7, mp_stop_s=1.0):
    """One of two workers is stopped (SIGSTOP) while idle, then quick tasks (300 KB numpy
    argument) are submitted: seconds until all are done (issue 21, item 3). jaxtransport sends
    the first to the stopped worker (it was idle) and takes it back after ``STALL_S``, so the
    gap to the same run with no worker stopped is the time from a worker's stop to its
    unstarted chunks running elsewhere. multiprocessing.Pool's idle worker waits for a task
    holding the shared queue's read lock: stopped, it stalls every worker until SIGCONT, sent
    here after ``mp_stop_s`` (its row includes that wait)."""
    import signal

    import jaxtransport as jt

    ctx = multiprocessing.get_context("spawn")
    arg = np.ones(300_000 // 8)

    def pids(pool):
        rs = [pool.apply_async(pid_after, (0.3,)) for _ in range(2)]
        return sorted({r.get() for r in rs})

    def once(pool, stop, cont_after=None):
        victim = pids(pool)[0]
        if stop:
            os.kill(victim, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            rs = [pool.apply_async(array_sum, (arg,)) for _ in range(quick_tasks)]
            if cont_after is not None:
                rs[-1].wait(cont_after)
                os.kill(victim, signal.SIGCONT)
            for r in rs:
                r.get()
            return time.perf_counter() - t0
        finally:
            if stop:
                os.kill(victim, signal.SIGCONT)

    with jt.Pool(2) as jpool, ctx.Pool(2) as mpool:
        jpool.map(noop, range(10))
        mpool.map(noop, range(10))
        mts, jts, nts = [], [], []
        for k in range(reps):
            mts.append(once(mpool, True, cont_after=mp_stop_s))
            jts.append(once(jpool, True))
            nts.append(once(jpool, False))
    rows.append(_row("stopped_worker", 300_000, "multiprocessing.Pool", mts, tasks=quick_tasks,
                     note=f"stalled until SIGCONT after {mp_stop_s} s"))
    _print_row(rows[-1])
    rows.append(_row("stopped_worker", 300_000, "jaxtransport.Pool, no worker stopped", nts, base=_median(mts),
                     tasks=quick_tasks))
    _print_row(rows[-1])
    rows.append(_row("stopped_worker", 300_000, "jaxtransport.Pool", jts, base=_median(mts), tasks=quick_tasks,
                     take_back_s=_median(jts) - _median(nts)))
    _print_row(rows[-1])
    print(f"{'':14} stop -> its unstarted chunks done elsewhere: {_median(jts) - _median(nts):.3f} s "
          f"over the run with no worker stopped", flush=True)


def bench_broadcast(nbytes, rows, workers=(1, 2, 4), reps=5):
    import jax.numpy as jnp

    import jaxtransport as jt

    params = {"w": jnp.arange(nbytes // 4, dtype=jnp.float32), "b": jnp.ones(16)}
    one = None
    for n in workers:
        with jt.Pool(n) as pool:
            pool.map(noop, range(4 * n), chunksize=1)

            def once(p):
                shared = pool.share(p)
                out = pool.map(read_param, [(shared, i) for i in range(n)], chunksize=1)
                shared.release()
                return out

            # New parameters each time, as a learner's each step (the same ones: by handle).
            new_w = _common.fresh_copies(params["w"])
            ts = _common.timed(once, reps, warmup=2, prepare=lambda: {"w": new_w(), "b": params["b"]})
        sec = _median(ts)
        if one is None:
            one = sec
        rows.append(_row("broadcast", nbytes, f"jaxtransport.Pool x{n}", ts, workers=n, vs_one_worker=sec / one))
        _print_row(rows[-1])
        print(f"{'':14} {n} workers / 1 worker = {sec / one:.2f}x", flush=True)


GROUPS = ("transfers", "steady", "beside_long", "stopped_worker", "broadcast")


def run(quick: bool = False, max_bytes: int | None = None, only: tuple = GROUPS) -> list[dict]:
    """Run the benchmarks named in ``only`` (default: all); return the rows (also printed)."""
    env = environment()
    print("environment:", ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    top = max_bytes or (256 * MIB if quick else GIB)
    sizes = [s for s in (KIB, 16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB) if s <= top]
    rows: list[dict] = []
    if "transfers" in only:
        bench_transfers(sizes, baselines_up_to=top, rows=rows)
    if "steady" in only:
        bench_steady([s for s in (64 * MIB, 256 * MIB) if s <= top], rows)
    if "beside_long" in only:
        bench_beside_long(rows)
    if "stopped_worker" in only:
        bench_stopped(rows)
    if "broadcast" in only:
        bench_broadcast(64 * MIB if quick else 256 * MIB, rows)
    return rows


PLOT_X = "size_bytes"
PLOT_Y = "seconds"
LIMIT_TRANSPORTS = ("memcpy",)
BASELINE = "multiprocessing.Pool"
ANNOTATE = ("jaxtransport.Pool",)
LABELS = {
    "multiprocessing.Pool": "multiprocessing.Pool (spawn, stock pickling)",
    "ProcessPoolExecutor": "concurrent.futures.ProcessPoolExecutor (spawn)",
    "jaxtransport.Pool": "jaxtransport.Pool (median of repeated calls)",
    "jaxtransport.Pool, steady state": "jaxtransport.Pool, steady state (calls alternating "
                                       "with a memcpy)",
    "memcpy": "warm memcpy of the same bytes (the limit)",
}
PLOT_TITLES = {
    "argument": "a task with one jax.Array argument",
    "result": "a task returning one jax.Array",
}


def plot_rows(rows: list[dict]) -> list[dict]:
    """The plot's view of the rows: the steady-state round trips (``steady_*``) are drawn in
    their direction's panel, next to the baselines they are compared with."""
    out = []
    for r in rows:
        name = r.get("name", "")
        if name.startswith("steady_"):
            r = dict(r, name=name.removeprefix("steady_"),
                     transport="jaxtransport.Pool, steady state")
        out.append(r)
    return out


def check_targets(rows: list[dict]) -> list[str]:
    """PASS/MISS lines against issues 3 and 4's targets."""
    out = []

    def line(ok, text):
        out.append(f"{'PASS' if ok else 'MISS'} {text}")

    for r in rows:
        if r["transport"] != "jaxtransport.Pool":
            continue
        if r["name"] in ("argument", "result") and r["size_bytes"] >= 64 * MIB and r["ratio"]:
            line(r["ratio"] >= 10, f"{r['name']} {r['size_bytes'] // MIB} MiB: {r['ratio']:.1f}x multiprocessing.Pool (>= 10x)")
        if r["name"].startswith("steady"):
            line(r["vs_memcpy"] <= 2, f"{r['name']} {r['size_bytes'] // MIB} MiB: {r['vs_memcpy']:.2f}x warm memcpy (<= 2x; stretch 1.25x)")
        if r["name"] == "beside_long":
            line(r["ratio"] >= 1 / 1.5, f"{r['tasks']} quick tasks beside a long one: {1 / r['ratio']:.2f}x multiprocessing.Pool's time (<= 1.5x)")
    # Like with like: the steady argument round trip against multiprocessing.Pool moving the
    # same argument, the steady result against it moving the same result.
    mp = {(r["name"], r["size_bytes"]): r["seconds"] for r in rows if r["transport"] == "multiprocessing.Pool"}
    for r in rows:
        key = (r["name"].removeprefix("steady_"), r["size_bytes"])
        if r["name"].startswith("steady") and key in mp:
            ratio = mp[key] / r["seconds"]
            line(ratio >= 50, f"{r['name']} {r['size_bytes'] // MIB} MiB: {ratio:.0f}x multiprocessing.Pool (>= 50x)")
    for r in rows:
        if r["name"] == "broadcast" and r.get("workers") == 4:
            line(r["vs_one_worker"] <= 1.3, f"share() + 1 task/worker, 4 workers: {r['vs_one_worker']:.2f}x of 1 worker (<= 1.3x)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 256 MiB")
    ap.add_argument("--max-mib", type=int, default=None, help="largest transfer in MiB")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    args = ap.parse_args(argv)
    only = tuple(g for g in args.only.split(",") if g)
    unknown = [g for g in only if g not in GROUPS]
    if unknown:
        ap.error(f"unknown benchmark group(s) {unknown}; choose from {GROUPS}")
    rows = run(quick=args.quick, max_bytes=args.max_mib * MIB if args.max_mib else None, only=only)
    _common.print_targets(check_targets(rows))

if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.pool"))
