"""Shared benchmark helpers: environment banner, repeated timing with medians, the warm-memcpy
baseline and a plain-text table. Benchmarks never gate CI; they print figures with ratios
against baselines measured in the same run."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def env_info() -> dict:
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
