"""A pool worker's C heap: large buffers recycled warm while it works, handed back when it idles
(Note [a warm heap in workers]).

glibc (detected by ``confstr``, in auto mode): ``mallopt`` and ``malloc_trim`` through ctypes.
Elsewhere (macOS, musl, Windows; ``JAXTRANSPORT_PLATFORM=portable`` or ``inband``) nothing is
changed: the process keeps its C library's behaviour.

Note [a warm heap in workers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The cause of issue 49's tail. A pool worker's own ``jnp.ones((16 Mi,)).block_until_ready()``
(a fresh 64 MiB float32 array, as a task makes a result) took 4.7-6.1 ms at the median but
94-107 ms at p99 on a 2-core VM, while the same call in a stock ``multiprocessing.Pool`` worker
took 11.8 ms at the median and 14.4 ms at p99. Measured per call in the worker:

- XLA's CPU allocator takes each buffer from malloc. glibc serves a request above its mmap
  threshold (at most 32 MiB unless set) with a fresh ``mmap`` and gives it back with
  ``munmap`` on free: every 64 MiB result is built in pages the process has never touched.
- A jaxtransport worker asks for transparent huge pages on those chunks
  (``glibc.malloc.hugetlb=1``, Note [huge pages for JAX buffers] in ``_procenv``), so the buffer
  faults in 32 pages of 2 MiB (33 minor faults per call) where a stock worker takes 16,385 of
  4 KiB. The median call is faster for it (7.6 ms of CPU here against 29 ms).
- But a 2 MiB page is a whole free block of the kernel's, and on a VM such a block is often
  not backed by the host: the guest reports free 2 MiB blocks to the host, which drops them
  (virtio-balloon free page reporting, ``page_reporting_order=9`` on this VM; memory never used
  since boot is the same). The first touch of such a page is a fault in the host as well, about
  1.4 s/GiB here. The worker's CPU time per call (``/proc/self/task/*/schedstat``) shows it
  with the load taken out: p50 7.6-7.9 ms, p99 63-99 ms, max 71-150 ms, all of it system time,
  with the same 33 faults; no compaction (``compact_stall`` stayed 0), no fallback to small
  pages. A stock worker's 4 KiB faults are served from the small free blocks the kernel keeps
  recycling, which are never reported: 29-38 ms of CPU, no tail.
- Whether a call's pages are cold depends on what happened to the blocks since the last free
  (taken by another process, reported meanwhile), hence one call in ten to thirty.

The fix keeps the worker's large buffers in its own heap while it works: ``mallopt`` raises
the mmap threshold (buffers up to :data:`WARM_MAX` come from the heap, not from ``mmap``) and
the trim threshold (a free of up to :data:`KEEP_MAX` at the heap's top stays mapped), and sets
one arena: every thread allocates from the main heap. Without that, a buffer XLA allocates on
one of its own threads (the output of ``x + 1`` on a received array: the Executor's case) comes
from that thread's arena, whose heaps are at most 64 MiB, so a 64 MiB buffer was still mmap'd
fresh at every call (33 faults each, CPU p99 81 ms) while ``jnp.full``'s, made on the task's
thread, was warm. One arena means one lock for the worker's threads' larger allocations (small
ones come from each thread's lock-free cache); a worker's threads are the task's and XLA's. The next
buffer of that size is then carved from pages this process already touched: 0 faults, no
zeroing, no cold page; the worker's own call takes 3.5 ms of CPU at the median and 5.7 ms at
p99 (64 MiB), 12-16 ms at 256 MiB. Nothing is copied; what is kept is memory the process
already had at its peak, and the worker hands all of it back (``malloc_trim(0)``, which also
releases free pages inside the heap) once it has had no task for :data:`IDLE_TRIM_S` seconds
(30; ``JAXTRANSPORT_HEAP_IDLE_S`` in ``worker_env`` sets it), so an idle pool holds no more than
a stock one. Not after a short pause: memory handed back is reported to a VM's host within
seconds (every 5 s or so here), so a worker that trimmed in each pause of a training loop would
build every result in cold pages. The first buffers of a size a worker makes, and the first after
a trim, still take fresh pages: a worker's heap grows to its working set over its first
few tasks (a result's buffer may outlive the next task's start). A worker whose environment sets
either threshold itself (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
``glibc.malloc.mmap_threshold`` / ``trim_threshold`` in ``GLIBC_TUNABLES``) is left as it is;
one that sets the arenas (``MALLOC_ARENA_MAX``, ``glibc.malloc.arena_max``) keeps its arenas.
"""

from __future__ import annotations

import ctypes
import os

from . import _mode

__all__ = [
    "IDLE_ENV",
    "IDLE_TRIM_S",
    "KEEP_MAX",
    "WARM_MAX",
    "heap_settings_of_user",
    "idle_trim_seconds",
    "keep_heap_warm",
    "trim_heap",
]

WARM_MAX = 512 << 20  # buffers up to this size come from the heap (mmap threshold)
KEEP_MAX = 1 << 30  # free memory at the heap's top kept mapped while working (trim threshold)
# A worker with no task for this long hands its free heap memory back. Long beside a training
# loop's pauses: memory handed back is reported to a VM's host within seconds, so a worker that
# trimmed between every two tasks would pay the cold pages at every task.
IDLE_TRIM_S = 30.0
IDLE_ENV = "JAXTRANSPORT_HEAP_IDLE_S"  # overrides IDLE_TRIM_S (seconds) in a worker's environment

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
_USER_ARENAS = ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max")

_libc = None


def _glibc():
    """libc with ``mallopt`` and ``malloc_trim`` typed, or None (not glibc, or not auto mode)."""
    global _libc
    if _libc is None:
        lib = None
        if _mode.mode() == _mode.AUTO:
            try:
                glibc = os.confstr("CS_GNU_LIBC_VERSION")
            except (AttributeError, ValueError, OSError):
                glibc = None
            if glibc:
                try:
                    lib = ctypes.CDLL(None)
                    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                    lib.mallopt.restype = ctypes.c_int
                    lib.malloc_trim.argtypes = [ctypes.c_size_t]
                    lib.malloc_trim.restype = ctypes.c_int
                except (OSError, AttributeError):
                    lib = None
        _libc = lib or False
    return _libc or None


def heap_settings_of_user(environ=None, names: tuple[str, ...] = _USER_KNOBS + _USER_TUNABLES) -> bool:
    """Whether the environment sets any of glibc's malloc settings ``names`` itself (by default
    the mmap and trim thresholds), as a ``MALLOC_*`` variable or in ``GLIBC_TUNABLES``."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in names if not k.startswith("glibc.")):
        return True
    tunables = env.get("GLIBC_TUNABLES") or ""
    return any(p.split("=", 1)[0] in names for p in tunables.split(":"))


def keep_heap_warm() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (Note [a warm heap in workers]).
    True when glibc took both; False where nothing was changed (another C library, the
    portable modes, or the environment sets them itself)."""
    lib = _glibc()
    if lib is None or heap_settings_of_user():
        return False
    if not heap_settings_of_user(names=_USER_ARENAS):
        # One arena: a thread's arena is a heap of at most 64 MiB, so a buffer of 64 MiB or more
        # that XLA allocates on one of its own threads would still be mmap'd fresh (before any
        # thread has an arena of its own: called first thing in the worker).
        lib.mallopt(_M_ARENA_MAX, 1)
    # The trim threshold first: a heap that may now grow by large chunks never trims below it.
    return bool(lib.mallopt(_M_TRIM_THRESHOLD, KEEP_MAX)) and bool(lib.mallopt(_M_MMAP_THRESHOLD, WARM_MAX))


def idle_trim_seconds() -> float:
    """How long this worker waits without a task before it trims: ``JAXTRANSPORT_HEAP_IDLE_S``
    (seconds) when set to a number, else :data:`IDLE_TRIM_S`."""
    try:
        return max(0.0, float(os.environ[IDLE_ENV]))
    except (KeyError, ValueError):
        return IDLE_TRIM_S


def trim_heap() -> bool:
    """Hand this process's free heap memory back to the kernel (``malloc_trim(0)``): True when
    some was."""
    lib = _glibc()
    return bool(lib.malloc_trim(0)) if lib is not None else False
