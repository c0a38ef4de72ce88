"""The sender's side: an :class:`Arena` of recycled segments, and passing a segment's fd
(Note [shared memory design], Note [slot lifetime] in ``jaxtransport._shm``)."""

from __future__ import annotations

import collections
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .. import _lockorder, _os
from .._errors import ShmCapacityError, ShmHandleError
from ._handles import SLAB, Handle, default_capacity, format_bytes, free_memory, size_class

__all__ = ["FD_MSG", "Arena", "close_quietly", "fd_socketpair", "send_segment"]

FD_MSG = struct.Struct("<QQ")  # segment id, segment size


def fd_socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix sockets for passing segment fds (Note [message framing] in
    ``_os``: SEQPACKET on Linux, a stream elsewhere)."""
    return _os.message_socketpair()


def send_segment(sock: socket.socket, seg_id: int, size: int, fd: int) -> None:
    """Pass one segment's fd to the peer (SCM_RIGHTS). Raises OSError if the peer is gone."""
    _os.send_fd(sock, FD_MSG.pack(seg_id, size), fd)


# --------------------------------------------------------------------------------------------
# Sender side


class _Seg:
    __slots__ = ("addr", "cls", "fd", "free_count", "mm", "nslots", "origin", "seg_id", "size")

    def __init__(self, seg_id, size, fd, mm, cls, nslots, origin=None):
        self.seg_id, self.size, self.fd, self.mm = seg_id, size, fd, mm
        self.cls, self.nslots, self.free_count = cls, nslots, nslots
        self.addr = _os.addr(mm) if mm is not None else 0
        self.origin = origin  # a forwarded segment: whose, and its id there (else None)


class _Slot:
    __slots__ = ("gen", "keep", "refs")

    def __init__(self):
        self.gen = 0
        self.refs: dict[Hashable, int] = {}
        self.keep: list | None = None  # a forwarded slot: what holds it live in its owner


class Arena:
    """The recycled shared memory a process sends from. Thread-safe.

    ``alloc`` hands out a slot with one reference held by ``borrower``; ``transfer``, ``lend``,
    ``acquire`` and ``release`` move and count references (Note [slot lifetime]); a slot whose
    count reaches zero returns to its free list. Segments are created on demand up to
    ``capacity`` bytes in all; when that would be exceeded, wholly free segments of other sizes
    are unmapped first (their ids are queued for ``take_forgotten`` so receivers unmap them too),
    then ``alloc`` waits for releases as long as ``wait`` says progress is possible, then raises
    ShmCapacityError.

    Note [forwarded slots]
    ``adopt`` books a live slot of *another* sender's segment (an array this process received
    and now sends on, such as a Pool result fed into the next task) as a slot of this arena: it
    gets an id of this arena's (never reused, so a receiver that forgot an earlier adoption of
    the same segment is not confused), one duplicated fd of the segment (kept while any of its
    slots is booked; sent to receivers as this arena's own segments are), and a reference count
    per borrower like any slot, so queued tasks, workers, shared trees, releases and a dead
    borrower's ``release_all`` move and drop it with no code of their own. The slot's ``keep``
    (the holder that keeps it live in its owner, as a received array does) is referenced until
    the last release; then the record and, with its last slot, the segment are dropped, and its
    id is queued for ``take_forgotten``. Forwarded segments count nothing against ``capacity``
    (their owner's cap holds them) and are never evicted, grown or allocated from.
    """

    def __init__(self, capacity: int | None = None, label: str = "this process"):
        self.capacity = int(capacity) if capacity else default_capacity()
        self.label = label
        self.cond = _lockorder.condition("Arena.cond")
        self._segs: dict[int, _Seg] = {}
        self._foreign: dict[int, _Seg] = {}  # forwarded segments (Note [forwarded slots])
        self._foreign_ids: dict[Hashable, int] = {}  # their origin -> their id here
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
        """A segment of this arena's, or a forwarded one (Note [forwarded slots])."""
        seg = self._segs.get(seg_id)
        return seg if seg is not None else self._foreign.get(seg_id)

    def _cls(self, seg_id: int) -> int:
        seg = self._segs.get(seg_id)
        return seg.cls if seg is not None else 0  # a forwarded slot counts nothing here

    @property
    def last_segment_id(self) -> int:
        """The newest segment id ever made (0: none). Ids are never reused, so this only grows
        (unlike ``segments_created``, which a growth leaves unchanged)."""
        return self._next_id - 1

    def segments(self) -> list[_Seg]:
        with self.cond:
            return list(self._segs.values())

    def segment_count(self) -> int:
        """How many segments this arena has (one read, no lock: a snapshot)."""
        return len(self._segs)

    def in_use(self) -> int:
        with self.cond:
            self._apply_deferred()
            return sum(self._cls(k[0]) for k, s in self._slots.items() if s.refs)

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

    def apply_deferred(self) -> None:
        """Apply queued ``defer_release`` calls now (cheap when none)."""
        if self._deferred:
            with self.cond:
                self._apply_deferred()

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
        fd, mm = _os.create_segment(cls * nslots)
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
        if best is None:
            return None
        # Only while little of the cap is in use: a held larger slot wastes up to half of
        # itself, and at a tight cap that waste is room the next arrays need (3 x 2 MiB at an
        # 8 MiB cap found 2 free 5 MiB slots and held 10 MiB). Making the exact class instead
        # evicts the larger free segment when room is short, so nothing that fitted stops fitting.
        in_use = sum((s.nslots - s.free_count) * s.cls for s in self._segs.values())
        if in_use + best > self.capacity // 2:
            return None
        return self._free[best].pop()

    def _pending_for(self, cls: int) -> bool:
        return any(n and (c == cls or (cls >= SLAB and cls < c <= 2 * cls)) for c, n in self._pending_cls.items())

    def _grow_one(self, cls: int) -> bool:
        """Grow the largest wholly free one-slot segment smaller than ``cls`` into a segment of
        class ``cls`` under a new id (receivers forget the old id): only the tail is fresh
        memory. False when there is none or the growth does not fit the capacity."""
        if cls < SLAB or not _os.can_grow():
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
            mm = _os.grow_segment(fd, old_size, cls)
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
                made = _os.create_segment(seg_size)
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
                self.cond.wake_all()

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
        close_quietly(seg)

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
        cond = self.cond
        # Every wait parks on ``cond`` and sleeps with it released (Note [waits a Ctrl-C cannot
        # break] in jaxtransport._lockorder): a Ctrl-C in a caller's alloc leaves it free.
        while True:
            with cond:
                key = self._find_slot(cls, nbytes, seg_size, wait is not None)
                if type(key) is tuple:
                    seg = self._segs[key[0]]
                    seg.free_count -= 1
                    slot = self._slots[key]
                    slot.gen += 1
                    slot.refs = {borrower: 1}
                    handle = Handle(key[0], key[1], nbytes, slot.gen)
                    break
                if key is _RESERVING:
                    ticket = cond.park()  # reserve() is making it; it wakes us when done
                else:
                    frees = self._frees
            if key is _RESERVING:
                _lockorder.sleep(ticket)
                continue
            # Note [no call out under Arena.cond]: the hook runs with the lock released.
            pause = wait()  # type: ignore[misc]
            with cond:
                if pause is None or pause is False:
                    raise self._capacity_error(nbytes, seg_size)
                if pause is True or pause <= 0 or self._frees != frees or self._deferred:
                    continue
                ticket = cond.park()
            if not _lockorder.sleep(ticket, pause):
                with cond:
                    cond.unpark(ticket)
        view = np.frombuffer(seg.mm, np.uint8, count=nbytes, offset=key[1])
        return handle, view

    def _find_slot(self, cls: int, nbytes: int, seg_size: int, may_wait: bool) -> Any:
        """``cond`` held: the key of a free slot of class ``cls`` (made, grown or evicted for
        if need be), or ``_RESERVING`` (a reservation of that class is being made: wait for
        it), or ``_FULL`` (none within the cap: ask the caller's wait hook). Raises
        ShmCapacityError when the arena is closed, a reservation failed, or nothing can ever
        fit (or nobody may wait)."""
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
                return free.pop()
            key = self._larger_free(cls)
            if key is not None:
                return key
            if self._pending_for(cls):
                return _RESERVING
            if self._grow_one(cls):
                continue
            if self.mapped + self._pending + seg_size <= self.capacity:
                self._new_segment(cls)
                continue
            if self._evict_one(cls):
                continue
            if seg_size > self.capacity:
                raise self._capacity_error(nbytes, seg_size, impossible=True)
            if not may_wait:
                raise self._capacity_error(nbytes, seg_size)
            return _FULL

    def _capacity_error(self, nbytes: int, seg_size: int, impossible: bool = False) -> ShmCapacityError:
        held = sum(self._cls(k[0]) for k, s in self._slots.items() if s.refs)
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
                n[1] += self._cls(k[0])
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
        if slot.keep is not None:  # forwarded (Note [forwarded slots]): its record goes
            self._drop_forwarded(handle.seg, handle.offset, slot)
            return
        seg = self._segs[handle.seg]
        seg.free_count += 1
        self._free[seg.cls].append((handle.seg, handle.offset))
        self._frees += 1
        self.cond.wake_all()

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
            for key, slot in list(self._slots.items()):  # a forwarded slot leaves it when freed
                # No loop here ends in a test (Note [loops that end in a test]).
                c = slot.refs.pop(borrower, 0)
                if not c:
                    continue
                n += c
                if slot.refs:
                    continue
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
                if slot is None:
                    continue
                slot.refs[borrower] = slot.refs.get(borrower, 0) + 1

    # -- forwarded slots (Note [forwarded slots])
    def adopt(
        self, origin: Hashable, fd: int, size: int, handle: Handle, keep: Any, borrower: Hashable
    ) -> Handle | None:
        """Book the live slot ``handle`` of another sender's segment (``origin``: a key naming
        that segment among every sender's; ``fd``, ``size``: the segment's, an fd this call
        duplicates at the segment's first slot) with one reference held by ``borrower``, and
        ``keep`` referenced until the slot's last release. Returns the slot's handle here (this
        arena's segment id), or None (copy the array instead) when the arena is closed or the fd
        cannot be duplicated or is not a segment of ``size`` bytes."""
        with self.cond:
            if self.closed:
                return None
            seg_id = self._foreign_ids.get(origin)
            if seg_id is None:
                try:
                    dup = os.dup(fd)
                except OSError:  # out of fds: copy instead
                    return None
                try:
                    ok = os.fstat(dup).st_size == size
                except OSError:
                    ok = False
                if not ok:
                    os.close(dup)
                    return None
                seg_id = self._next_id
                self._next_id += 1
                self._foreign[seg_id] = _Seg(seg_id, size, dup, None, 0, 0, origin)
                self._foreign_ids[origin] = seg_id
            seg = self._foreign[seg_id]
            key = (seg_id, handle.offset)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
                slot.gen, slot.keep = handle.gen, [keep]
                seg.nslots += 1
            elif slot.gen != handle.gen or slot.keep is None:
                return None  # cannot be while the owner's slot is held: copy, to be safe
            elif all(k is not keep for k in slot.keep):
                slot.keep.append(keep)
            slot.refs[borrower] = slot.refs.get(borrower, 0) + 1
            return Handle(seg_id, handle.offset, handle.nbytes, handle.gen)

    def _drop_forwarded(self, seg_id: int, offset: int, slot: _Slot) -> None:
        # cond held. Dropping ``keep`` may run holder finalizers: they only append to a deque.
        del self._slots[(seg_id, offset)]
        slot.keep = None
        seg = self._foreign[seg_id]
        seg.nslots -= 1
        if seg.nslots <= 0:
            del self._foreign[seg_id]
            self._foreign_ids.pop(seg.origin, None)
            self._forgotten.append(seg_id)
            close_quietly(seg)
        self.cond.wake_all()

    def mapping(self, seg_id: int) -> mmap.mmap | None:
        """The mapping of a segment of this arena's or a forwarded one (mapped now, for a
        forwarded one: a worker sent its slot back), None for an unknown id."""
        with self.cond:
            seg = self.segment(seg_id)
            if seg is None:
                return None
            if seg.mm is None and seg.fd is not None:
                seg.mm = mmap.mmap(seg.fd, seg.size, flags=mmap.MAP_SHARED)
            return seg.mm

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
            segs = list(self._segs.values()) + list(self._foreign.values())
            self._segs.clear()
            self._foreign.clear()
            self._foreign_ids.clear()
            self._slots.clear()
            self._free.clear()
            self.mapped = 0
            self.cond.wake_all()
        for seg in segs:
            close_quietly(seg)


_RESERVING = "reserving"  # _find_slot: a reservation of the class is being made
_FULL = "full"  # _find_slot: nothing free within the cap


def close_quietly(seg) -> None:
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
