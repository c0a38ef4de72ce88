"""The threads that copy large buffers into shared memory, where a host has cores to spare; the
boundary (``ALIGN``) arrays start on, and buffers made on it (:func:`aligned_empty`).

Note [copies into a slot in threads]
Two copies into a slot were bound by one thread on a TPU v5e host (13 cores, 256 MiB):

- *From the chip.* The pieces of Note [device to host in chunks] (``_codec``) travel side by
  side, so they arrive close together, near the end of the whole transfer; copied into the slot
  one after another on the caller's thread, the copies ran after the transfer instead of beside
  it. ``jt.dumps``, which copies nothing, took 22.5 ms; the Pool's argument 43.6 ms, and 43.4 ms
  with every piece in flight.
- *From the host.* A worker's 256 MiB result is one ``memcpy`` into its slot before the parent
  can put it on the chip: 13 ms at that host's 20 GB/s on one thread, a third of the Pool's
  result beside production and the host-to-device copy (49 ms).

So where the process may run on more than two cores, the pieces from the chip are each taken
(``np.asarray``) and copied by one of up to COPY_THREADS threads, and a host copy of
PARALLEL_MIN bytes and up is cut into ranges of at least PARALLEL_PIECE bytes copied side by side
(numpy's copy releases the GIL). The caller returns only once no copy into the slot can still
run, on an error or a KeyboardInterrupt too (:func:`settle`): the slot may go to another message
at once. The threads are made on first use, in a process that makes such a copy, are shared by
every copy of the process (a copy waits for a free thread, never for another copy to end), and
end with the interpreter. On two cores or fewer (this project's CI) nothing changes: one thread
copies, as before.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from . import _os

# The boundary every array's data starts on where this package allocates it: slots in shared
# memory (``_shm``) and fresh buffers (:func:`aligned_empty`). Defined here, not in ``_shm``, so
# that the codec, which uses it, works where shared memory does not and never imports ``_shm``.
ALIGN = 64

COPY_THREADS: int | None = None  # None: one fewer than the cores this process may use, at most 8
PARALLEL_MIN = 32 << 20
PARALLEL_PIECE = 8 << 20

_pool: Any = None
_lock = threading.Lock()


def copiers() -> Any:
    """The process's copy threads (a ThreadPoolExecutor), or None where there are too few cores
    (Note [copies into a slot in threads])."""
    global _pool
    if threads() < 2:
        return None
    with _lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(threads(), thread_name_prefix="jaxtransport-copy")
        return _pool


def aligned_empty(shape: tuple, dtype: Any, align: int = ALIGN) -> np.ndarray:
    """An uninitialised array whose data starts at an ``align``-byte boundary (``ALIGN``, where
    arrays land in shared memory, by default). JAX's CPU client aliases a host array only when
    its data is 64-byte aligned and copies it otherwise, and numpy's large allocations start 16
    bytes past a page (glibc's chunk header): an array made here goes into a jitted call or
    ``device_put`` without that copy. On a TPU v5e host one
    acting step of the rollouts demo (``_conv.act`` on 8 stacked Atari frames, one core) took
    0.27 ms from an aligned array and 0.65-0.7 ms from one 16 or 48 bytes past a boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + n].view(dtype).reshape(shape)


def threads() -> int:
    """How many copy threads this process has (or would have)."""
    return COPY_THREADS if COPY_THREADS is not None else min(8, _os.cpu_count() - 1)


def settle(landing: collections.deque) -> None:
    """Cancel the copies of ``landing`` (futures) not started and wait for those running; a
    KeyboardInterrupt meanwhile is raised once they are done (Note [copies into a slot in
    threads])."""
    from concurrent.futures import wait

    futures = list(landing)
    landing.clear()
    for f in futures:
        f.cancel()
    interrupted = None
    while True:
        try:
            wait(futures)
            break
        except KeyboardInterrupt as e:  # the copies still write into the slot: wait them out
            interrupted = e
    if interrupted is not None:
        raise interrupted


def copy_bytes(src: np.ndarray, dst: np.ndarray) -> None:
    """``np.copyto(dst, src)`` of two flat uint8 arrays, in ranges side by side where the copy
    is large and the host has cores to spare (Note [copies into a slot in threads])."""
    n = src.nbytes
    pool = copiers() if n >= PARALLEL_MIN else None
    if pool is None:
        np.copyto(dst, src)
        return
    k = min(threads() + 1, n // PARALLEL_PIECE)
    step = -(-n // k)
    landing: collections.deque = collections.deque()
    try:
        for lo in range(step, n, step):
            landing.append(pool.submit(np.copyto, dst[lo : lo + step], src[lo : lo + step]))
        np.copyto(dst[:step], src[:step])  # the caller copies the first range itself
        for f in list(landing):
            f.result()
    finally:
        settle(landing)


def copy_landing(src: np.ndarray, dst: np.ndarray, groups: int, landed: Any) -> None:
    """:func:`copy_bytes` of two flat uint8 arrays in ``groups`` consecutive parts, calling
    ``landed(upto)`` after each part but the last: ``dst[:upto]`` holds its bytes (Note [a
    result put while it lands] in ``_codec``)."""
    n = src.nbytes
    step = max(-(-n // max(groups, 1)), 1)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        copy_bytes(src[lo:hi], dst[lo:hi])
        if hi < n:
            landed(hi)
