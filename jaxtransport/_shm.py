"""Shared memory for jaxtransport.Pool: recycled memfd segments, handles, fd passing, lifetime.

Note [shared memory design]
Every process that *sends* arrays owns an :class:`Arena` (the parent for task arguments and
shared trees, each worker for its results). An arena is a set of ``memfd_create`` segments cut
into slots of a few size classes (quarter-octave steps, so at most 25% slack). A new segment's
pages are allocated up front (``MADV_POPULATE_WRITE``, or ``posix_fallocate`` + ``MAP_POPULATE``
on older kernels; Note [how a segment gets its pages]): a full system raises
:class:`ShmCapacityError` there, never a SIGBUS later. Freed slots go back to a per-class free list
and are reused, so steady-state transfers of similar sizes touch no fresh pages.

A memfd has no name in ``/dev/shm``: nothing can leak when any process dies, and Docker's 64 MiB
``/dev/shm`` does not bound it. A segment's fd travels once per receiver over a ``SOCK_SEQPACKET``
Unix socket (SCM_RIGHTS, :func:`send_segment` / :meth:`Mapper._drain`); the receiver maps it once
(pages fault in as it reads them) and keeps the mapping. Only a small handle ``(segment id, offset, nbytes,
generation)`` travels with each message; :meth:`Mapper.holder` validates it.

Note [slot lifetime]
A slot's references are counted per *borrower* (a queued task, a worker, a shared tree, the
sender itself). The receiver wraps each received slot in a fresh per-transfer *holder* (a ctypes
array exported from the mapping) and gives the codec ``np.frombuffer(holder)``: every numpy view
and the jax.Array that ``device_put`` makes from it (which aliases it on CPU and keeps the ndarray
alive, jax-ml/jax#37830) keep the holder alive, because a non-ndarray exporter ends numpy's base
chain. A ``weakref.finalize`` on the holder queues a "release" for the sender, which frees the
slot when the borrower's count drops to zero. So a slot is recycled only when the last array (or
numpy view) over it is gone, and never handed out twice while held; a dead borrower's counts are
dropped at once (:meth:`Arena.release_all`). Generations reject stale or doubled releases.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import numpy as np

from . import _lockorder
from ._errors import ShmCapacityError, ShmHandleError

__all__ = [
    "Arena",
    "Handle",
    "Mapper",
    "default_capacity",
    "fd_socketpair",
    "format_bytes",
    "send_segment",
    "size_class",
]

PAGE = mmap.PAGESIZE
ALIGN = 64
SLAB = 2 << 20  # size classes below this share a segment of this size
# The default shm_threshold of Pool, Queue and Pipe: arrays of at least this many bytes travel
# through shared memory, smaller ones inside the pickle.
DEFAULT_SHM_THRESHOLD = 1 << 20
_MIN_CLASS = 4096
_FD_MSG = struct.Struct("<QQ")  # segment id, segment size


class Handle(NamedTuple):
    """A slot of a sender's arena: segment id, offset and length in it, and the slot's
    generation (a stale or doubled release names an old generation and is ignored). Travels as
    a plain tuple; :meth:`parse` validates one that arrived."""

    seg: int
    offset: int
    nbytes: int
    gen: int

    @classmethod
    def parse(cls, v: Any, what: str = "handle") -> Handle:
        """``v`` as a Handle; ShmHandleError (a CorruptTransferError's sibling: only the task
        that carried it fails) unless it is four non-negative ints."""
        if type(v) is cls:
            return v
        if isinstance(v, tuple) and len(v) == 4 and all(type(x) is int and x >= 0 for x in v):
            return cls(*v)
        raise ShmHandleError(
            f"Bad shared-memory handle {v!r} in a {what}: expected (segment, offset, nbytes, "
            "generation), four non-negative ints. The message is corrupt; only its task fails."
        )


def size_class(nbytes: int) -> int:
    """The slot size serving ``nbytes``: the next m * 2**k (m in 4..7), page-rounded."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    k = max(nbytes.bit_length() - 3, 0)
    m = -(-nbytes // (1 << k))  # ceil; 4 <= m <= 8
    cls = m << k
    return -(-cls // PAGE) * PAGE


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_free() -> int | None:
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) > 1 << 60:
                return None
            with open(usage_path) as f:
                return max(int(raw) - int(f.read().strip()), 0)
        except (OSError, ValueError):
            continue
    return None


def free_memory() -> int:
    """Bytes this process could still allocate: MemAvailable, bounded by the cgroup limit."""
    avail = _meminfo().get("MemAvailable", 8 << 30)
    cg = _cgroup_free()
    return min(avail, cg) if cg is not None else avail


MIN_CAPACITY = 256 << 20


def default_capacity(share: float = 1.0) -> int:
    """Default cap on one sender's recycled shared memory: ``share`` of half the free memory
    (the budget of a whole pool: its senders split it), at least MIN_CAPACITY."""
    return max(int(free_memory() // 2 * share), MIN_CAPACITY)


def format_bytes(n: float) -> str:
    """``n`` bytes for an error message: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# Note [how a segment gets its pages]
# A new segment's pages are allocated and mapped on the sending thread before any byte is copied:
# ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) does both in one pass and, unlike MAP_POPULATE,
# reports a page it cannot get as an error (ENOMEM/EFAULT) instead of leaving a SIGBUS for the
# first write, so a full system is a ShmCapacityError here. Older kernels get the previous path:
# ``posix_fallocate`` (the reservation) then ``mmap(MAP_POPULATE)``. Measured on a 2-core VM
# (1 GiB, medians of noisy runs): fallocate + MAP_POPULATE + copy 1.4-1.9 s; POPULATE_WRITE +
# copy 1.1-1.8 s; no population, the copy faulting the pages 1.4-1.6 s (and without fallocate
# that would be a SIGBUS on a full system); the copy split across two threads 2.4-4.3 s (page
# faults on one file contend), and so was populating 8 MiB ahead of the copy in a helper thread;
# population alone split across two threads was ~15% faster than one at 256 MiB and 1 GiB when
# the machine was not saturated (and no better when it was), so large segments do that.
# Every fresh 4 KiB page costs one fault (shmem gets transparent huge pages only where
# /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them: segments ask with
# MADV_HUGEPAGE, which the common "never" ignores), so the arena avoids fresh pages: slots are
# recycled, a smaller array may take a free slot of up to twice its size class, a larger one
# grows a wholly free segment in place (only the new tail is fresh), and Pool(shm_reserve=...)
# makes segments in background threads while the workers start.
# Receivers map segments without populating: their page-table entries fill on first access
# (read faults map 16 pages at a time) and the pages already exist, so that cannot SIGBUS.

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_populate_write_ok: bool | None = None  # probed once per process


def populate_method() -> str:
    """How this process makes segments: "madvise" (MADV_POPULATE_WRITE) or "fallocate"
    (posix_fallocate + MAP_POPULATE, kernels before 5.14). Probed once on a one-page mapping."""
    global _populate_write_ok
    if _populate_write_ok is None:
        ok = False
        if hasattr(mmap.mmap, "madvise"):
            try:
                probe = mmap.mmap(-1, PAGE)
                try:
                    probe.madvise(MADV_POPULATE_WRITE, 0, PAGE)
                    ok = True
                finally:
                    probe.close()
            except (OSError, ValueError):
                ok = False
        _populate_write_ok = ok
    return "madvise" if _populate_write_ok else "fallocate"


def _capacity_failure(size: int, why: str | None) -> ShmCapacityError:
    free = free_memory()
    return ShmCapacityError(
        f"jaxtransport.Pool could not reserve {format_bytes(size)} ({size} bytes) of shared "
        f"memory: the system has about {format_bytes(free)} ({free} bytes) free ({why}). "
        "Fixes: send smaller arrays or fewer at once (drop results you no longer need, "
        "release() SharedTrees), lower shm_capacity or shm_reserve so the pool waits instead, "
        "or give the container more memory (docker --memory / --shm-size)."
    )


_NO_MEMORY = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EFAULT)


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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        return os.cpu_count() or 1


def populate(mm: mmap.mmap, start: int, length: int) -> None:
    """Allocate and map the pages of ``mm[start:start + length]`` (MADV_POPULATE_WRITE): a page
    the system cannot provide is a ShmCapacityError here, where a plain write would SIGBUS.
    From 64 MiB on, up to 4 threads (one per core) populate a part each: on 2 cores this was
    ~15% faster than one thread when the machine was not saturated."""
    if length <= 0:
        return
    parts = min(_cores(), 4) if length >= _PARALLEL_MIN else 1
    if parts <= 1:
        try:
            mm.madvise(MADV_POPULATE_WRITE, start, length)
        except OSError as e:
            if e.errno in _NO_MEMORY:
                raise _capacity_failure(length, e.strerror or str(e)) from None
            raise
        return
    madvise = _madvise_fn()
    base = _addr(mm) + start
    step = -(-length // parts // PAGE) * PAGE
    errors: list[int] = []

    def run(off: int, n: int) -> None:
        if madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    chunks = [(off, min(step, length - off)) for off in range(0, length, step)]
    threads = [threading.Thread(target=run, args=c, name="jaxtransport-shm-populate", daemon=True) for c in chunks[1:]]
    for t in threads:
        t.start()
    run(*chunks[0])
    for t in threads:
        t.join()
    if errors:
        err = errors[0]
        if err in _NO_MEMORY:
            raise _capacity_failure(length, os.strerror(err))
        raise OSError(err, os.strerror(err))


def _map_and_populate(fd: int, size: int, start: int = 0) -> mmap.mmap:
    """Map ``fd`` (already ``size`` bytes long) with every page of ``[start, size)`` allocated
    (Note [how a segment gets its pages]); pages before ``start`` exist already and fault in on
    access. Raises ShmCapacityError when the memory is not there."""
    if populate_method() == "madvise":
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        try:
            _ask_huge_pages(mm)
            populate(mm, start, size - start)
        except BaseException:
            mm.close()
            raise
        return mm
    try:
        if size > start:
            os.posix_fallocate(fd, start, size - start)
    except OSError as e:
        if e.errno in _NO_MEMORY:
            raise _capacity_failure(size - start, e.strerror) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def create_segment(size: int) -> tuple[int, mmap.mmap]:
    """A new memfd of ``size`` bytes, mapped with every page allocated (Note [how a segment gets
    its pages]).

    Cost: one page fault per fresh 4 KiB page (~1-1.5 s/GiB on a small VM), paid once per
    segment. Raises ShmCapacityError when the system cannot provide it (never a later SIGBUS).
    """
    if not hasattr(os, "memfd_create"):  # pragma: no cover - Linux always has it
        raise ShmCapacityError(
            "jaxtransport.Pool needs os.memfd_create (Linux >= 3.17) for its shared memory; this "
            "platform lacks it. Use multiprocessing.Pool or jaxtransport.dumps/loads instead."
        )
    fd = os.memfd_create("jaxtransport", os.MFD_CLOEXEC)  # private to this process tree, 0600
    try:
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            if e.errno in _NO_MEMORY:
                raise _capacity_failure(size, e.strerror) from None
            raise
        mm = _map_and_populate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def grow_segment(fd: int, old_size: int, size: int) -> mmap.mmap:
    """Extend the memfd ``fd`` from ``old_size`` to ``size`` bytes and map all of it; only the
    new tail gets fresh pages. The caller unmaps its old mapping. Raises ShmCapacityError (the
    file is shrunk back) when the tail cannot be had."""
    os.ftruncate(fd, size)
    try:
        return _map_and_populate(fd, size, start=old_size)
    except BaseException:
        try:
            os.ftruncate(fd, old_size)
        except OSError:
            pass
        raise


def fd_socketpair() -> tuple[socket.socket, socket.socket]:
    """A pair of connected Unix SOCK_SEQPACKET sockets for passing segment fds."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_segment(sock: socket.socket, seg_id: int, size: int, fd: int) -> None:
    """Pass one segment's fd to the peer (SCM_RIGHTS). Raises OSError if the peer is gone."""
    socket.send_fds(sock, [_FD_MSG.pack(seg_id, size)], [fd])


def _addr(mm: mmap.mmap) -> int:
    c = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(c)
    finally:
        del c


# --------------------------------------------------------------------------------------------
# Sender side


class _Seg:
    __slots__ = ("addr", "cls", "fd", "free_count", "mm", "nslots", "seg_id", "size")

    def __init__(self, seg_id, size, fd, mm, cls, nslots):
        self.seg_id, self.size, self.fd, self.mm = seg_id, size, fd, mm
        self.cls, self.nslots, self.free_count = cls, nslots, nslots
        self.addr = _addr(mm)


class _Slot:
    __slots__ = ("gen", "refs")

    def __init__(self):
        self.gen = 0
        self.refs: dict[Hashable, int] = {}


class Arena:
    """The recycled shared memory a process sends from. Thread-safe.

    ``alloc`` hands out a slot with one reference held by ``borrower``; ``transfer``, ``lend``,
    ``acquire`` and ``release`` move and count references (Note [slot lifetime]); a slot whose
    count reaches zero returns to its free list. Segments are created on demand up to
    ``capacity`` bytes in all; when that would be exceeded, wholly free segments of other sizes
    are unmapped first (their ids are queued for ``take_forgotten`` so receivers unmap them too),
    then ``alloc`` waits for releases as long as ``wait`` says progress is possible, then raises
    ShmCapacityError.
    """

    def __init__(self, capacity: int | None = None, label: str = "this process"):
        self.capacity = int(capacity) if capacity else default_capacity()
        self.label = label
        self.cond = _lockorder.condition("Arena.cond")
        self._segs: dict[int, _Seg] = {}
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._free: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        self._next_id = 1
        self.mapped = 0  # bytes of all segments
        self._forgotten: list[int] = []
        self._deferred: collections.deque = collections.deque()  # (handle, borrower) to release
        self.closed = False
        self.segments_created = 0
        self.segments_grown = 0
        self._pending = 0  # bytes of reservations being made (reserve()), counted in capacity
        self._pending_cls: collections.Counter = collections.Counter()
        self.reserve_error: BaseException | None = None
        self._frees = 0  # slots freed so far (a waiting alloc sees a release it did not wait for)

    # -- inspection
    def segment(self, seg_id: int) -> _Seg | None:
        return self._segs.get(seg_id)

    @property
    def last_segment_id(self) -> int:
        """The newest segment id ever made (0: none). Ids are never reused, so this only grows
        (unlike ``segments_created``, which a growth leaves unchanged)."""
        return self._next_id - 1

    def segments(self) -> list[_Seg]:
        with self.cond:
            return list(self._segs.values())

    def in_use(self) -> int:
        with self.cond:
            self._apply_deferred()
            return sum(self._segs[k[0]].cls for k, s in self._slots.items() if s.refs)

    def held_by(self, borrower: Hashable) -> int:
        with self.cond:
            return sum(s.refs.get(borrower, 0) for s in self._slots.values())

    def take_forgotten(self) -> list[int]:
        """Ids of segments this arena unmapped since the last call (receivers may unmap them)."""
        with self.cond:
            out, self._forgotten = self._forgotten, []
            return out

    def has_forgotten(self) -> bool:
        return bool(self._forgotten)

    def defer_release(self, handle: Handle, borrower: Hashable) -> None:
        """Queue ``release(handle, borrower)`` for the next time the arena is used. Safe from a
        weakref finalizer in any thread, even one that holds ``cond`` (an atomic append)."""
        self._deferred.append((handle, borrower))
        # A waiting alloc re-checks every few ms (see alloc); nothing else to wake here.

    def _apply_deferred(self) -> None:
        # Called with cond held.
        pop = self._deferred.popleft
        while self._deferred:
            try:
                handle, borrower = pop()
            except IndexError:
                return
            self._release_locked(handle, borrower, 1)

    # -- allocation
    def _new_segment(self, cls: int) -> None:
        nslots = max(1, SLAB // cls)
        fd, mm = create_segment(cls * nslots)
        self._install(cls, fd, mm)

    def _install(self, cls: int, fd: int, mm: mmap.mmap) -> None:
        nslots = max(1, SLAB // cls)
        size = cls * nslots
        seg_id = self._next_id
        self._next_id += 1
        seg = _Seg(seg_id, size, fd, mm, cls, nslots)
        self._segs[seg_id] = seg
        self.mapped += size
        self.segments_created += 1
        free = self._free[cls]
        for i in reversed(range(nslots)):
            self._slots[(seg_id, i * cls)] = _Slot()
            free.append((seg_id, i * cls))

    def _larger_free(self, cls: int) -> tuple[int, int] | None:
        """A free slot of the smallest class in ``(cls, 2 * cls]`` for a large class (one slot
        per segment): a slightly smaller array reuses touched memory instead of fresh pages."""
        if cls < SLAB:
            return None
        best = None
        for c, keys in self._free.items():
            if keys and cls < c <= 2 * cls and (best is None or c < best):
                best = c
        return self._free[best].pop() if best is not None else None

    def _pending_for(self, cls: int) -> bool:
        return any(n and (c == cls or (cls >= SLAB and cls < c <= 2 * cls)) for c, n in self._pending_cls.items())

    def _grow_one(self, cls: int) -> bool:
        """Grow the largest wholly free one-slot segment smaller than ``cls`` into a segment of
        class ``cls`` under a new id (receivers forget the old id): only the tail is fresh
        memory. False when there is none or the growth does not fit the capacity."""
        if cls < SLAB:
            return False
        best = None
        for seg in self._segs.values():
            if (
                seg.nslots == 1
                and seg.free_count == 1
                and SLAB <= seg.cls < cls
                and (best is None or seg.cls > best.cls)
            ):
                best = seg
        if best is None or self.mapped + self._pending + cls - best.size > self.capacity:
            return False
        fd, old_size = best.fd, best.size
        best.fd = None  # keep the file: _drop_segment closes only the old mapping
        try:
            mm = grow_segment(fd, old_size, cls)
        except BaseException:
            best.fd = fd
            raise
        self._drop_segment(best)
        self._install(cls, fd, mm)
        self.segments_created -= 1
        self.segments_grown += 1
        return True

    def reserve(self, nbytes: int, what: str = "shm_reserve") -> threading.Thread | None:
        """Make a segment serving arrays of up to ``nbytes`` in a background thread (pages
        allocated there, Note [how a segment gets its pages]), so the first transfer of that
        size pays no page faults. ``alloc`` calls that need this class wait for it rather than
        make another. A failure is kept in ``reserve_error`` and raised by the next ``alloc``.
        Raises ShmCapacityError at once when ``nbytes`` does not fit the capacity."""
        if nbytes <= 0:
            return None
        cls = size_class(nbytes)
        seg_size = cls * max(1, SLAB // cls)
        with self.cond:
            if self.mapped + self._pending + seg_size > self.capacity:
                raise ShmCapacityError(
                    f"{what}={nbytes} ({format_bytes(nbytes)}) does not fit the shared-memory cap of "
                    f"{self.label}: shm_capacity={self.capacity} ({format_bytes(self.capacity)}); a slot "
                    f"for it takes {format_bytes(seg_size)}. Lower {what} or raise shm_capacity."
                )
            self._pending += seg_size
            self._pending_cls[cls] += 1

        def work():
            made, err = None, None
            try:
                made = create_segment(seg_size)
            except BaseException as e:  # noqa: BLE001 - handed to the next alloc
                err = e
                if isinstance(e, ShmCapacityError):
                    err = ShmCapacityError(f"{what}={nbytes} could not be reserved in {self.label}: {e}")
            with self.cond:
                self._pending -= seg_size
                self._pending_cls[cls] -= 1
                if made is not None and not self.closed:
                    self._install(cls, *made)
                elif made is not None:
                    os.close(made[0])
                    made[1].close()
                else:
                    self.reserve_error = err
                self.cond.notify_all()

        t = threading.Thread(target=work, name="jaxtransport-shm-reserve", daemon=True)
        t.start()
        return t

    def _evict_one(self, keep_cls: int) -> bool:
        for seg in list(self._segs.values()):
            if seg.free_count == seg.nslots and seg.cls != keep_cls:
                self._drop_segment(seg)
                return True
        for seg in list(self._segs.values()):
            if seg.free_count == seg.nslots:
                self._drop_segment(seg)
                return True
        return False

    def _drop_segment(self, seg: _Seg) -> None:
        del self._segs[seg.seg_id]
        self._free[seg.cls] = [k for k in self._free[seg.cls] if k[0] != seg.seg_id]
        for i in range(seg.nslots):
            self._slots.pop((seg.seg_id, i * seg.cls), None)
        self.mapped -= seg.size
        self._forgotten.append(seg.seg_id)
        _close_quietly(seg)

    def alloc(self, nbytes: int, borrower: Hashable, wait: Callable[[], Any] | None = None):
        """A slot of at least ``nbytes``: returns ``(handle, writable uint8 ndarray of nbytes)``.

        Costs nothing but bookkeeping when a free slot of the class exists; else one new
        segment (fresh pages) within the cap; else waits (see class docstring).

        ``wait()`` is the caller's wait hook, asked each time no slot can be had: None or False
        to give up (ShmCapacityError), True to look again at once (the hook waited itself), or
        seconds to wait for a release before looking again.

        Note [no call out under Arena.cond]
        The hook runs with ``cond`` released: it belongs to another component (the pool
        engine's takes the engine's lock; a worker's reads its pipe), and calling it with
        ``cond`` held made the order ``Arena.cond -> Engine.lock`` while dispatch takes
        ``Engine.lock -> Arena.cond``: three threads submitting at the memory cap deadlocked.
        Nothing outside this class is called with ``cond`` held; a release that lands while
        the hook runs is seen through ``_frees`` (no wait then).
        """
        cls = size_class(nbytes)
        seg_size = cls * max(1, SLAB // cls)
        with self.cond:
            while True:
                if self.closed:
                    raise ShmCapacityError(f"the shared memory of {self.label} was closed")
                if self.reserve_error is not None:
                    err, self.reserve_error = self.reserve_error, None
                    raise err
                if self._deferred:
                    self._apply_deferred()
                free = self._free.get(cls)
                if free:
                    key = free.pop()
                    break
                key = self._larger_free(cls)  # type: ignore[assignment]
                if key is not None:
                    break
                if self._pending_for(cls):
                    self.cond.wait()  # reserve() is making it; it notifies when done
                    continue
                if self._grow_one(cls):
                    continue
                if self.mapped + self._pending + seg_size <= self.capacity:
                    self._new_segment(cls)
                    continue
                if self._evict_one(cls):
                    continue
                if seg_size > self.capacity:
                    raise self._capacity_error(nbytes, seg_size, impossible=True)
                if wait is None:
                    raise self._capacity_error(nbytes, seg_size)
                # Note [no call out under Arena.cond]: the hook runs with the lock released.
                frees = self._frees
                self.cond.release()
                try:
                    pause = wait()
                finally:
                    self.cond.acquire()
                if pause is None or pause is False:
                    raise self._capacity_error(nbytes, seg_size)
                if pause is not True and pause > 0 and self._frees == frees and not self._deferred:
                    self.cond.wait(pause)
            seg = self._segs[key[0]]
            seg.free_count -= 1
            slot = self._slots[key]
            slot.gen += 1
            slot.refs = {borrower: 1}
            handle = Handle(key[0], key[1], nbytes, slot.gen)
        view = np.frombuffer(seg.mm, np.uint8, count=nbytes, offset=key[1])
        return handle, view

    def _capacity_error(self, nbytes: int, seg_size: int, impossible: bool = False) -> ShmCapacityError:
        held = sum(self._segs[k[0]].cls for k, s in self._slots.items() if s.refs)
        if impossible:
            why = (
                f"a single array of {format_bytes(nbytes)} is larger than "
                f"shm_capacity={self.capacity} ({format_bytes(self.capacity)})"
            )
        else:
            why = (
                f"shm_capacity={self.capacity} ({format_bytes(self.capacity)}) is reached: "
                f"{format_bytes(held)} are held by "
                "arrays the receivers still keep alive (results you have not dropped, SharedTrees not "
                f"released, arrays a worker keeps; holders: {self._holders()}) and no release came in time"
            )
        return ShmCapacityError(
            f"jaxtransport.Pool could not get {format_bytes(nbytes)} ({nbytes} bytes) of shared memory "
            f"in {self.label}: "
            f"{why}; {format_bytes(self.mapped)} mapped, about {format_bytes(free_memory())} free on the system. "
            "Fixes: drop received arrays you no longer need, call SharedTree.release(), raise "
            "Pool(shm_capacity=...), or raise shm_threshold so smaller arrays travel inline."
        )

    def _holders(self) -> str:
        """Lock held: who holds the live slots, largest first (for the capacity error)."""
        by: dict[str, list[int]] = {}
        for k, s in self._slots.items():
            for b in s.refs:
                name = " ".join(map(str, b)) if isinstance(b, tuple) else str(b)
                n = by.setdefault(name, [0, 0])
                n[0] += 1
                n[1] += self._segs[k[0]].cls
        top = sorted(by.items(), key=lambda kv: -kv[1][1])
        text = ", ".join(f"{name}: {n} slot{'s' * (n != 1)} ({format_bytes(b)})" for name, (n, b) in top[:6])
        return text + (f" and {len(top) - 6} more" if len(top) > 6 else "") if top else "none"

    # -- reference counting (Note [slot lifetime])
    def _slot(self, handle: Handle) -> _Slot | None:
        if type(handle) is not Handle:  # a plain tuple, as handles travel
            try:
                handle = Handle._make(handle)
            except TypeError:
                return None
        try:
            slot = self._slots.get((handle.seg, handle.offset))
        except TypeError:
            return None
        if slot is None or slot.gen != handle.gen or not slot.refs:
            return None
        return slot

    def _free_slot(self, handle: Handle, slot: _Slot) -> None:
        seg = self._segs[handle.seg]
        seg.free_count += 1
        self._free[seg.cls].append((handle.seg, handle.offset))
        self._frees += 1
        self.cond.notify_all()

    def release(self, handle: Handle, borrower: Hashable, count: int = 1) -> bool:
        """Drop ``count`` references of ``borrower``; False (ignored) for stale/unknown ones."""
        with self.cond:
            if self._deferred:
                self._apply_deferred()
            return self._release_locked(handle, borrower, count)

    def _release_locked(self, handle: Handle, borrower: Hashable, count: int) -> bool:
        slot = self._slot(handle)
        if slot is None or borrower not in slot.refs:
            return False
        left = slot.refs[borrower] - count
        if left > 0:
            slot.refs[borrower] = left
        else:
            del slot.refs[borrower]
            if not slot.refs:
                self._free_slot(handle, slot)
        return True

    def release_many(self, handles, borrower: Hashable) -> None:
        for h in handles:
            self.release(h, borrower)

    def release_all(self, borrower: Hashable) -> int:
        """Drop every reference ``borrower`` holds (a dead worker, a finished shared tree)."""
        n = 0
        with self.cond:
            for key, slot in self._slots.items():
                c = slot.refs.pop(borrower, 0)
                if c:
                    n += c
                    if not slot.refs:
                        self._free_slot(Handle(key[0], key[1], 0, slot.gen), slot)
        return n

    def acquire(self, handle: Handle, borrower: Hashable) -> bool:
        """Add a reference for ``borrower`` to a live slot; False if the slot is not live."""
        with self.cond:
            slot = self._slot(handle)
            if slot is None:
                return False
            slot.refs[borrower] = slot.refs.get(borrower, 0) + 1
            return True

    def transfer(self, handles, src: Hashable, dst: Hashable) -> None:
        if not handles:
            return
        with self.cond:
            for h in handles:
                slot = self._slot(h)
                if slot is None or src not in slot.refs:
                    continue
                slot.refs[src] -= 1
                if not slot.refs[src]:
                    del slot.refs[src]
                slot.refs[dst] = slot.refs.get(dst, 0) + 1

    def lend(self, handles, borrower: Hashable) -> None:
        with self.cond:
            for h in handles:
                slot = self._slot(h)
                if slot is not None:
                    slot.refs[borrower] = slot.refs.get(borrower, 0) + 1

    def view(self, handle: Handle) -> tuple[_Seg, int, int]:
        seg = self._segs.get(handle.seg)
        if seg is None:
            raise ShmHandleError(f"segment {handle.seg} of {self.label} does not exist (freed or never made)")
        return seg, handle.offset, handle.nbytes

    def close(self) -> None:
        """Close every fd and drop every mapping. Memory stays valid for arrays still aliasing it
        (their mapping lives until they die); receivers keep theirs until they unmap."""
        with self.cond:
            self.closed = True
            segs = list(self._segs.values())
            self._segs.clear()
            self._slots.clear()
            self._free.clear()
            self.mapped = 0
            self.cond.notify_all()
        for seg in segs:
            _close_quietly(seg)


def _close_quietly(seg) -> None:
    if seg.fd is not None:
        try:
            os.close(seg.fd)
        except OSError:
            pass
        seg.fd = None
    mm = seg.mm
    seg.mm = None
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # arrays still alias it: the mapping goes when they do


# --------------------------------------------------------------------------------------------
# Receiver side


class _Mapped:
    __slots__ = ("addr", "fd", "mm", "size")

    def __init__(self, size, fd):
        self.size, self.fd, self.mm, self.addr = size, fd, None, 0


def collect_deferred() -> None:
    """Run jaxlib's deferred Python decrefs now.

    ``device_put`` drops its reference to a host buffer from a runtime thread, which jaxlib
    queues until the next JAX call or ``gc.collect()``: without this a dead array's slot could
    stay held while the process sits idle. Cheap; does nothing when JAX is not imported.
    """
    from ._nojax import jax_loaded

    if not jax_loaded():
        return
    from ._compat import collect_jax_garbage  # jaxlib's private hook, probed there

    collect_jax_garbage()


def _on_holder_dead(pending, registry, addr, release) -> None:
    # Runs from a weakref finalizer, possibly in any thread: atomic operations only.
    registry.pop(addr, None)
    pending.append(release)


class Mapper:
    """A receiver's view of one sender's segments. Not thread-safe: one thread receives.

    ``holder(handle)`` validates a handle and returns a fresh per-transfer holder object over
    the slot; when the holder (and every array over it) dies, the handle is queued in
    ``pending`` for the sender (``take_releases``). ``find(addr, nbytes)`` tells whether memory at
    ``addr`` is a live received slot (so it can be sent back as a handle, not a copy).
    """

    def __init__(self, sock: socket.socket | None, label: str = "the sender", wait_fd: float = 10.0):
        self.sock = sock
        self.label = label
        self.wait_fd = wait_fd
        self.segs: dict[int, _Mapped] = {}
        self.forgotten: set[int] = set()
        self.pending: collections.deque = collections.deque()
        self.live: dict[int, Handle] = {}  # addr -> handle of a live holder

    def take_releases(self, limit: int | None = None) -> list:
        """Pop queued releases (at most ``limit``) for the sender. Safe beside another thread
        taking them too (each release goes to one of them)."""
        if self.live:
            collect_deferred()
        pending = self.pending
        n = len(pending)
        if limit is not None:
            n = min(n, limit)
        pop = pending.popleft
        out = []
        try:
            for _ in range(n):
                out.append(pop())
        except IndexError:  # another thread took some since len()
            pass
        return out

    def _drain(self, want: int | None, timeout: float) -> None:
        if self.sock is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            r, _, _ = select.select([self.sock], [], [], 0 if want is None else max(deadline - time.monotonic(), 0))
            if not r:
                return
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, _FD_MSG.size, 4)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            if not data:
                return
            seg_id, size = _FD_MSG.unpack(data)
            for extra in fds[1:]:
                os.close(extra)
            if not fds:
                continue
            if seg_id in self.forgotten:
                os.close(fds[0])
                continue
            old = self.segs.pop(seg_id, None)
            if old is not None:
                _close_quietly(old)
            self.segs[seg_id] = _Mapped(size, fds[0])
            if want is not None and seg_id == want:
                return

    def _segment(self, seg_id: int) -> _Mapped:
        m = self.segs.get(seg_id)
        if m is None and seg_id not in self.forgotten:
            self._drain(seg_id, self.wait_fd)
            m = self.segs.get(seg_id)
        if m is None:
            raise ShmHandleError(
                f"Bad shared-memory handle: segment {seg_id} of {self.label} is unknown here "
                f"({'it was freed' if seg_id in self.forgotten else 'its fd never arrived'}). "
                "The memory this task referred to no longer exists; the task cannot run."
            )
        if m.mm is None:
            # Not populated: the sender allocated every page, so first accesses only fill
            # page-table entries, and only for what this receiver reads (Note [how a segment
            # gets its pages]).
            m.mm = mmap.mmap(m.fd, m.size, flags=mmap.MAP_SHARED)
            m.addr = _addr(m.mm)
            os.close(m.fd)
            m.fd = None
        return m

    def adopt(self, seg_id: int, fd: int) -> None:
        """Take ownership of ``fd``, an fd of segment ``seg_id`` that arrived with a message
        (SCM_RIGHTS), and keep it only if this segment is new here: a known (cached) or
        forgotten segment's duplicate is closed at once, so at most one fd per segment is ever
        open, and only until the segment is first mapped. Raises ShmHandleError (fd closed) for
        something that is not a segment of a plausible size."""
        try:
            size = os.fstat(fd).st_size
        except OSError:
            size = -1
        if seg_id in self.segs or seg_id in self.forgotten or size <= 0:
            os.close(fd)
            if size <= 0:
                raise ShmHandleError(f"Bad shared-memory fd for segment {seg_id} of {self.label}: not a memory segment")
            return
        self.segs[seg_id] = _Mapped(size, fd)

    def mapping(self, seg_id: int) -> mmap.mmap:
        """The mapping of segment ``seg_id`` (mapped now if it is not yet). Raises ShmHandleError."""
        return self._segment(seg_id).mm  # type: ignore[return-value]  # mapped by _segment

    def holder(self, handle: Handle, release: Any = None):
        """A fresh ctypes array over the slot ``handle`` names. See Note [slot lifetime].

        Raises ShmHandleError for a malformed handle, an unknown segment, or a range outside it.
        """
        try:
            seg_id, offset, nbytes, gen = handle
            seg_id, offset, nbytes, gen = int(seg_id), int(offset), int(nbytes), int(gen)
        except (TypeError, ValueError):
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: expected (segment, offset, nbytes, generation)"
            ) from None
        m = self._segment(seg_id)
        if offset < 0 or nbytes < 0 or offset + nbytes > m.size or offset % ALIGN:
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: bytes [{offset}, {offset + nbytes}) are outside "
                f"segment {seg_id} of {self.label} ({m.size} bytes) or misaligned: the handle is "
                "truncated or corrupt. Only this task fails."
            )
        h = (ctypes.c_char * max(nbytes, 1)).from_buffer(m.mm, offset)  # type: ignore[arg-type]
        addr = m.addr + offset
        self.live[addr] = Handle(seg_id, offset, nbytes, gen)
        weakref.finalize(h, _on_holder_dead, self.pending, self.live, addr, handle if release is None else release)
        return h

    def find(self, addr: int, nbytes: int) -> Handle | None:
        h = self.live.get(addr)
        if h is not None and h.nbytes == nbytes:
            return h
        return None

    def forget(self, seg_ids) -> None:
        for seg_id in seg_ids:
            self.forgotten.add(seg_id)
            m = self.segs.pop(seg_id, None)
            if m is not None:
                _close_quietly(m)

    def close(self) -> None:
        """Close fds and drop mappings (arrays still aliasing a mapping keep it alive)."""
        self._drain(None, 0)
        for m in self.segs.values():
            _close_quietly(m)
        self.segs.clear()
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
