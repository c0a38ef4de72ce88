"""Shared benchmark helpers: environment banner, repeated timing with medians, the warm-memcpy
baseline and a plain-text table. Benchmarks never gate CI; they print figures with ratios
against baselines measured in the same run."""

from __future__ import annotations

import functools
import gc
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def env_info(backend: bool = True) -> dict:
    """Versions, cores and memory; with ``backend``, JAX's default backend too (which starts it:
    a benchmark whose child processes use the accelerator passes False)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }
    for mod in ("jax", "jaxlib", "cloudpickle", "ray"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    try:
        import jax

        if backend:
            info["jax_backend"] = jax.default_backend()
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return info


def print_env(title: str) -> dict:
    info = env_info()
    print(f"# {title}")
    print("# " + ", ".join(f"{k}={v}" for k, v in info.items()))
    return info


def timeit(fn: Callable[[], object], reps: int, warmup: int = 1) -> tuple[float, float, float]:
    """(median, min, max) seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times)


def timed(fn: Callable[..., object], reps: int, warmup: int = 1, prepare: Callable[[], object] | None = None) -> list[float]:
    """The seconds of each of ``reps`` calls of ``fn()`` after ``warmup`` untimed ones, with a
    garbage collection before each timed call (so none lands inside one). With ``prepare``,
    each call is ``fn(prepare())``, ``prepare()`` run outside the timed region."""
    for _ in range(warmup):
        fn() if prepare is None else fn(prepare())
    ts = []
    for _ in range(reps):
        arg = None if prepare is None else prepare()
        gc.collect()
        t = time.perf_counter()
        fn() if prepare is None else fn(arg)
        ts.append(time.perf_counter() - t)
        del arg
    return ts


def fresh_copies(x: Any) -> Callable[[], Any]:
    """A function that returns a new jax.Array equal to ``x`` at each call, computed and ready.
    A jaxtransport Pool or queue sends the *same* live array again by handle (no copy:
    ``benchmarks/forward.py`` measures that), so a row that times moving an array makes a new
    one for each call, outside the timed region, as a learner's new parameters each step."""
    import jax

    def make():
        return jax.block_until_ready(x + 0)

    return make


def reps_for(nbytes: int, quick: bool) -> int:
    if nbytes >= 256 * MiB:
        return 3
    if nbytes >= 16 * MiB:
        return 5 if quick else 7
    return 15 if quick else 30


def warm_memcpy(nbytes: int, reps: int) -> float:
    """Median seconds of one memcpy of ``nbytes`` between two already-touched buffers."""
    src = np.ones(max(nbytes, 1), np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    return timeit(lambda: np.copyto(dst, src), reps)[0]


def put_in_pieces(h: np.ndarray, k: int) -> Any:
    """``h`` on JAX's default device as ``k`` pieces along its first axis (the last one shorter
    where they do not divide it), put by one ``device_put`` of the list (the transfers overlap)
    and joined there by one jitted concatenate: a host-to-device limit (not waited for)."""
    import jax

    per = -(-len(h) // k)
    parts = jax.device_put([h[s : s + per] for s in range(0, len(h), per)])
    return _joiner(len(parts))(*parts)


@functools.cache
def _joiner(count: int) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda *parts: jnp.concatenate(parts))


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def row(name: str, size: int, transport: str, seconds: float, **extra) -> dict:
    return dict(
        name=name,
        size_bytes=size,
        transport=transport,
        seconds=seconds,
        gbps=(size / seconds / 1e9) if seconds > 0 else float("inf"),
        **extra,
    )


def print_table(rows: list[dict], columns: list[str]) -> None:
    def cell(r, c):
        v = r.get(c, "")
        if c == "size_bytes":
            return fmt_size(v)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(cell(r, c)) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(cell(r, c).ljust(w) for c, w in zip(columns, widths)))
    sys.stdout.flush()


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def versions_line(*, ray: bool = False) -> str:
    """One line: python, jax, (with ``ray``: Ray or "-"), numpy, usable cores, kernel release."""
    import jax

    parts = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
    if ray:
        try:
            import ray as ray_module

            parts.append(f"ray {ray_module.__version__}")
        except ImportError:
            parts.append("ray -")
    parts += [f"numpy {np.__version__}", f"{usable_cores()} cores", platform.release()]
    return ", ".join(parts)


def median_row(name: str, size: int, transport: str, ts: list[float], base: float | None = None, *,
               gbps: bool = False, inverse: bool = False, **extra) -> dict:
    """A row of repeated timings ``ts``: their median as ``seconds``, ``min``, ``max`` and
    ``reps``; with ``base`` (the baseline's median) ``ratio`` = base / median (higher is
    better), and with ``inverse`` also ``vs_baseline`` = median / base (this row's time in
    baselines); with ``gbps`` the median's throughput. Then ``extra``, in order."""
    med = statistics.median(ts)
    r = {"name": name, "size_bytes": size, "transport": transport, "seconds": med, "min": min(ts), "max": max(ts)}
    if gbps:
        r["gbps"] = size / med / 1e9 if size and med else None
    r["ratio"] = base / med if base else None
    if inverse:
        r["vs_baseline"] = med / base if base else None
    r["reps"] = len(ts)
    r.update(extra)
    return r


def print_median_row(r: dict, *, name_width: int, size_width: int, seconds_width: int, tail: str = "") -> None:
    """One line of a :func:`median_row`: name, size in MiB, transport, median (min, max, n)."""
    size = f"{r['size_bytes'] / MiB:{size_width}.0f} MiB" if r["size_bytes"] else "-".rjust(size_width + 4)
    print(f"{r['name']:<{name_width}} {size} {r['transport']:<38} median {r['seconds']:{seconds_width}.3f} s "
          f"(min {r['min']:.3f}, max {r['max']:.3f}, n={r['reps']}){tail}", flush=True)


def print_targets(lines: list[str]) -> None:
    """The PASS/MISS lines of a benchmark's ``check_targets``, after its rows."""
    print("\ntargets:")
    for text in lines:
        print("  " + text)


def main_of_module(modname: str, *, cpu: bool = False):
    """What a benchmark run as a script (``python -m benchmarks.NAME``) does: run the importable
    module's ``main()``, not this ``__main__`` copy's. Workers import task bodies from the
    module; functions defined in ``__main__`` would travel by value (cloudpickle) on every task,
    which would measure cloudpickle rather than the transport (multiprocessing.Pool pickles them
    by reference). ``cpu``: JAX on CPU unless ``JAX_PLATFORMS`` says otherwise."""
    import importlib

    if cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return importlib.import_module(modname).main()
