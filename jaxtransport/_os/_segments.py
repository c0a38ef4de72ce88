"""Shared-memory segments as file descriptors: where one comes from and how it gets its pages.

Note [segment kinds]
A segment is an fd of a memory file, its size set once by the process that makes it, passed to
receivers over a Unix socket (SCM_RIGHTS) and mapped there. Two kinds, chosen once per process
(Note [platforms]):

- ``memfd`` (Linux): ``memfd_create``: the file never has a name, so nothing can be left behind
  by any crash, and Docker's 64 MiB ``/dev/shm`` does not bound it. It can grow in place.
- ``posix`` (macOS, or ``JAXTRANSPORT_PLATFORM=portable``): ``shm_open`` of a fresh random name
  (``/jaxtransport-`` and 16 hex digits: 30 bytes, under macOS's 31), unlinked the moment the fd
  exists, so it too lives only as long as its fds and mappings; only a process killed in the
  microseconds between the two calls could leave a name. macOS sizes such an object once
  (``ftruncate``), so these segments never grow: a larger array gets a new segment.

Note [how a segment gets its pages]
A new segment's pages are allocated and mapped on the sending thread before any byte is copied:
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) does both in one pass and, unlike MAP_POPULATE,
reports a page it cannot get as an error (ENOMEM/EFAULT) instead of leaving a SIGBUS for the
first write, so a full system is a ShmCapacityError here. Older kernels get the previous path:
``posix_fallocate`` (the reservation) then ``mmap(MAP_POPULATE)``. Measured on a 2-core VM
(1 GiB, medians of noisy runs): fallocate + MAP_POPULATE + copy 1.4-1.9 s; POPULATE_WRITE +
copy 1.1-1.8 s; no population, the copy faulting the pages 1.4-1.6 s (and without fallocate
that would be a SIGBUS on a full system); the copy split across two threads 2.4-4.3 s (page
faults on one file contend), and so was populating 8 MiB ahead of the copy in a helper thread;
population alone split across two threads was ~15% faster than one at 256 MiB and 1 GiB when
the machine was not saturated (and no better when it was), so large segments do that.
Where neither exists (macOS: no MAP_POPULATE, no populating madvise, no posix_fallocate) the
pages are touched: one byte written per page, by up to 4 threads (one per core) from 64 MiB on.
Measured here on a 256 MiB POSIX segment (noisy 2-core VM): touching with one thread 0.33-1.2 s,
two threads 0.32-0.54 s, then the copy 0.04 s; no population at all, the copy faulting the
pages, 0.31-0.34 s in all; writing zeros through the fd (``pwrite``, which macOS does not allow
on shared memory) 0.34-0.39 s. Touching costs about what faulting during the copy does and moves
it off the copy, as the Linux paths do (Pool(shm_reserve=...) then makes it in the background).
Every fresh 4 KiB page costs one fault (shmem gets transparent huge pages only where
/sys/kernel/mm/transparent_hugepage/shmem_enabled allows them: segments ask with
MADV_HUGEPAGE, which the common "never" ignores), so the arena avoids fresh pages.
Receivers map segments without populating: their page-table entries fill on first access
(read faults map 16 pages at a time) and the pages already exist, so that cannot SIGBUS.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Any

from .._errors import ShmCapacityError
from . import _channels, _mode, _procinfo

__all__ = [
    "PAGE",
    "addr",
    "can_grow",
    "capacity_failure",
    "create_segment",
    "format_bytes",
    "grow_segment",
    "populate",
    "populate_method",
    "segment_kind",
    "touch",
]

PAGE = mmap.PAGESIZE
SLAB = 2 << 20
NAME_PREFIX = "/jaxtransport-"  # + 16 hex digits: 30 bytes (macOS allows 31)


def _posixshmem() -> Any:
    try:
        import _posixshmem  # CPython's shm_open/shm_unlink (multiprocessing.shared_memory's)
    except ImportError:
        return None
    return _posixshmem


def segment_kind() -> str | None:
    """``"memfd"``, ``"posix"``, or None (no shared memory: in-band only). Probed once."""
    global _kind
    if _kind is _UNSET:
        m = _mode.mode()
        if m == _mode.INBAND or not _channels.fd_passing():
            _kind = None  # a segment nobody else can map is of no use: in-band
        elif m == _mode.AUTO and hasattr(os, "memfd_create"):
            _kind = "memfd"
        elif _posixshmem() is not None:
            _kind = "posix"
        else:
            _kind = None
    return _kind


_UNSET: Any = object()
_kind: Any = _UNSET


def format_bytes(n: float) -> str:
    """``n`` bytes for an error message: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def capacity_failure(size: int, why: str | None) -> ShmCapacityError:
    free = _procinfo.free_memory()
    return ShmCapacityError(
        f"jaxtransport.Pool could not reserve {format_bytes(size)} ({size} bytes) of shared "
        f"memory: the system has about {format_bytes(free)} ({free} bytes) free ({why}). "
        "Fixes: send smaller arrays or fewer at once (drop results you no longer need, "
        "release() SharedTrees), lower shm_capacity or shm_reserve so the pool waits instead, "
        "or give the container more memory (docker --memory / --shm-size)."
    )


_NO_MEMORY = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EFAULT)

# -- populating (Note [how a segment gets its pages])

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+ (Python 3.13 names it)
_method: str | None = None  # probed once per process


def _probe_madvise() -> bool:
    if _mode.mode() != _mode.AUTO or not hasattr(mmap.mmap, "madvise"):
        return False
    try:
        probe = mmap.mmap(-1, PAGE)
        try:
            probe.madvise(MADV_POPULATE_WRITE, 0, PAGE)
            return True
        finally:
            probe.close()
    except (OSError, ValueError):
        return False


def populate_method() -> str:
    """How this process populates segments: ``"madvise"`` (MADV_POPULATE_WRITE), ``"fallocate"``
    (posix_fallocate + MAP_POPULATE, Linux before 5.14) or ``"touch"`` (a byte written per page:
    macOS, the portable mode). Probed once on a one-page mapping."""
    global _method
    if _method is None:
        if _probe_madvise():
            _method = "madvise"
        elif _mode.mode() == _mode.AUTO and hasattr(os, "posix_fallocate") and hasattr(mmap, "MAP_POPULATE"):
            _method = "fallocate"
        else:
            _method = "touch"
    return _method


def _ask_huge_pages(mm: mmap.mmap) -> None:
    """Ask for 2 MiB pages (one fault instead of 512) where the administrator lets shared memory
    have them (``shmem_enabled`` "advise"/"within_size"); a no-op under the common "never"."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and len(mm) >= 2 * SLAB:
        try:
            mm.madvise(advice)
        except OSError:
            pass


_PARALLEL_MIN = 64 << 20  # below this one thread populates (thread start-up is not worth it)
_libc_madvise = None


def _madvise_fn():
    """libc's madvise through ctypes, which releases the GIL (mmap.madvise does not)."""
    global _libc_madvise
    if _libc_madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _libc_madvise = fn
    return _libc_madvise


def addr(mm: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    c = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _in_parts(length: int, work) -> list:
    """Run ``work(off, n)`` over ``[0, length)`` split into one part per core (at most 4) from
    64 MiB on; returns the errors the parts reported."""
    parts = min(_procinfo.cpu_count(), 4) if length >= _PARALLEL_MIN else 1
    step = -(-length // parts // PAGE) * PAGE
    errors: list = []

    def run(off: int, n: int) -> None:
        try:
            work(off, n)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)

    chunks = [(off, min(step, length - off)) for off in range(0, length, step)]
    threads = [threading.Thread(target=run, args=c, name="jaxtransport-shm-populate", daemon=True) for c in chunks[1:]]
    for t in threads:
        t.start()
    run(*chunks[0])
    for t in threads:
        t.join()
    return errors


def populate(mm: mmap.mmap, start: int, length: int) -> None:
    """Allocate and map the pages of ``mm[start:start + length]`` (MADV_POPULATE_WRITE): a page
    the system cannot provide is a ShmCapacityError here, where a plain write would SIGBUS.
    From 64 MiB on, up to 4 threads (one per core) populate a part each: on 2 cores this was
    ~15% faster than one thread when the machine was not saturated."""
    if length <= 0:
        return
    if length < _PARALLEL_MIN:
        try:
            mm.madvise(MADV_POPULATE_WRITE, start, length)
        except OSError as e:
            if e.errno in _NO_MEMORY:
                raise capacity_failure(length, e.strerror or str(e)) from None
            raise
        return
    madvise = _madvise_fn()
    base = addr(mm) + start

    def work(off: int, n: int) -> None:
        if madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    errors = _in_parts(length, work)
    if errors:
        err = errors[0]
        if isinstance(err, OSError) and err.errno in _NO_MEMORY:
            raise capacity_failure(length, err.strerror)
        raise err


def touch(mm: mmap.mmap, start: int, length: int) -> None:
    """Fault in the pages of ``mm[start:start + length]`` by writing one zero byte per page
    (the segment is fresh: its bytes are zero already), in parts from 64 MiB on."""
    if length <= 0:
        return
    import numpy as np

    views = [np.frombuffer(mm, np.uint8, count=length, offset=start)]

    def work(off: int, n: int) -> None:
        views[0][off : off + n : PAGE] = 0

    try:
        errors = _in_parts(length, work)
    finally:
        views.clear()  # no export of the mapping may outlive this call (mm.close would fail)
    if errors:
        raise errors[0]


def _map_and_populate(fd: int, size: int, start: int = 0) -> mmap.mmap:
    """Map ``fd`` (already ``size`` bytes long) with every page of ``[start, size)`` allocated
    (Note [how a segment gets its pages]); pages before ``start`` exist already and fault in on
    access. Raises ShmCapacityError when the memory is not there."""
    method = populate_method()
    if method == "madvise":
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        try:
            _ask_huge_pages(mm)
            populate(mm, start, size - start)
        except BaseException:
            mm.close()
            raise
        return mm
    if method == "fallocate":
        try:
            if size > start:
                os.posix_fallocate(fd, start, size - start)
        except OSError as e:
            if e.errno in _NO_MEMORY:
                raise capacity_failure(size - start, e.strerror) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        touch(mm, start, size - start)
    except BaseException:
        mm.close()
        raise
    return mm


# -- making and growing


def _new_fd() -> int:
    kind = segment_kind()
    if kind == "memfd":
        return os.memfd_create("jaxtransport", os.MFD_CLOEXEC)  # private to this process tree, 0600
    if kind == "posix":
        import secrets  # here, not at the top: it loads OpenSSL (hashlib), which memfd hosts never need

        shm = _posixshmem()
        for _ in range(16):
            name = NAME_PREFIX + secrets.token_hex(8)
            try:
                fd = shm.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            try:
                shm.shm_unlink(name)  # no name outlives this line (Note [segment kinds])
            except BaseException:
                os.close(fd)
                raise
            os.set_inheritable(fd, False)
            return fd
        raise FileExistsError(errno.EEXIST, "no free shared-memory name after 16 tries")
    raise ShmCapacityError(
        "jaxtransport has no shared memory on this host (no memfd_create, no shm_open with fd "
        "passing, or JAXTRANSPORT_PLATFORM=inband): arrays travel inside the pickles instead."
    )


def create_segment(size: int) -> tuple[int, mmap.mmap]:
    """A new segment of ``size`` bytes (Note [segment kinds]), mapped with every page allocated
    (Note [how a segment gets its pages]).

    Cost: one page fault per fresh 4 KiB page (~1-1.5 s/GiB on a small VM), paid once per
    segment. Raises ShmCapacityError when the system cannot provide it (never a later SIGBUS
    on the Linux paths).
    """
    fd = _new_fd()
    try:
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            if e.errno in _NO_MEMORY:
                raise capacity_failure(size, e.strerror) from None
            raise
        mm = _map_and_populate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def can_grow() -> bool:
    """Whether segments may grow in place (memfd: yes; POSIX shm: sized once, as macOS wants)."""
    return segment_kind() == "memfd"


def grow_segment(fd: int, old_size: int, size: int) -> mmap.mmap:
    """Extend the segment ``fd`` from ``old_size`` to ``size`` bytes and map all of it; only
    the new tail gets fresh pages (only where :func:`can_grow`). The caller unmaps its old
    mapping. Raises ShmCapacityError (the file is shrunk back) when the tail cannot be had."""
    os.ftruncate(fd, size)
    try:
        return _map_and_populate(fd, size, start=old_size)
    except BaseException:
        try:
            os.ftruncate(fd, old_size)
        except OSError:
            pass
        raise
