"""How fast do Queue and Pipe move jax.Arrays between processes with jaxtransport.multiprocessing,
against stock multiprocessing (with and without jt.register()) and torch.multiprocessing moving
torch.Tensors of the same size, measured in the same run?

One message = the producer (this process) puts/sends one array of ``size`` bytes, a consumer
process (spawn, started once per transport) gets it, makes it ready (``block_until_ready`` /
a read of one element) and answers with a tiny acknowledgement, which the producer waits for.
Steady state: each size is sent twice before timing (recycled shared memory, no fresh pages).
Every message is a new array made outside the timed region, as one an actor just computed: for
jax a new jax.Array in XLA's memory (``x + 0``: the same array sent again would go by handle,
which ``benchmarks/forward.py`` measures), so the put's copy into shared memory is timed; for
torch a fresh tensor (``clone()``), so that torch's ``share_memory_()`` copy is timed.

Rows: ``queue``/``pipe`` per size and transport; ``ratio`` = stock multiprocessing (no
register) seconds / this transport's seconds (higher is better), ``vs_torch`` = torch seconds /
jaxtransport seconds, ``vs_memcpy`` = seconds / a warm memcpy of the same bytes.
Run ``python -m benchmarks --only queue [--quick]`` (the module name shadows the stdlib's
``queue`` when run as a script, so always through ``-m``).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import sys
import time

import numpy as np

from . import _common

MIB, GIB = 1 << 20, 1 << 30
STOCK, REGISTERED, JT, TORCH = ("multiprocessing", "multiprocessing+register", "jaxtransport.multiprocessing",
                                "torch.multiprocessing")


# -- consumers (module level: spawned children import them)
def consume_jax(kind, chan, ack, register):
    import jax

    if register:
        import jaxtransport as jt

        jt.register()

    def arrived(x):
        jax.block_until_ready(x)
        return x.shape

    _serve(kind, chan, ack, arrived)


def consume_torch(kind, chan, ack):
    def arrived(t):
        float(t[-1])  # the data is there
        return tuple(t.shape)

    _serve(kind, chan, ack, arrived)


def _serve(kind, chan, ack, arrived):
    """Take messages from ``chan`` (a queue, or a pipe's end) until None; ``arrived(x)`` waits
    for a message's data and returns its shape, which goes back on ``ack`` (the queue's answer
    queue, or the same pipe) once the message is dropped."""
    while True:
        x = chan.get() if kind == "queue" else chan.recv()
        if x is None:
            return
        shape = arrived(x)
        del x
        if kind == "queue":
            ack.put(shape)
        else:
            chan.send(shape)


def _reps(nbytes, slow):
    if nbytes >= 256 * MIB:
        return 2 if slow else 5
    if nbytes >= 64 * MIB:
        return 3 if slow else 7
    return 5 if slow else 15


def _memcpy(nbytes):
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    return statistics.median(_common.timed(lambda: np.copyto(dst, src), 5, 0))


class _Endpoint:
    """A consumer process and the producer's side of one queue or pipe."""

    def __init__(self, transport, kind):
        self.kind = kind
        if transport == TORCH:
            import torch.multiprocessing as tmp

            ctx = tmp.get_context("spawn")
            target, extra = consume_torch, ()
        elif transport == JT:
            import jaxtransport.multiprocessing as jmp

            ctx = jmp.get_context("spawn")
            target, extra = consume_jax, (False,)
        else:
            ctx = multiprocessing.get_context("spawn")
            target, extra = consume_jax, (transport == REGISTERED,)
        if kind == "queue":
            self.chan, self.ack = ctx.Queue(), ctx.Queue()
            child_end = self.chan
        else:
            self.chan, child_end = ctx.Pipe()
            self.ack = None
        self.proc = ctx.Process(target=target, args=(kind, child_end, self.ack) + extra, daemon=True)
        self.proc.start()
        if kind == "pipe":
            child_end.close()

    def one(self, x):
        if self.kind == "queue":
            self.chan.put(x)
            return self.ack.get(timeout=600)
        self.chan.send(x)
        return self.chan.recv()

    def close(self):
        try:
            if self.kind == "queue":
                self.chan.put(None)
            else:
                self.chan.send(None)
            self.proc.join(30)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


def _torch_available() -> str | None:
    try:
        import torch  # noqa: F401
        import torch.multiprocessing  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _print(r):
    extra = "".join(f"  {k}={r[k]:.2f}x" for k in ("ratio", "vs_torch", "vs_memcpy") if r.get(k))
    print(f"{r['name']:<6} {r['size_bytes'] / MIB:7.0f} MiB {r['transport']:<30} {r['seconds'] * 1e3:10.2f} ms "
          f"(+-{r['spread'] * 1e3:.2f}) {r['gbps']:7.3f} GB/s{extra}", flush=True)


def run(quick: bool = False, max_bytes: int | None = None, torch: bool = True) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import jaxtransport as jt

    top = max_bytes or (256 * MIB if quick else GIB)
    sizes = [s for s in (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB) if s <= top]
    why_no_torch = _torch_available() if torch else "disabled (--no-torch)"
    if why_no_torch:
        print(f"torch.multiprocessing baseline skipped: {why_no_torch}", flush=True)
    transports = [JT, STOCK, REGISTERED] + ([] if why_no_torch else [TORCH])
    rows: list[dict] = []
    for kind in ("queue", "pipe"):
        seconds: dict = {}
        for transport in transports:
            if transport == REGISTERED:
                jt.register()
            ep = _Endpoint(transport, kind)
            try:
                for nbytes in sizes:
                    if transport == TORCH:
                        import torch as th

                        src = th.arange(nbytes // 4, dtype=th.float32)
                        fresh = []

                        def prepare():
                            fresh.append(src.clone())

                        def fn():
                            ep.one(fresh.pop())

                        slow = False
                    else:
                        x = jnp.arange(nbytes // 4, dtype=jnp.float32)
                        jax.block_until_ready(x)
                        made = []

                        # A new array each message, as an actor's new trajectory (the same one
                        # sent again goes by handle: benchmarks/forward.py measures that).
                        def prepare():
                            made.append(jax.block_until_ready(x + 0))

                        def fn():
                            ep.one(made.pop())

                        slow = transport != JT
                    reps = _reps(nbytes, slow)
                    warm = 2 if (not slow or nbytes <= 64 * MIB) else 1
                    ts = []
                    for i in range(warm + reps):
                        if prepare is not None:
                            prepare()
                        gc.collect()
                        t0 = time.perf_counter()
                        fn()
                        if i >= warm:
                            ts.append(time.perf_counter() - t0)
                    sec = statistics.median(ts)
                    seconds[(transport, nbytes)] = sec
                    rows.append({"name": kind, "size_bytes": nbytes, "transport": transport, "seconds": sec,
                                 "spread": (max(ts) - min(ts)) / 2, "gbps": nbytes / sec / 1e9, "reps": len(ts)})
                    _print(rows[-1])
                    if transport == TORCH:
                        del src, fresh
                    else:
                        del x, made
                    gc.collect()
            finally:
                ep.close()
                if transport == REGISTERED:
                    jt.unregister()
        for r in rows:
            if r["name"] != kind:
                continue
            base = seconds.get((STOCK, r["size_bytes"]))
            if base and r["transport"] != STOCK:
                r["ratio"] = base / r["seconds"]
            tsec = seconds.get((TORCH, r["size_bytes"]))
            if tsec and r["transport"] == JT:
                r["vs_torch"] = tsec / r["seconds"]
            if r["transport"] == TORCH:  # the baseline's own version moves its figures (CPU or CUDA build)
                import torch as th

                r["torch_version"] = th.__version__
    memcpy = {n: _memcpy(n) for n in sizes}
    for r in rows:
        r["vs_memcpy"] = r["seconds"] / memcpy[r["size_bytes"]]
    for n in sizes:
        rows.append({"name": "memcpy", "size_bytes": n, "transport": "memcpy", "seconds": memcpy[n],
                     "gbps": n / memcpy[n] / 1e9})
    return rows


PLOT_X = "size_bytes"
PLOT_Y = "gbps"
LIMIT_TRANSPORTS = ("memcpy",)


def check_targets(rows: list[dict]) -> list[str]:
    """PASS/MISS against issue 11: >= 20x stock Queue at 64 MiB-1 GiB; >= 1.0x torch."""
    out = []
    for r in rows:
        if r["transport"] != JT or r["size_bytes"] < 64 * MIB:
            continue
        size = f"{r['size_bytes'] // MIB} MiB"
        if r.get("ratio"):
            ok = r["ratio"] >= 20
            out.append(f"{'PASS' if ok else 'MISS'} {r['name']} {size}: {r['ratio']:.1f}x stock multiprocessing (>= 20x)")
        if r.get("vs_torch"):
            ok = r["vs_torch"] >= 1.0
            out.append(f"{'PASS' if ok else 'MISS'} {r['name']} {size}: {r['vs_torch']:.2f}x torch.multiprocessing (>= 1.0x)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 256 MiB")
    ap.add_argument("--max-mib", type=int, default=None, help="largest message in MiB")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.multiprocessing baseline")
    args = ap.parse_args(argv)
    rows = run(quick=args.quick, max_bytes=args.max_mib * MIB if args.max_mib else None, torch=not args.no_torch)
    _common.print_targets(check_targets(rows))


if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.queue"))
