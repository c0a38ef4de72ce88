"""On an accelerator, how close does jaxtransport come to the device's own copy limits when it
moves a jax.Array that lives on the device: to another process (a CPU worker, a queue's child)
and back onto the device, against ``np.asarray`` (device -> host, D2H) and ``jax.device_put``
(host -> device, H2D) of the same bytes, and against the stock routes, measured in the same run?

Skipped (no rows, files left as they are) without an accelerator; ``--allow-cpu`` runs every row
on CPU, where the figures mean nothing (``np.asarray`` of a CPU array copies nothing) but every
code path runs: a smoke test.

Rows (one 256 MiB float32 array, 64 MiB with ``--quick``; each figure the median over
``--runs`` (5) sends of a FRESH array, made on the device by ``jax.random.uniform`` outside the
timed region: a jax.Array keeps its host copy after the first ``np.asarray``, so the same array
sent again would time nothing; each row is warmed up by one untimed send first):

- ``D2H`` / ``H2D``: the device's own copies of the same bytes, whole and in pieces.
  Whole: ``np.asarray(x)`` of a device array; ``jax.device_put(h)`` of a host array
  (``block_until_ready``), measured first and again last. In pieces (``PIECE_COUNTS``: 8, 16,
  32, 64): K slices cut by one jitted function, each started by ``copy_to_host_async``, then
  each taken by ``np.asarray`` (K host arrays, no joining copy: joining them into one warm host
  buffer cost more than the pieces saved on the TPU v5e); K views of the host array put by one
  ``device_put`` of the list and joined on the device by one jitted ``concatenate``. The slices
  also as the codec cuts them (``LANE_PIECE_COUNTS``: uint32 rows of ``LANES``), and the pieces
  exactly as ``jt.dumps`` fetches them (``D2H_CODEC``).
- ``D2H limit`` / ``H2D limit`` (made by :func:`finish`): the fastest of those copies in the
  run, naming its method (``method``, e.g. "D2H: 32 slices, copy_to_host_async"); each row's
  ``limit_method`` names the one it is measured against. On the TPU v5e (issue 49, 256 MiB)
  ``np.asarray`` took 101 ms and 32 slices fetched at once 43 ms; ``device_put`` 46 ms and 32
  pieces 22 ms. No sender should beat D2H, no receiver H2D.
- ``dumps`` / ``loads``: ``jt.dumps(x)`` against ``pickle.dumps(x, protocol=5)`` with JAX's own
  reducer; ``jt.loads`` onto the device against ``pickle.loads``; ``codec round trip``: both
  (the stock round trip of the issue), against D2H + H2D.
- ``Pool argument``: ``jt.Pool.apply(checksum, (x,))``, a device array to a CPU worker that
  returns a float, from the call to the result; stock: ``np.asarray`` + ``multiprocessing.Pool``
  (spawn). Limit: D2H.
- ``Pool production`` / ``Pool result``: a CPU worker makes a new array (``base + i``) and
  returns only its shape (production: the worker's own time plus a tiny task), or returns the
  array itself to a ``placement="device"`` pool, ready on this process's device; stock: the
  worker returns numpy through ``multiprocessing.Pool``, then ``jax.device_put``. Limit:
  production + H2D.
- ``Queue``: ``jaxtransport.multiprocessing.Queue.put(x)``, the child's ``get`` and its ack on
  a second queue; stock: ``multiprocessing.Queue.put(np.asarray(x))``. Limit: D2H.
- ``Ray serialize`` / ``Ray deserialize``: ``jaxtransport.ray``'s serializer (with the
  protocol-5 pickling, buffers out-of-band, that Ray's pickler does; not the copy into the
  object store) and its deserializer onto the device (with the unpickling), called in this
  process through ``jaxtransport._raywire``, which needs no Ray: Ray itself cannot start on
  the TPU host (no TCP sockets), nor be carried there (its wheel is over 64 MiB). Limits: D2H,
  H2D.

``vs_limit`` = seconds / the row's limit (lower is better, 1.0 = the device's fastest copy);
``speedup`` = the stock route's seconds / jaxtransport's (higher is better); ``target`` and
``pass``: the row's target (``TARGETS``, issue 49: 1.1x its limit) and whether it met it. Pools and children
are started once (long-lived, warm) and run on CPU (``JAX_PLATFORMS=cpu``): only one process may
hold a TPU.

Structure: this process never opens the accelerator. The transfer rows run in a child
(``python -m benchmarks.device --probe transfers``, printing JSON) and the rollouts demo, with
``--rollouts``, in another (``--probe rollouts``: the learner on the device, its actors on CPU),
each with a timeout; a child that fails or times out leaves a row with its error and the tail
of its stderr. Run ``python -m benchmarks.device [--quick] [--publish] [--rollouts]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

from . import _common
from . import run as runner
# The rows' names, which the page figures read too (benchmarks/_device_rows.py).
from ._device_rows import D2H, D2H_AGAIN, H2D, H2D_AGAIN, QUESTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20

#: What ``python -m benchmarks`` tells the runner: no rows without an accelerator is a skip, and
#: a missing ``device.json`` is not an error (``--replot``, :mod:`benchmarks.figures`).
NEEDS_ACCELERATOR = True
RUNS = 5
#: Seconds the whole benchmark may take (it must stay under 4 minutes on a TPU v5e), and each
#: child at most: the rollouts child gets what the transfers left, and is not started with less
#: than MIN_ROLLOUTS_S.
BUDGET = 225.0
TRANSFERS_TIMEOUT = 180.0
ROLLOUTS_TIMEOUT = 150.0
MIN_ROLLOUTS_S = 60.0
MARK = "@@device-json "  # the line of a probe's stdout that holds its result

#: The limits in pieces (issue 49): the same bytes as K device slices fetched at once (each
#: started by ``copy_to_host_async``, then each taken by ``np.asarray``; no joining copy), and as
#: K host pieces put at once and joined on the device by one jitted concatenate.
PIECE_COUNTS = (8, 16, 32, 64)


def d2h_pieces(k: int, lanes: int = 0, threads: int = 0) -> str:
    shape = f" as uint32 rows of {lanes}" if lanes else ""
    taken = f", np.asarray in {threads} threads" if threads else ""
    return f"{k} slices{shape}, copy_to_host_async{taken}"


#: The slices again as the codec cuts them (Note [device to host in chunks]): the bytes as uint32,
#: in rows of LANES. On the v5e the flat float32 slices took 21.5 ms in one run and 71.5 ms in
#: the next (jt.dumps, cut this way, 22.5 ms in both): the limit is the fastest of both shapes.
LANE_PIECE_COUNTS = (32, 64)
LANES = 256  # jaxtransport._codec.LANES
#: And the pieces exactly as ``jt.dumps`` fetches them (``_codec._fetch_in_pieces``: one jitted
#: split into 8 MiB pieces as uint32 rows of 256, all started at once, each its own host
#: buffer), the pickling left out: in the two runs where the slices above took 71-107 ms,
#: jt.dumps took 22.5-22.7 ms, as in the run where they took 21.5 ms.
D2H_CODEC = "pieces as jt.dumps fetches them, copy_to_host_async"
#: And the slices each taken by ``np.asarray`` in one of THREADS threads of a plain
#: ThreadPoolExecutor: taking a piece is a host copy too (the runtime's staging into a new
#: buffer, whose pages fault in), and at 57201de the run whose slices took 71-107 ms on one
#: thread had the Pool's argument, which takes its pieces in threads, at 25-28 ms.
THREADS = 8


def h2d_pieces(k: int) -> str:
    return f"{k} pieces, device_put + concatenate"


#: Each limit (a row of its own, :func:`finish`): the fastest of the copies measured in the run.
LIMIT = {"D2H": "D2H limit", "H2D": "H2D limit"}
FASTEST = "fastest copy measured"
#: ``jaxtransport.ray``'s serializer and deserializer of a device array, called in this process
#: (Ray cannot start everywhere a chip is: the TPU host has no TCP sockets): the serializer and
#: the protocol-5 pickling with out-of-band buffers that Ray's pickler does (not the copy into
#: the object store); the unpickling and the deserializer onto the device.
RAY_QUESTIONS = (
    ("Ray serialize", "jaxtransport.ray serializer (in process)", "D2H"),
    ("Ray deserialize", "jaxtransport.ray deserializer (in process)", "H2D"),
)
#: (row name, the limit's name, target vs_limit, target speedup over stock): issue 49 (the
#: speedups: issue 42, item 3).
TARGETS = (
    ("dumps", "D2H", 1.1, None),
    ("loads", "H2D", 1.1, None),
    ("Pool argument", "D2H", 1.1, 20.0),
    ("Pool result", "production + H2D", 1.1, 20.0),
    ("Queue", "D2H", 1.1, None),
    ("Ray serialize", "D2H", 1.1, None),
    ("Ray deserialize", "H2D", 1.1, None),
)

LIMIT_TRANSPORTS = ("np.asarray", "jax.device_put", D2H_AGAIN, H2D_AGAIN)
BASELINE = None  # one size: no plot (the table is the result)


# ------------------------------------------------------------------------------------------
# worker and child side (module level: spawned processes import them; no JAX at import)


def checksum(x) -> float:
    """A small checksum of a received array (every 4096th element: the data is there)."""
    import numpy as np

    return float(np.asarray(x)[:: 1 << 12].sum())


_BASE: dict = {}


def produce(n: int, i: int):
    """A new jax.Array of ``n`` float32 in this (CPU) worker, ready: ``base + i``."""
    import jax
    import jax.numpy as jnp

    if n not in _BASE:
        _BASE.clear()
        _BASE[n] = jax.block_until_ready(jnp.arange(n, dtype=jnp.float32))
    return jax.block_until_ready(_BASE[n] + jnp.float32(i))


def produce_shape(n: int, i: int) -> tuple:
    """The production row: the same work as :func:`produce`, only the shape comes back."""
    return tuple(produce(n, i).shape)


def produce_numpy(n: int, i: int):
    """The stock result: the array as numpy (no copy on CPU), pickled by multiprocessing."""
    import numpy as np

    return np.asarray(produce(n, i))


def noop(x):
    return x


def consume(q, ack) -> None:
    """A queue's child: take arrays until None, ack each with its checksum."""
    while True:
        x = q.get()
        if x is None:
            return
        ack.put(checksum(x))
        del x


# ------------------------------------------------------------------------------------------
# the transfer rows (``--probe transfers``: the only process that opens the device)


def _stats(ts: list[float]) -> dict:
    med = statistics.median(ts)
    return {"seconds": med, "min": min(ts), "max": max(ts), "spread": (max(ts) - min(ts)) / 2, "runs": len(ts)}


def _row(name: str, size: int, transport: str, ts: list[float] | None = None, error: str | None = None,
         **extra) -> dict:
    r = {"name": name, "size_bytes": size, "transport": transport}
    if ts:
        r.update(_stats(ts))
        r["gbps"] = size / r["seconds"] / 1e9 if r["seconds"] > 0 else None
    else:
        r.update(seconds=None, runs=0)
    if error:
        r["error"] = error
    r.update(extra)
    return r


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class _Env:
    """``os.environ`` overlaid for the duration of a child's start (restored after)."""

    def __init__(self, **env: str):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


CPU_CHILD = {"JAX_PLATFORMS": "cpu"}
TASK_TIMEOUT = 60.0  # seconds one timed send may take before its row fails
#: Untimed rounds before a Pool's or a queue's timed ones: the steady state, where each
#: shared-memory slot the rounds rotate through has been used once. With one, the queue's row
#: on the v5e had a round of 678-725 ms in each run (a new 256 MiB segment's first touch) and
#: medians of 37-43 ms against minima of 25-28, while benchmarks/tails.py (3 warm-up rounds, 50
#: timed) had its round at p50 30.6 ms, p99 32.0 ms. First uses are benchmarks/first_call.py's.
STEADY_WARMUP = 3


def environment() -> dict:
    """The runner's environment keys (``_common.env_info``) plus the device: call only where
    JAX may open the accelerator (the probe)."""
    import jax

    info = _common.env_info()
    dev = jax.devices()[0]
    info.update(device_kind=getattr(dev, "device_kind", "?"), device_platform=dev.platform,
                devices=jax.device_count(), usable_cores=_common.usable_cores())
    info["line"] = (f"JAX {jax.__version__}, {info['device_kind']} ({dev.platform}, {info['devices']} "
                    f"device{'s' if info['devices'] != 1 else ''}), {info['usable_cores']} cores, "
                    f"Python {info['python']}")
    return info


def probe_transfers(size: int, runs: int = RUNS, allow_cpu: bool = False) -> dict:
    """Every transfer row, measured in this process (which opens the device):
    ``{"environment", "rows"}``, or ``{"environment", "skipped"}`` on CPU without
    ``allow_cpu``. Never raises for a row: a row that fails carries ``error``."""
    import jax

    env = environment()
    if jax.default_backend() == "cpu":
        if not allow_cpu:
            return {"environment": env, "skipped": "no accelerator (JAX's default backend is cpu)"}
        env["mode"] = "--allow-cpu: a smoke run on CPU, the figures mean nothing"
    with _Env(**CPU_CHILD):  # every child from here on: this process's backend is already up
        rows = _transfer_rows(size, runs)
    return {"environment": env, "rows": finish(rows)}


def _transfer_rows(size: int, runs: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = size // 4
    rows: list[dict] = []
    make_on_device = jax.jit(lambda k: jax.random.uniform(k, (n,), jnp.float32))
    counter = iter(range(1, 1 << 30))

    def fresh():
        """A new array on the device, ready (its host copy not made yet)."""
        return jax.block_until_ready(make_on_device(jax.random.key(next(counter))))

    def measure(name, transport, send, *, prepare=fresh, warmup=1):
        """``send(prepare())`` timed ``runs`` times after ``warmup`` untimed; a row either way."""
        try:
            ts = []
            for i in range(warmup + runs):
                arg = prepare()
                t0 = time.perf_counter()
                send(arg)
                t = time.perf_counter() - t0
                del arg
                if i >= warmup:
                    ts.append(t)
            rows.append(_row(name, size, transport, ts))
        except Exception as exc:  # noqa: BLE001 -- the row records it; the others still run
            traceback.print_exc()
            rows.append(_row(name, size, transport, error=_error_text(exc)))
        _print(rows[-1])

    # -- the limits
    measure(*D2H, np.asarray)
    try:
        host = np.array(fresh())  # a writeable host array, touched
    except Exception as exc:  # noqa: BLE001
        host = np.ones(n, np.float32)
        print(f"!! host array from the device failed ({_error_text(exc)}); ones instead", file=sys.stderr)
    measure(*H2D, lambda h: jax.device_put(h).block_until_ready(), prepare=lambda: host)
    for k in PIECE_COUNTS:
        measure(D2H[0], d2h_pieces(k), _slices_fetched_at_once(n, k))
    for k in LANE_PIECE_COUNTS:
        measure(D2H[0], d2h_pieces(k, LANES), _slices_fetched_at_once(n, k, LANES))
    for k in LANE_PIECE_COUNTS:
        measure(D2H[0], d2h_pieces(k, 0, THREADS), _slices_fetched_at_once(n, k, 0, THREADS))
    measure(D2H[0], D2H_CODEC, _fetched_as_the_codec_does)
    for k in PIECE_COUNTS:
        measure(H2D[0], h2d_pieces(k), _pieces_put_at_once(n, k), prepare=lambda: host)

    # -- the codec: both directions of each run timed apart, from the same fresh array
    import pickle

    import jaxtransport as jt

    def codec(name_rt, transport_rt, dumps_t, loads_t, dumps, loads):
        try:
            td, tl = [], []
            for i in range(1 + runs):
                x = fresh()
                t0 = time.perf_counter()
                msg = dumps(x)
                t1 = time.perf_counter()
                jax.block_until_ready(loads(msg))
                t2 = time.perf_counter()
                del x, msg
                if i:
                    td.append(t1 - t0)
                    tl.append(t2 - t1)
            for name, transport, ts in (("dumps", dumps_t, td), ("loads", loads_t, tl),
                                        (name_rt, transport_rt, [a + b for a, b in zip(td, tl)])):
                rows.append(_row(name, size, transport, ts))
                _print(rows[-1])
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            for name, transport in (("dumps", dumps_t), ("loads", loads_t), (name_rt, transport_rt)):
                rows.append(_row(name, size, transport, error=_error_text(exc)))
                _print(rows[-1])

    jt_q = {q: (t, s) for q, t, s in QUESTIONS}
    codec("codec round trip", jt_q["codec round trip"][0], jt_q["dumps"][0], jt_q["loads"][0],
          jt.dumps, lambda m: jt.loads(*m))
    codec("codec round trip", jt_q["codec round trip"][1], jt_q["dumps"][1], jt_q["loads"][1],
          lambda x: pickle.dumps(x, protocol=5), pickle.loads)

    # -- jaxtransport.ray's serializer and deserializer, in this process: the functions its
    # registered wrappers call (jaxtransport._raywire), which need no Ray (Ray cannot start on a
    # TPU host without TCP, and its wheel is too large to carry to one), pickled as Ray pickles
    # them: protocol 5, each buffer out of band
    from jaxtransport import _raywire

    def ray_serialize(x):
        oob: list = []
        data = pickle.dumps(_raywire.serialize(x), protocol=5, buffer_callback=lambda pb: oob.append(pb) or False)
        return data, oob

    (ser, ser_t, _), (de, de_t, _) = RAY_QUESTIONS
    measure(ser, ser_t, ray_serialize)
    measure(de, de_t,
            lambda m: jax.block_until_ready(_raywire.deserialize(pickle.loads(m[0], buffers=m[1]), "device")),
            prepare=lambda: ray_serialize(fresh()))

    # -- pools: one jaxtransport.Pool (placement="device") and one multiprocessing.Pool, warm
    import multiprocessing

    jpool = mpool = None
    pool_error = None
    try:
        jpool = jt.Pool(1, placement="device", worker_env=dict(CPU_CHILD))
        with _Env(**CPU_CHILD):
            mpool = multiprocessing.get_context("spawn").Pool(1)
        jpool.apply(noop, (0,))
        mpool.apply(noop, (0,))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        pool_error = "starting the pools: " + _error_text(exc)
    i_task = iter(range(1, 1 << 30))

    def pool_row(name, transport, send, prepare=fresh):
        if pool_error:
            rows.append(_row(name, size, transport, error=pool_error))
            _print(rows[-1])
        else:
            measure(name, transport, send, prepare=prepare, warmup=STEADY_WARMUP)

    pool_row("Pool argument", jt_q["Pool argument"][0],
             lambda x: jpool.apply_async(checksum, (x,)).get(TASK_TIMEOUT))
    pool_row("Pool argument", jt_q["Pool argument"][1],
             lambda x: mpool.apply_async(checksum, (np.asarray(x),)).get(TASK_TIMEOUT))
    pool_row("Pool production", jt_q["Pool production"][0],
             lambda i: jpool.apply_async(produce_shape, (n, i)).get(TASK_TIMEOUT), prepare=lambda: next(i_task))
    pool_row("Pool result", jt_q["Pool result"][0],
             lambda i: jax.block_until_ready(jpool.apply_async(produce, (n, i)).get(TASK_TIMEOUT)),
             prepare=lambda: next(i_task))
    pool_row("Pool result", jt_q["Pool result"][1],
             lambda i: jax.device_put(mpool.apply_async(produce_numpy, (n, i)).get(TASK_TIMEOUT)).block_until_ready(),
             prepare=lambda: next(i_task))
    for p in (jpool, mpool):
        try:
            if p is not None:
                p.terminate()
                p.join()
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    # -- queues: a long-lived child per transport, acks on a second queue
    import jaxtransport.multiprocessing as jmp

    for transport, ctx, convert in ((jt_q["Queue"][0], jmp.get_context("spawn"), lambda x: x),
                                    (jt_q["Queue"][1], multiprocessing.get_context("spawn"), np.asarray)):
        proc = None
        try:
            q, ack = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=consume, args=(q, ack), daemon=True)
            with _Env(**CPU_CHILD):
                proc.start()

            def one(x, q=q, ack=ack, convert=convert):
                q.put(convert(x))
                return ack.get(timeout=TASK_TIMEOUT)

            measure("Queue", transport, one, warmup=STEADY_WARMUP)
            q.put(None)
            proc.join(10)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append(_row("Queue", size, transport, error=_error_text(exc)))
            _print(rows[-1])
        finally:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(5)

    # -- the limits again, last: the limit of a row is the faster of the two measurements (a
    # device's copy may be slower at the start of a run, before its host staging is warm)
    measure(D2H[0], D2H_AGAIN, np.asarray)
    measure(H2D[0], H2D_AGAIN, lambda h: jax.device_put(h).block_until_ready(), prepare=lambda: host)
    return rows


def _slices_fetched_at_once(n: int, k: int, lanes: int = 0, threads: int = 0):
    """D2H in ``k`` pieces: one jitted function cuts a device array of ``n`` elements into ``k``
    slices (with ``lanes``: each as uint32 rows of that many, the codec's cut); each slice's copy
    starts (``copy_to_host_async``), then each is taken by ``np.asarray`` (``k`` host arrays: no
    joining copy), in ``threads`` threads side by side where given."""
    import concurrent.futures

    import jax
    import numpy as np
    from jax import lax

    per = -(-n // k)
    if lanes and per % lanes == 0:
        split = jax.jit(lambda a: [lax.bitcast_convert_type(a[s:s + per], np.uint32).reshape(-1, lanes)
                                   for s in range(0, n, per)])
    else:
        split = jax.jit(lambda a: [a[s:s + per] for s in range(0, n, per)])

    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads else None

    def send(x):
        pieces = split(x)
        for p in pieces:
            p.copy_to_host_async()
        if pool is not None:
            return list(pool.map(np.asarray, pieces))
        return [np.asarray(p) for p in pieces]

    return send


def _fetched_as_the_codec_does(x):
    """D2H as ``jt.dumps`` fetches a large one-device array (Note [pickled in pieces]); whole by
    ``np.asarray`` where it would go whole (an array on the CPU: the smoke run)."""
    import numpy as np

    from jaxtransport import _codec

    got = _codec._fetch_in_pieces(x)
    return np.asarray(x) if got is None else got[1]


def _pieces_put_at_once(n: int, k: int):
    """H2D in ``k`` pieces: views of a host array of ``n`` elements put by one ``device_put`` of
    the list (the transfers overlap), joined on the device by one jitted concatenate
    (``_common.put_in_pieces``)."""

    def send(h):
        _common.put_in_pieces(h, k).block_until_ready()

    return send


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def finish(rows: list[dict]) -> list[dict]:
    """Each row's ``limit``, ``limit_seconds``, ``vs_limit`` and ``speedup`` from the rows of
    the same run (a row whose limit or stock route failed keeps None there)."""
    rows = [r for r in rows if r["name"] not in LIMIT.values()]  # made here, again if finished twice
    sec = {(r["name"], r["transport"]): _num(r.get("seconds")) for r in rows}
    fastest: dict[str, dict | None] = {}
    for kind, limit_name in LIMIT.items():
        # each limit: the fastest copy of the run, whole or in pieces, first or last
        measured = [r for r in rows if r["name"] == kind and sec.get((kind, r["transport"]))]
        best_row = min(measured, key=lambda r: sec[(kind, r["transport"])]) if measured else None
        fastest[kind] = best_row
        for r in rows:
            if r["name"] == kind:
                r["fastest"] = r is best_row
        if best_row is None:
            row = _row(limit_name, rows[0]["size_bytes"] if rows else 0, FASTEST,
                       error=f"no {kind} copy was measured")
        else:
            row = {k: v for k, v in best_row.items() if k not in ("name", "transport", "fastest")}
            row = {"name": limit_name, "size_bytes": best_row["size_bytes"], "transport": FASTEST, **row,
                   "method": f"{kind}: {best_row['transport']}"}
        rows.append(row)

    def limit_of(kind):
        r = fastest[kind]
        return (sec[(kind, r["transport"])], f"{kind}: {r['transport']}") if r else (None, None)

    (d2h, d2h_m), (h2d, h2d_m) = limit_of("D2H"), limit_of("H2D")
    prod = sec.get(("Pool production", QUESTIONS[4][1]))
    limits = {
        "dumps": ("D2H", d2h, d2h_m), "loads": ("H2D", h2d, h2d_m),
        "codec round trip": ("D2H + H2D", d2h + h2d if d2h and h2d else None,
                             f"{d2h_m} + {h2d_m}" if d2h_m and h2d_m else None),
        "Pool argument": ("D2H", d2h, d2h_m), "Queue": ("D2H", d2h, d2h_m),
        "Pool result": ("production + H2D", prod + h2d if prod and h2d else None,
                        f"production + {h2d_m}" if h2d_m else None),
        "Ray serialize": ("D2H", d2h, d2h_m), "Ray deserialize": ("H2D", h2d, h2d_m),
    }
    stock = {q: (jt_t, s) for q, jt_t, s in QUESTIONS}
    ours = {q: t for q, t, _ in QUESTIONS} | {q: t for q, t, _ in RAY_QUESTIONS}
    targets = {name: (at_most, at_least) for name, _, at_most, at_least in TARGETS}
    for r in rows:
        name, s = r["name"], _num(r.get("seconds"))
        if name in limits:
            r["limit"], lim, r["limit_method"] = limits[name]
            r["limit_seconds"] = lim
            r["vs_limit"] = s / lim if s and lim else None
        if name in stock and stock[name][1]:
            base = sec.get((name, stock[name][1]))
            r["speedup"] = base / s if base and s else None
        if name in targets and r["transport"] == ours.get(name):
            at_most, at_least = targets[name]
            r["target"] = f"<= {at_most:g}x {r['limit']}" + (f", >= {at_least:g}x stock" if at_least else "")
            vs, sp = _num(r.get("vs_limit")), _num(r.get("speedup"))
            r["pass"] = bool(vs is not None and vs <= at_most and (at_least is None or (sp or 0) >= at_least))
    return rows


def _print(r: dict) -> None:
    if r.get("error"):
        print(f"{r['name']:<17} {r['transport']:<40} FAILED: {r['error']}", file=sys.stderr, flush=True)
        return
    print(f"{r['name']:<17} {r['transport']:<40} median {r['seconds'] * 1e3:9.2f} ms "
          f"(min {r['min'] * 1e3:.2f}, max {r['max'] * 1e3:.2f}, n={r['runs']})", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# the rollouts demo (``--probe rollouts``): the learner on the device, its actors on CPU


def probe_rollouts(iterations: int, workers: int = 2, allow_cpu: bool = False) -> dict:
    """``python -m jaxtransport.rollouts --compare --iterations N --workers W`` in this process
    (``demo.train``, as ``benchmarks/rollouts.py`` does: the CLI prints no machine-readable
    output): each transport's env steps/s, the speedup, and whether the learning curves (the
    per-iteration returns and the final parameters' digest) are identical."""
    import io

    import jax

    from jaxtransport import rollouts as demo

    env = environment()
    if jax.default_backend() == "cpu" and not allow_cpu:
        return {"environment": env, "skipped": "no accelerator (JAX's default backend is cpu)"}
    out: dict = {}
    with _Env(**CPU_CHILD):  # the actors (spawned children) on CPU; the learner stays here
        for transport in ("stock", "jaxtransport"):
            cfg = demo.Config(backend="pool", workers=workers, iterations=iterations, warmup=min(2, iterations - 1))
            t0 = time.perf_counter()
            print(f"rollouts: {transport}, {iterations} iterations, {workers} workers ...", file=sys.stderr, flush=True)
            res = demo.train(cfg, transport, out=io.StringIO(), err=io.StringIO())
            timed = res.timed
            wall = [it.wall_s for it in timed]
            steps = statistics.median(it.env_steps for it in timed)
            out[transport] = {
                "env_steps_per_s": steps / statistics.median(wall), "seconds": statistics.median(wall),
                "min": min(wall), "max": max(wall), "runs": len(wall), "total_s": time.perf_counter() - t0,
                "returns": res.returns, "params_sha256": res.params_sha256,
                "transport_s": statistics.median(it.transport_s for it in timed),
                "param_mb": cfg.param_mb,
            }
            print(f"rollouts: {transport} {out[transport]['env_steps_per_s']:,.0f} env steps/s "
                  f"({out[transport]['total_s']:.0f} s with start-up)", file=sys.stderr, flush=True)
    return {"environment": env, "runs": out}


def rollouts_rows(quick: bool = False, *, allow_cpu: bool = False, iterations: int | None = None,
                  workers: int = 2, timeout: float = ROLLOUTS_TIMEOUT) -> list[dict]:
    """The rollouts demo's rows (``rollouts``: stock and jaxtransport on the Pool backend, the
    learner on the device), from a child process of their own (``--probe rollouts``): one
    process at a time may hold the chip. ``ratio`` = jaxtransport's env steps/s over stock's;
    ``curves_identical``: the same returns at every iteration and the same final parameters.
    A child that fails leaves one row with the error."""
    iterations = iterations or (6 if quick else 12)
    args = ["--iterations", str(iterations), "--workers", str(workers)] + (["--allow-cpu"] if allow_cpu else [])
    if _jax_holds_accelerator():
        res = _in_process("rollouts", probe_rollouts, iterations, workers, allow_cpu)
    else:
        res = _probe("rollouts", args, timeout)
    if res.get("skipped"):
        return []
    if "error" in res:
        return [_row("rollouts", 0, "jaxtransport", error=res["error"])]
    runs = res["runs"]
    stock, jtr = runs.get("stock"), runs.get("jaxtransport")
    same = bool(stock and jtr and stock["returns"] == jtr["returns"]
                and stock["params_sha256"] == jtr["params_sha256"])
    rows = []
    for transport, r in runs.items():
        rows.append({
            "name": "rollouts", "size_bytes": 0, "transport": transport, "seconds": r["seconds"],
            "min": r["min"], "max": r["max"], "runs": r["runs"], "env_steps_per_s": r["env_steps_per_s"],
            "ratio": r["env_steps_per_s"] / stock["env_steps_per_s"] if stock else None,
            "transport_s": r["transport_s"], "param_mb": r["param_mb"], "curves_identical": same,
            "returns_digest": _digest(r["returns"]), "params_sha256": r["params_sha256"][:16],
            "total_s": r["total_s"],
        })
    return rows


def _digest(values: list[float]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# the parent: runs the probes, never opens the device


def _tail(text: str, chars: int = 2000) -> str:
    return text[-chars:].strip()


def _probe(kind: str, args: list[str], timeout: float) -> dict:
    """``python -m benchmarks.device --probe KIND ARGS`` in a child of its own: its JSON, or
    ``{"error": ...}`` (exit status, timeout or unreadable output, with the tail of its
    stderr). The child's stderr (its progress) is echoed here as it comes."""
    cmd = [sys.executable, "-m", "benchmarks.device", "--probe", kind] + args
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print(f"# {kind}: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    except OSError as exc:
        return {"error": f"could not start the {kind} probe: {_error_text(exc)}"}
    err: list[str] = []
    out: list[str] = []

    def echo():
        for line in proc.stderr:
            err.append(line)
            sys.stderr.write(f"  [{kind}] {line}")
            sys.stderr.flush()

    readers = [threading.Thread(target=echo, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, 9)  # the probe and the pools it started (its own session)
        except OSError:
            proc.kill()
        proc.wait()
    for t in readers:
        t.join(5)
    seconds = time.perf_counter() - t0
    tail = _tail("".join(err))
    if timed_out:
        return {"error": f"the {kind} probe timed out after {timeout:.0f} s; its stderr ended: {tail}"}
    for line in reversed("".join(out).splitlines()):
        if line.startswith(MARK):
            try:
                res = json.loads(line[len(MARK):])
            except ValueError as exc:
                return {"error": f"the {kind} probe's output is not JSON ({exc}); its stderr ended: {tail}"}
            res["probe_seconds"] = seconds
            return res
    return {"error": f"the {kind} probe exited with status {proc.returncode} and no result; "
                     f"its stderr ended: {tail}"}


def _jax_holds_accelerator() -> str | None:
    """The platform this process's JAX already opened, if not CPU (then no child can open it:
    one process at a time holds a TPU); None when JAX has no backend up here."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import xla_bridge

        if not getattr(xla_bridge, "_backends", None):
            return None
        backend = jax.default_backend()
    except Exception:  # noqa: BLE001
        return None
    return None if backend == "cpu" else backend


LAST: dict = {}  # the last run's environment and skip reason (for main and the tests)


def _in_process(kind: str, fn, *args) -> dict:
    """A probe run here, when this process already holds the device (see :func:`run`)."""
    print(f"# {kind}: in this process (it already holds the device)", flush=True)
    t0 = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {"error": f"the {kind} probe failed: {_error_text(exc)}"}
    res["probe_seconds"] = time.perf_counter() - t0
    res.setdefault("environment", {})["probe"] = "in-process: the process that ran it already held the device"
    return res


def run(quick: bool = False, *, allow_cpu: bool = False, size_mib: float | None = None, runs: int = RUNS,
        rollouts: bool = False, budget: float = BUDGET) -> list[dict]:
    """Every transfer row (and with ``rollouts`` the demo's rows), each part measured in a child
    process of its own, within ``budget`` seconds in all (each child's timeout: what is left);
    no rows (and a "skipped: no accelerator" line) without an accelerator unless ``allow_cpu``.

    When this process already holds an accelerator (``python -m benchmarks`` started JAX on it
    before this benchmark), no child could open it: the parts run here instead."""
    LAST.clear()
    start = time.perf_counter()
    size = int((size_mib or (64 if quick else 256)) * MIB)
    size -= size % 4
    if not allow_cpu and os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return _skipped("JAX_PLATFORMS=cpu in this environment")
    held = _jax_holds_accelerator()
    if held:
        res = _in_process("transfers", probe_transfers, size, runs, allow_cpu)
    else:
        args = ["--size-mib", repr(size / MIB), "--runs", str(runs)] + (["--allow-cpu"] if allow_cpu else [])
        res = _probe("transfers", args, min(TRANSFERS_TIMEOUT, budget))
    LAST["environment"] = res.get("environment") or {}
    if res.get("skipped"):
        return _skipped(res["skipped"])
    if "error" in res:
        print(f"!! device: {res['error']}", file=sys.stderr, flush=True)
        return [_row("transfers", size, "probe", error=res["error"])]
    rows = res["rows"]
    if rollouts:
        left = budget - (time.perf_counter() - start)
        if left < MIN_ROLLOUTS_S:
            why = (f"not run: {left:.0f} s left of the {budget:.0f} s budget after the transfer rows "
                   f"(it needs {MIN_ROLLOUTS_S:.0f} s)")
            print(f"!! device: rollouts {why}", file=sys.stderr, flush=True)
            rows.append(_row("rollouts", 0, "jaxtransport", error=why))
        else:
            rows += rollouts_rows(quick, allow_cpu=allow_cpu, timeout=min(ROLLOUTS_TIMEOUT, left))
    return rows


def _skipped(why: str) -> list[dict]:
    LAST["skipped"] = why
    print(f"skipped: no accelerator ({why}); --allow-cpu runs every row on CPU", flush=True)
    return []


def environment_info() -> dict:
    """The environment of the last run's probe (device kind included), for the .md and .json;
    else this machine's, without opening a device (no JAX backend is started here)."""
    info = dict(LAST.get("environment") or {})
    if info:
        return info
    import platform
    from importlib import metadata

    import numpy as np

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "numpy": np.__version__}
    for mod in ("jax", "jaxlib"):
        try:
            info[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            pass
    info["device_kind"] = "not measured (the probe failed)"
    return info


def check_targets(rows: list[dict]) -> list[str]:
    """The limits, then PASS/MISS against issue 49 (on CPU, with ``--allow-cpu``, they mean
    nothing)."""
    out = []
    ours = {q: t for q, t, _ in QUESTIONS} | {q: t for q, t, _ in RAY_QUESTIONS}
    for kind, limit_name in LIMIT.items():
        r = next((r for r in rows if r["name"] == limit_name and not r.get("error")), None)
        if r is not None:
            out.append(f"LIMIT {r['method']} {r['seconds'] * 1e3:.1f} ms, the fastest {kind} copy measured")
    for name, limit, at_most, at_least in TARGETS:
        r = next((r for r in rows if r["name"] == name and r["transport"] == ours[name]), None)
        if r is None:
            continue
        if r.get("error") or _num(r.get("vs_limit")) is None:
            out.append(f"MISS {name}: not measured ({r.get('error') or 'its limit was not measured'})")
            continue
        ok = r["vs_limit"] <= at_most
        text = f"{r['vs_limit']:.2f}x {limit} (target <= {at_most:g}x)"
        if at_least is not None:
            sp = _num(r.get("speedup"))
            ok = ok and sp is not None and sp >= at_least
            text += f", {sp:.1f}x stock (target >= {at_least:g}x)" if sp is not None else ", stock not measured"
        if r.get("limit_method"):
            text += f"; limit: {r['limit_method']}"
        out.append(f"{'PASS' if ok else 'MISS'} {name}: {r['transport']} {r['seconds'] * 1e3:.1f} ms = {text}")
    roll = {r["transport"]: r for r in rows if r["name"] == "rollouts" and not r.get("error")}
    if "jaxtransport" in roll:
        r = roll["jaxtransport"]
        ok = (r.get("ratio") or 0) >= 3 and r.get("curves_identical")
        out.append(f"{'PASS' if ok else 'MISS'} rollouts: {r['env_steps_per_s']:,.0f} env steps/s = "
                   f"{r['ratio']:.2f}x stock (target >= 3x); learning curves identical: "
                   f"{'yes' if r.get('curves_identical') else 'NO'}")
    return out


# ------------------------------------------------------------------------------------------
# command line


def _probe_main(args) -> int:
    """A probe child: measure, print one JSON line (``MARK``) on stdout; progress on stderr."""
    sys.stdout.flush()
    try:
        if args.probe == "transfers":
            size = int(args.size_mib * MIB) if args.size_mib else 256 * MIB
            res = probe_transfers(size - size % 4, args.runs, args.allow_cpu)
        else:
            res = probe_rollouts(args.iterations, args.workers, args.allow_cpu)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res = {"error": f"the {args.probe} probe failed: {_error_text(exc)}"}
    print(MARK + json.dumps(res, default=str), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.device",
        description="jax.Arrays on an accelerator: jaxtransport's transfers against the device's "
        "own D2H/H2D copies and the stock routes. Skipped without an accelerator.",
        epilog=f"Writes device.md and device.json to {runner._rel(runner.SCRATCH)} (--publish: "
        f"{runner._rel(runner.RESULTS)}). This process never opens the device: each part runs in "
        "a child (--probe).")
    p.add_argument("--quick", action="store_true", help="a 64 MiB array instead of 256 MiB")
    p.add_argument("--size-mib", type=float, default=None, help="the array's size in MiB (overrides --quick)")
    p.add_argument("--runs", type=int, default=RUNS, help="fresh arrays timed per row (median)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run every row on CPU when there is no accelerator (a smoke test: the figures mean nothing)")
    p.add_argument("--rollouts", action="store_true",
                   help="also run the rollouts demo (learner on the device, 2 CPU actors), stock and jaxtransport")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--publish", action="store_true", help="write to the published results")
    where.add_argument("--out", default=None, metavar="DIR", help="write to DIR")
    p.add_argument("--probe", choices=("transfers", "rollouts"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, default=12, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.probe:
        return _probe_main(args)
    out = args.out or (runner.RESULTS if args.publish else runner.SCRATCH)
    print(f"# device benchmark: output {out}", flush=True)
    before = runner.conditions()
    start = time.perf_counter()
    rows = run(args.quick, allow_cpu=args.allow_cpu, size_mib=args.size_mib, runs=args.runs,
               rollouts=args.rollouts)
    seconds = time.perf_counter() - start
    if not rows:
        print("wrote nothing (skipped)", flush=True)
        return 0
    info = environment_info()
    runner.write_outputs("device", sys.modules[__name__], rows, out, seconds, args.quick, info=info,
                         before=before, after=runner.conditions())
    print(f"\n# {info.get('line', '')} -- {seconds:.0f} s in all", flush=True)
    if os.path.realpath(out) == os.path.realpath(runner.RESULTS):
        return runner.render_pages()
    return 0


if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.device"))
