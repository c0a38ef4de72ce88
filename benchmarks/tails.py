"""Latency tails (issue 49): p50, p99 and max over many rounds of a fresh array moved by
jaxtransport and by stock ``multiprocessing`` in the same run, with each step timed in the
process that runs it.

Cases, 2 workers each (the queue: one consumer process), a new array every round. Steps:
``production`` (the sender makes the array), ``transfer`` (the array's way from the sender's
last line to the receiver's first; where the parent sends through jaxtransport, split into
``copy``, into shared memory, and ``delivery``, the rest), ``receiver`` (the receiver reads all of it: ``jnp.sum``),
the tiny message the other way (``request`` / ``ack``), and ``round``:

- ``Pool argument``: the parent makes the array, ``Pool.apply`` takes it to a worker, the
  worker reads it and answers.
- ``Pool result``: the task's ``request`` reaches a worker, which makes the array
  (``jnp.full(...).block_until_ready()``: the worker's own computation), it comes back
  (``apply`` returns), the parent reads it.
- ``queue round``: the parent makes the array, ``put`` (``jaxtransport.multiprocessing`` or
  stock ``multiprocessing``) to the consumer's ``get``, its read, an ``ack`` back.
- ``Executor``: the parent makes the array, ``submit`` takes it to a worker, the worker makes a
  new one from it (``worker``: ``x + 1``), which comes back (``transfer back``: ``result()``
  returns) and the parent reads it. Stock: ``concurrent.futures.ProcessPoolExecutor``.

Every step is timed with ``time.monotonic()``, one clock for all processes of the host; a
step in a worker also records its minor page faults and CPU time there (``getrusage``: CPU time
has no run-queue wait in it, so a tail that is in CPU time is the step's own and not the load).
``round`` is the whole round as the caller sees it (production excluded where the parent makes
the array: the ``apply``/``put``...``get``/``submit``...``result`` plus the read).

Size: 64 MiB float32 on a CPU backend, 256 MiB when JAX's default backend is an accelerator
(``--size MIB`` sets it); 100 rounds (60 on an accelerator; ``--rounds``) after 3 warm-up
rounds (and, where the workers make arrays, each worker making a few first: the steady
state). ``--quick``: 4 MiB, 20 rounds. Target (issue 49): p99 <= 2x p50 for each jaxtransport
round; a worker's own computation no slower than in a stock worker at p50 and p99.
Run ``python -m benchmarks --only tails [--quick]`` or ``python -m benchmarks.tails [--size MIB]
[--rounds N]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import math
import multiprocessing
import os
import resource
import sys
import time

from . import _common

MIB = 1 << 20
JT, STOCK = "jaxtransport", "multiprocessing"
CASES = ("Pool argument", "Pool result", "queue round", "Executor")
STEPS = ("request", "production", "transfer", "copy", "delivery", "worker", "transfer back", "receiver", "ack",
         "round")
WARMUP = 3
# Arrays each worker makes before the rounds where workers make them: a worker's heap grows to its
# working set over its first few (Note [a warm heap in workers]); 2 each left one worker's
# Executor rounds still taking fresh pages.
WARM_EACH = 6
WORKERS = 2


# -- what runs in the other processes (module level: spawned children import them)
def _usage() -> tuple[int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


def _read(x) -> tuple[float, int, float]:
    """Read all of ``x`` (a sum); (when it ended, minor faults, CPU seconds)."""
    import jax.numpy as jnp

    f0, c0 = _usage()
    float(jnp.sum(x))
    f1, c1 = _usage()
    return time.monotonic(), f1 - f0, c1 - c0


def receive(x):
    """Pool argument, in the worker: (arrived, read end, faults, cpu)."""
    arrived = time.monotonic()
    end, faults, cpu = _read(x)
    return arrived, end, faults, cpu


def produce(n: int, value: float):
    """Pool result, in the worker: a fresh array of ``n`` float32 and (start, end, faults,
    cpu) of making it."""
    import jax.numpy as jnp

    start = time.monotonic()
    f0, c0 = _usage()
    x = jnp.full((n,), value, jnp.float32).block_until_ready()
    f1, c1 = _usage()
    return x, (start, time.monotonic(), f1 - f0, c1 - c0)


def add_one(x):
    """Executor, in the worker: a new array made from the argument, and (arrived, made,
    faults, cpu)."""
    arrived = time.monotonic()
    f0, c0 = _usage()
    y = (x + 1).block_until_ready()
    f1, c1 = _usage()
    return y, (arrived, time.monotonic(), f1 - f0, c1 - c0)


def consume(chan, ack):
    """The queue's consumer: get, read, answer (arrived, read end, faults, cpu); None ends."""
    while True:
        x = chan.get()
        arrived = time.monotonic()
        if x is None:
            return
        end, faults, cpu = _read(x)
        del x
        ack.put((arrived, end, faults, cpu))


def warm(_=None) -> int:
    import jax

    jax.devices()
    return 0


# -- the parent's side
def _percentile(ts: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(ts)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class _Rounds:
    """Each step's seconds (and faults, CPU seconds where measured) over the timed rounds."""

    def __init__(self):
        self.t: dict[str, list[float]] = {}
        self.faults: dict[str, list[int]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, step: str, seconds: float, faults: int | None = None, cpu: float | None = None) -> None:
        self.t.setdefault(step, []).append(seconds)
        if faults is not None:
            self.faults.setdefault(step, []).append(faults)
        if cpu is not None:
            self.cpu.setdefault(step, []).append(cpu)


def _fresh_maker(n: int):
    """A function returning a new ready jax.Array of ``n`` float32 (the sender's production)
    and (seconds, faults, cpu) of making it."""
    import jax
    import jax.numpy as jnp

    base = jnp.arange(n, dtype=jnp.float32)
    jax.block_until_ready(base)

    def make():
        f0, c0 = _usage()
        t0 = time.monotonic()
        x = jax.block_until_ready(base + 0)
        t1 = time.monotonic()
        f1, c1 = _usage()
        return x, (t1 - t0, f1 - f0, c1 - c0)

    return make


def _parent_read(x) -> tuple[float, int, float]:
    t0 = time.monotonic()
    _end, faults, cpu = _read(x)
    return time.monotonic() - t0, faults, cpu


class _CommitClock:
    """While installed, when the parent's last ``jaxtransport._wire.commit`` ended: the copy of a
    message's arrays into shared memory (from the chip, in pieces), before the message goes."""

    def __enter__(self):
        from jaxtransport import _wire

        self.real, self.last = _wire.commit, None

        def timed(*args, **kwargs):
            out = self.real(*args, **kwargs)
            self.last = time.monotonic()
            return out

        _wire.commit = timed
        return self

    def __exit__(self, *exc) -> None:
        from jaxtransport import _wire

        _wire.commit = self.real


def _sent_rounds(make, rounds: int, send) -> _Rounds:
    """Rounds of an array made here and sent: ``send(x)`` returns the receiver's ``(arrived,
    end, faults, cpu)`` (:func:`receive`). Through jaxtransport the transfer is also split at
    the end of the parent's copy into shared memory: ``copy`` and ``delivery`` (the message's
    way from there to the receiver's first line)."""
    out = _Rounds()
    with _CommitClock() as clock:
        for i in range(WARMUP + rounds):
            x, (prod, pf, pc) = make()
            gc.collect()
            clock.last = None
            t1 = time.monotonic()
            arrived, end, faults, cpu = send(x)
            t2 = time.monotonic()
            copied = clock.last
            del x
            if i >= WARMUP:
                out.add("production", prod, pf, pc)
                out.add("transfer", arrived - t1)
                if copied is not None and t1 <= copied <= arrived:
                    out.add("copy", copied - t1)
                    out.add("delivery", arrived - copied)
                out.add("receiver", end - arrived, faults, cpu)
                out.add("ack", t2 - end)
                out.add("round", t2 - t1)
    return out


def _pool_argument(pool, make, rounds: int) -> _Rounds:
    return _sent_rounds(make, rounds, lambda x: pool.apply(receive, (x,)))


def _pool_result(pool, n: int, rounds: int) -> _Rounds:
    out = _Rounds()
    # Every worker makes the array a few times first (a worker's first arrays of a size take
    # fresh pages; the rounds measure the steady state).
    pool.starmap(produce, [(n, 0.0)] * (WARM_EACH * WORKERS), chunksize=1)
    for i in range(WARMUP + rounds):
        gc.collect()
        t0 = time.monotonic()
        x, (start, end, faults, cpu) = pool.apply(produce, (n, float(i)))
        t2 = time.monotonic()
        read, rf, rc = _parent_read(x)
        del x
        if i >= WARMUP:
            out.add("request", start - t0)  # the task's way to the worker
            out.add("production", end - start, faults, cpu)
            out.add("transfer", t2 - end)
            out.add("receiver", read, rf, rc)
            out.add("round", t2 - t0 + read)
    return out


def _executor(ex, make, rounds: int) -> _Rounds:
    out = _Rounds()
    x, _ = make()
    for _ in ex.map(add_one, [x] * (WARM_EACH * WORKERS)):  # every worker makes some first (as _pool_result)
        pass
    del x
    for i in range(WARMUP + rounds):
        x, (prod, pf, pc) = make()
        gc.collect()
        t1 = time.monotonic()
        y, (arrived, made, faults, cpu) = ex.submit(add_one, x).result()
        t2 = time.monotonic()
        del x
        read, rf, rc = _parent_read(y)
        del y
        if i >= WARMUP:
            out.add("production", prod, pf, pc)
            out.add("transfer", arrived - t1)
            out.add("worker", made - arrived, faults, cpu)
            out.add("transfer back", t2 - made)
            out.add("receiver", read, rf, rc)
            out.add("round", t2 - t1 + read)
    return out


def _queue(ctx, make, rounds: int) -> _Rounds:
    chan, ack = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consume, args=(chan, ack), daemon=True)
    proc.start()

    def send(x):
        chan.put(x)
        return ack.get(timeout=600)

    try:
        out = _sent_rounds(make, rounds, send)
    finally:
        chan.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return out


def _rows(case: str, transport: str, nbytes: int, rec: _Rounds) -> list[dict]:
    rows = []
    for step in STEPS:
        ts = rec.t.get(step)
        if not ts:
            continue
        p50, p99 = _percentile(ts, 50), _percentile(ts, 99)
        row = {"name": case, "size_bytes": nbytes, "transport": transport, "step": step, "seconds": p50,
               "p99": p99, "max": max(ts), "p99_over_p50": p99 / p50 if p50 > 0 else None, "rounds": len(ts)}
        if step in rec.faults:
            row["faults_p50"] = _percentile(rec.faults[step], 50)
            row["faults_max"] = max(rec.faults[step])
        if step in rec.cpu:
            row["cpu_p50"] = _percentile(rec.cpu[step], 50)
            row["cpu_p99"] = _percentile(rec.cpu[step], 99)
        rows.append(row)
        _print(row)
    return rows


def _print(r: dict) -> None:
    extra = ""
    if "faults_p50" in r:
        extra = (f"  faults p50 {r['faults_p50']:.0f} max {r['faults_max']}  cpu p50 {r['cpu_p50'] * 1e3:.1f}"
                 f" p99 {r['cpu_p99'] * 1e3:.1f} ms")
    print(f"{r['name']:<14} {r['transport']:<16} {r['step']:<14} p50 {r['seconds'] * 1e3:8.2f}"
          f"  p99 {r['p99'] * 1e3:8.2f}  max {r['max'] * 1e3:8.2f} ms  p99/p50 {r['p99_over_p50']:5.2f}{extra}",
          flush=True)


def default_size() -> int:
    """64 MiB on a CPU backend, 256 MiB on an accelerator (issue 49)."""
    import jax

    return 64 * MIB if jax.default_backend() == "cpu" else 256 * MIB


def run(quick: bool = False, size: int | None = None, rounds: int | None = None,
        cases: tuple[str, ...] = CASES, stock: bool = True) -> list[dict]:
    import jax

    accelerator = jax.default_backend() != "cpu"
    nbytes = size or (4 * MIB if quick else default_size())
    rounds = rounds or (20 if quick else (60 if accelerator else 100))
    n = nbytes // 4
    print(f"# tails: {nbytes / MIB:g} MiB float32, {rounds} rounds after {WARMUP} warm-up, {WORKERS} workers; "
          f"{_common.versions_line()}, backend {jax.default_backend()}", flush=True)
    make = _fresh_maker(n)
    spawn = multiprocessing.get_context("spawn")
    transports = (JT, STOCK) if stock else (JT,)
    rows: list[dict] = []
    for transport in transports:
        with _stock_children_on_cpu(accelerator and transport == STOCK):
            rows += _run_transport(transport, cases, nbytes, n, rounds, make, spawn)
    order = {(c, t): i for i, (c, t) in enumerate((c, t) for c in CASES for t in (JT, STOCK))}
    rows.sort(key=lambda r: order[(r["name"], r["transport"])])  # stable: steps keep their order
    return rows


@contextlib.contextmanager
def _stock_children_on_cpu(on: bool):
    """With ``on``: stock children start with ``JAX_PLATFORMS=cpu`` (this process holds the
    accelerator, which a second process cannot open; jaxtransport's workers get the same from
    its device plan)."""
    saved = os.environ.get("JAX_PLATFORMS")
    if on:
        os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        yield
    finally:
        if on:
            if saved is None:
                os.environ.pop("JAX_PLATFORMS", None)
            else:
                os.environ["JAX_PLATFORMS"] = saved


def _run_transport(transport, cases, nbytes, n, rounds, make, spawn) -> list[dict]:
    import jaxtransport as jt
    import jaxtransport.multiprocessing as jmp

    rows: list[dict] = []
    pool_cases = [c for c in cases if c in ("Pool argument", "Pool result")]
    if pool_cases:  # one pool for both
        pool = jt.Pool(WORKERS) if transport == JT else spawn.Pool(WORKERS)
        try:
            pool.map(warm, range(2 * WORKERS), chunksize=1)
            for case in pool_cases:
                if case == "Pool argument":
                    rows += _rows(case, transport, nbytes, _pool_argument(pool, make, rounds))
                else:
                    rows += _rows(case, transport, nbytes, _pool_result(pool, n, rounds))
                gc.collect()
        finally:
            pool.close()
            pool.join()
    if "queue round" in cases:
        rec = _queue(jmp.get_context("spawn") if transport == JT else spawn, make, rounds)
        rows += _rows("queue round", transport, nbytes, rec)
        gc.collect()
    if "Executor" in cases:
        stock_ex = concurrent.futures.ProcessPoolExecutor
        ex = jt.Executor(WORKERS) if transport == JT else stock_ex(WORKERS, mp_context=spawn)
        with ex:
            list(ex.map(warm, range(2 * WORKERS)))
            rows += _rows("Executor", transport, nbytes, _executor(ex, make, rounds))
        gc.collect()
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    """PASS/MISS against issue 49: p99 <= 2x p50 for each jaxtransport round; the worker's
    own computation (Pool result's production, the Executor's worker step) no slower than in
    a stock worker, at p50 and at p99 (10% allowed for noise)."""
    out = []
    by = {(r["name"], r["transport"], r["step"]): r for r in rows}
    for r in rows:
        if r["transport"] != JT:
            continue
        size = f"{r['size_bytes'] // MIB} MiB"
        if r["step"] == "round":
            ok = r["p99"] <= 2 * r["seconds"]
            out.append(f"{'PASS' if ok else 'MISS'} {r['name']} {size}: p99 {r['p99'] * 1e3:.1f} ms = "
                       f"{r['p99_over_p50']:.2f}x p50 {r['seconds'] * 1e3:.1f} ms (<= 2x)")
        if (r["name"], r["step"]) in (("Pool result", "production"), ("Executor", "worker")):
            base = by.get((r["name"], STOCK, r["step"]))
            if base:
                for key, label in (("seconds", "p50"), ("p99", "p99")):
                    ok = r[key] <= 1.1 * base[key]
                    out.append(f"{'PASS' if ok else 'MISS'} {r['name']} {size}, the worker's own computation "
                               f"({r['step']}) {label}: {r[key] * 1e3:.1f} ms, stock worker {base[key] * 1e3:.1f} ms "
                               f"(<= 1.1x)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 MiB, 20 rounds")
    ap.add_argument("--size", type=int, default=None,
                    help="array size in MiB (default: 64 on a CPU backend, 256 on an accelerator)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per case (default 100; 60 on an accelerator)")
    ap.add_argument("--only", nargs="*", choices=CASES, default=None, metavar="CASE", help=f"some of {CASES}")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock multiprocessing baseline")
    args = ap.parse_args(argv)
    rows = run(quick=args.quick, size=args.size * MIB if args.size else None, rounds=args.rounds,
               cases=tuple(args.only) if args.only else CASES, stock=not args.no_stock)
    _common.print_targets(check_targets(rows))


if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.tails"))
