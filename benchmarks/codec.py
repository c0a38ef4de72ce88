"""Q: what does pickling a jax.Array cost with jaxtransport, against JAX's own pickling and
against the physical limit (one warm memcpy of the same bytes), measured in the same run?

Transports per size:
- ``jax-default``: ``pickle.loads(pickle.dumps(x, protocol=5))`` with JAX's own ``__reduce__``
  (in-band: the bytes are copied into the pickle, then out again, then onto the device).
- ``jt-dumps-loads``: ``jt.loads(*jt.dumps(x))`` (protocol 5, out-of-band): no copy on CPU.
- ``jt-one-copy``: the same, plus what a real transport does: copy the out-of-band buffers once
  into warm, 64-byte-aligned receive memory; the receiver aliases that memory.
- ``jt-registered-inband``: ``pickle.dumps`` after ``jt.register()`` with no buffer callback
  (what plain pickle users get: in-band, but no detour through ``tobytes``).
- ``memcpy``: one warm copy of the same bytes (the limit).

Plus two ``codec-decode`` rows for a 4 KiB array: ``jt.loads`` through the fast host->device
path (``batched_device_put`` directly; see ``jaxtransport._compat``) and through plain
``jax.device_put``, and a line saying whether this JAX gets the fast path (a version whose
internals moved loses it, and the line says so and why).

Targets (issue 2): at >= 64 MiB, dumps+loads costs <= 2x one warm memcpy and is >= 20x faster
than JAX's default pickle.

Run: ``python -m benchmarks.codec [--quick]``.
"""

from __future__ import annotations

import argparse
import pickle

import jax
import jax.numpy as jnp
import numpy as np

import jaxtransport as jt

from ._common import KiB, GiB, MiB, print_env, print_table, reps_for, row, timeit, warm_memcpy


BASELINE = "jax-default"
LABELS = {
    "jax-default": "jax-default: pickle.dumps + loads with JAX's own reducer (the bytes in-band)",
    "jt-dumps-loads": "jt-dumps-loads: jt.dumps + jt.loads in one process, nothing copied "
                      "(not a transfer: hence below memcpy)",
    "jt-one-copy": "jt-one-copy: jt.dumps + one copy of the buffers into receive memory + "
                   "jt.loads (what a transport pays)",
    "jt-registered-inband": "jt-registered-inband: pickle.dumps + loads after jt.register(), "
                            "no buffer_callback (the bytes in-band)",
    "memcpy": "warm memcpy of the same bytes (the limit for one copy)",
}
ANNOTATE = ("jt-one-copy",)
NO_SPEEDUP = ("jt-dumps-loads",)
PLOT_TITLES = {"codec": "one jax.Array through pickle, in one process"}
PLOT_NOTE = ("jt-dumps-loads is left out of the speedup panel: it moves no bytes (the receiver "
             "aliases the sender's buffer), so its ratio only grows with the size (thousands of "
             "times at 1 GiB) and says nothing about a transfer; jt-one-copy is the fair one.")


def _aligned(nbytes: int) -> np.ndarray:
    store = np.ones(nbytes + 64, np.uint8)  # touched
    off = (-store.ctypes.data) % 64
    return store[off : off + nbytes]


def sizes(quick: bool) -> list[int]:
    top = 256 * MiB if quick else GiB
    out, s = [], KiB
    while s <= top:
        out.append(s)
        s *= 16 if s < MiB else 4
    return out


def run(quick: bool = False) -> list[dict]:
    rows: list[dict] = []
    for size in sizes(quick):
        reps = reps_for(size, quick)
        x = jnp.ones(size // 4, jnp.float32) * 1.5
        x.block_until_ready()
        memcpy = warm_memcpy(size, reps)

        def default():
            pickle.loads(pickle.dumps(x, protocol=5)).block_until_ready()

        def oob():
            jt.loads(*jt.dumps(x)).block_until_ready()

        recv = _aligned(size)

        def one_copy():
            data, bufs = jt.dumps(x)
            np.copyto(recv, np.frombuffer(bufs[0], np.uint8))
            y = jt.loads(data, [recv])
            y.block_until_ready()
            return y

        y = one_copy()
        assert y.unsafe_buffer_pointer() == recv.ctypes.data, "receiver did not alias"
        del y

        def registered():
            jt.register()
            try:
                pickle.loads(pickle.dumps(x, protocol=5)).block_until_ready()
            finally:
                jt.unregister()

        big = size >= 256 * MiB
        # (median, min, max) of each: every row keeps its runs and spread.
        timings = {
            "jax-default": timeit(default, reps, warmup=0 if big else 1),
            "jt-dumps-loads": timeit(oob, reps),
            "jt-one-copy": timeit(one_copy, reps),
            "jt-registered-inband": timeit(registered, reps, warmup=0 if big else 1),
            "memcpy": (memcpy, None, None),
        }
        t_default = timings["jax-default"][0]
        for transport, (sec, lo, hi) in timings.items():
            extra = {} if lo is None else {"min": lo, "max": hi, "reps": reps}
            rows.append(
                row(
                    "codec",
                    size,
                    transport,
                    sec,
                    x_memcpy=sec / memcpy if memcpy > 0 else float("nan"),
                    speedup_vs_default=t_default / sec if sec > 0 else float("inf"),
                    **extra,
                )
            )
        del x, recv
    rows += decode_path_rows(50 if quick else 200)
    return rows


def decode_path_rows(reps: int = 200) -> list[dict]:
    """Decode of a small array through the fast path and through jax.device_put, same run."""
    from jaxtransport import _compat

    fast, why = _compat.fast_put_available()
    x = jnp.ones(1024, jnp.float32)
    data, bufs = jt.dumps(x)
    bufs = [bytes(b) for b in bufs]

    def decode():
        jt.loads(data, bufs).block_until_ready()

    saved = _compat._FAST_PUT
    t_fast = timeit(decode, reps, warmup=20)[0] if fast else float("nan")
    _compat._FAST_PUT = False  # force jax.device_put
    try:
        t_slow = timeit(decode, reps, warmup=20)[0]
    finally:
        _compat._FAST_PUT = saved
    label = "yes" if fast else f"no: {why}"
    return [
        row("codec-decode", x.nbytes, "jt-loads-fast-put", t_fast, fast_path=label,
            speedup_vs_device_put=t_slow / t_fast if fast and t_fast > 0 else float("nan")),
        row("codec-decode", x.nbytes, "jt-loads-jax-device-put", t_slow, fast_path=label,
            speedup_vs_device_put=1.0),
    ]


def decode_path_line(rows: list[dict]) -> str:
    by = {r["transport"]: r for r in rows if r["name"] == "codec-decode"}
    fast, slow = by.get("jt-loads-fast-put"), by.get("jt-loads-jax-device-put")
    if not fast or not slow:
        return "INFO decode path: not measured"
    version = f"jax {jax.__version__}"
    if fast["fast_path"] != "yes":
        return (f"LOST fast device_put path on {version} ({fast['fast_path'][4:]}): every decode "
                f"goes through jax.device_put ({slow['seconds'] * 1e6:.0f} us for 4 KiB)")
    return (f"INFO fast device_put path on {version}: 4 KiB decode {fast['seconds'] * 1e6:.0f} us "
            f"vs {slow['seconds'] * 1e6:.0f} us through jax.device_put "
            f"({fast['speedup_vs_device_put']:.1f}x)")


def check_targets(rows: list[dict]) -> list[str]:
    out = [decode_path_line(rows)]
    for r in rows:
        if r["size_bytes"] >= 64 * MiB and r["transport"] in ("jt-dumps-loads", "jt-one-copy"):
            ok = r["x_memcpy"] <= 2.0 and r["speedup_vs_default"] >= 20
            out.append(
                f"{'PASS' if ok else 'MISS'} {r['transport']} @ {r['size_bytes'] >> 20} MiB: "
                f"{r['x_memcpy']:.2f}x memcpy (target <= 2x), "
                f"{r['speedup_vs_default']:.0f}x faster than jax default (target >= 20x)"
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="sizes up to 256 MiB, fewer repetitions")
    args = p.parse_args()
    print_env("codec: dumps+loads of one jax.Array")
    rows = run(args.quick)
    print_table([r for r in rows if r["name"] == "codec"],
                ["size_bytes", "transport", "seconds", "gbps", "x_memcpy", "speedup_vs_default"])
    print()
    print_table([r for r in rows if r["name"] == "codec-decode"],
                ["size_bytes", "transport", "seconds", "fast_path", "speedup_vs_device_put"])
    print()
    for line in check_targets(rows):
        print(line)


if __name__ == "__main__":
    main()
