"""The environment worker processes start with (set before JAX initialises there).

Every change jaxtransport makes to ``os.environ`` goes through :func:`environ_overlay` (in a
parent, for the duration of a child's start) or :func:`apply_environ` (in the child, for good);
what a child gets is computed here too (:func:`worker_env` for Pool workers,
:func:`child_jax_env` for Ray's ``runtime_env``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import _devices  # the parent's device plan; a worker applying its environment needs none

__all__ = [
    "NO_PREALLOCATION",
    "apply_environ",
    "child_jax_env",
    "environ_overlay",
    "fork_refused",
    "malloc_huge_pages",
    "worker_env",
]

# Re-entrant, so that apply_environ() inside an overlay on the same thread cannot deadlock.
_ENVIRON_LOCK = threading.RLock()

# What every worker process gets: no GPU memory grab (N workers sharing a GPU must not each
# preallocate 75% of it).
NO_PREALLOCATION = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@contextlib.contextmanager
def environ_overlay(env: Mapping[str, str | None]) -> Iterator[None]:
    """Apply ``env`` to ``os.environ`` (None unsets) for the duration of the block, then restore
    exactly what was there. Spawned children start with the parent's environment at exec time,
    so this is how a child's variables reach it before anything (JAX included) runs there.
    Holds a process-wide lock: concurrent overlays never interleave."""
    with _ENVIRON_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        try:
            _apply(env)
            yield
        finally:
            _apply(saved)


def apply_environ(env: Mapping[str, object]) -> None:
    """Apply ``env`` to ``os.environ`` for good (None unsets; other values as ``str``): what a
    worker process does with the variables its parent chose, before it first uses JAX. When
    JAX is already imported here (a forkserver may have imported it) and ``env`` sets
    ``JAX_PLATFORMS``, JAX's config is told too, since JAX read that variable at import."""
    with _ENVIRON_LOCK:
        _apply(env)
    if "jax" in sys.modules and "JAX_PLATFORMS" in env:
        try:
            sys.modules["jax"].config.update("jax_platforms", env["JAX_PLATFORMS"] or None)
        except Exception:
            pass


def _apply(env: Mapping[str, object]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)


def fork_refused(what: str, knob: str = "start_method") -> str:
    """Why ``what`` (jaxtransport.Pool, jaxtransport.multiprocessing) refuses the fork start method."""
    return (
        f"{what} refuses {knob}='fork': JAX runs threads (XLA's thread pools, the runtime) that "
        "fork() does not copy, so a forked child that touches JAX can deadlock. Use "
        f"{knob}='spawn' (the default) or 'forkserver'; functions defined in __main__ or a "
        "notebook still work (they travel with cloudpickle)."
    )


_HUGETLB = "glibc.malloc.hugetlb"


def malloc_huge_pages(tunables: str | None) -> str:
    """``GLIBC_TUNABLES`` for a worker process: ``tunables`` plus ``glibc.malloc.hugetlb=1``
    (kept as it is when it already sets ``glibc.malloc.hugetlb``).

    Note [huge pages for JAX buffers]: numpy asks for transparent huge pages on its large
    arrays (``madvise(MADV_HUGEPAGE)``), XLA's CPU allocator does not, and with THP in its
    common "madvise" mode a JAX buffer is therefore backed by 4 KiB pages. Copying 1 GiB out
    of one (into shared memory, or Ray's object store) then takes ~10-25% longer than out of
    a numpy array, from TLB misses. This tunable (glibc >= 2.35; ignored by older glibc and by
    other C libraries) makes malloc madvise its large mmap'd chunks the same way, so JAX's
    buffers get huge pages too. It must be in the environment when the process starts.
    """
    parts = [p for p in (tunables or "").split(":") if p]
    if any(p.split("=", 1)[0] == _HUGETLB for p in parts):
        return ":".join(parts)
    return ":".join(parts + [f"{_HUGETLB}=1"])


def _parent_x64() -> bool:
    """Whether this process enabled 64-bit types in JAX (without importing JAX)."""
    jax = sys.modules.get("jax")
    try:
        return jax is not None and bool(jax.config.jax_enable_x64)
    except AttributeError:
        return False


def child_jax_env(base: Mapping[str, str], *, huge_pages: bool = True) -> dict[str, str]:
    """``base`` (copied) plus what a child process needs to run JAX as this one does, where
    ``base`` does not say otherwise: ``JAX_ENABLE_X64=1`` when this process enabled x64 (so that
    float64 arguments stay float64 there), and with ``huge_pages`` a ``GLIBC_TUNABLES`` (``base``'s,
    else this process's) that also sets ``glibc.malloc.hugetlb=1`` (Note [huge pages for JAX
    buffers])."""
    env = dict(base)
    if _parent_x64() and "JAX_ENABLE_X64" not in env:
        env["JAX_ENABLE_X64"] = "1"
    if huge_pages:
        env["GLIBC_TUNABLES"] = malloc_huge_pages(env.get("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES")))
    return env


def worker_env(index: int, *, devices: _devices.Plan, overrides: Mapping[str, object] | None) -> dict:
    """Variables for worker ``index``: ``XLA_PYTHON_CLIENT_PREALLOCATE=false``,
    ``JAX_ENABLE_X64=1`` when the parent enabled x64, ``GLIBC_TUNABLES`` with
    ``glibc.malloc.hugetlb=1`` (Note [huge pages for JAX buffers]), then what the device plan
    gives this worker (:func:`jaxtransport._devices.plan`: the parent's ``JAX_PLATFORMS``, the
    accelerators it may open or ``JAX_PLATFORMS=cpu``); ``overrides`` win (a value of None
    unsets)."""
    env: dict[str, str | None] = {**NO_PREALLOCATION, **child_jax_env({})}
    env.update(devices.env(index))
    if overrides:
        env.update({str(k): (None if v is None else str(v)) for k, v in overrides.items()})
    return env
