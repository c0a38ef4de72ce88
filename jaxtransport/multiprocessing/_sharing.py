"""How a message of ``jaxtransport.multiprocessing`` travels: one packet, its fds, shared memory.

Note [queue messages]
A message is exactly one ``SOCK_SEQPACKET`` packet on a Unix socket, carrying the segment fds it
refers to as SCM_RIGHTS ancillary data. One packet is atomic: any number of processes may put and
get on the same socket without locks, and a process killed at any moment leaves neither half a
message nor a held lock behind. Where SEQPACKET is missing (macOS) a message is a length-prefixed
record on a stream, under a writer and a reader lock where processes share the socket (Note
[message framing] in ``_os``): there, as with ``multiprocessing.Queue``, a process killed in
the middle of a message can leave the queue unusable. In-band (no fd passing), a message has no
fds and no slots: everything is in its pickle. The packet is a small pickle::

    (MAGIC, producer, data | None, entries, segs, blob, live, bundled, owners, where)

- ``producer``: ``(pid, token)`` of the sending process (the owner of the slots it copied).
- ``owners``: the owners of the slots the message names, ``owners[0]`` the producer, the others
  processes whose slots it forwards (Note [sending by handle]).
- ``where``: for each array entry, then the blob, ``(owner index, lease index)``.
- ``data``, ``entries``: what ``jaxtransport._wire`` made of the object: the pickle and the arrays set
  aside into slots of the sender's :class:`~jaxtransport._shm.Arena` (the same encoder as the
  Pool, so the same dtypes, weak types, PRNG keys and shardings).
- ``segs``: ``(owner index, segment id)`` of each fd in the packet, in order.
- ``blob``: when the pickle itself is larger than a packet may be, it travels in a slot too
  (``data`` is then None), so that every message stays one packet.
- ``bundled``: a packet carries at most MAX_FDS fds; for a message naming more segments the
  last fd is a socket with the remaining ``bundled`` fds in flight on it (nested SCM_RIGHTS).
- ``live``: ``(epoch, ids)`` of the sender's segments (None when it has many): a receiver unmaps
  the segments it mapped that the sender has since dropped (at its capacity the Arena drops
  wholly free segments of other sizes), so receivers do not keep dropped memory alive.

The fds of every segment a message names travel with it, so a message can be received after its
sender died (in-flight fds keep the memory alive). The receiver keeps one mapping per segment
(:meth:`Mapper.adopt` closes each duplicate fd at once), so a receiver never holds more than one
fd per segment, and only until the segment is mapped: "too many open files" cannot happen.

Note [queue slot lifetime]
A queue has no fixed receiver, so the receiver cannot send releases back on a private channel as
the Pool's workers do. Instead every slot starts with a header in the shared memory itself: a
table of LEASES leases, one per holder, 32 bytes each::

    [0:8) serial   [8:16) released   [16:24) holder pid   [24:32) holder token (start time)

A lease is *free* when ``released == serial``, *in flight* when it is busy and has no holder
pid (a message on its way), *held* when a receiver wrote its pid. A message names, for each of
its slots, which lease is its own. The receiver writes its pid when it takes the message, wraps
each slot in a per-transfer holder as the Pool does (Note [slot lifetime] in ``_shm``), and
writes ``released = serial`` when the last array over the slot is gone (a background thread in
the receiver applies releases and runs ``collect_deferred``). The sender frees a slot when
every lease is free and it does not keep the slot itself (Note [sending by handle]); when it
runs out of capacity, a lease whose holder process is dead counts as free too (a reused pid
reads another start time). A lease in flight is never reaped: a slot whose message nobody has
taken stays held, so a producer that outpaces its consumers waits for releases, then raises
ShmCapacityError.

Note [sending by handle]
Data already in shared memory travels on by handle, with no copy, in two cases:

- *Re-sending.* A jax.Array that this process copied into a slot keeps that slot while it lives
  (``Producer.pin``: a weak reference, and a budget of half the capacity, oldest pins dropped
  first, every pin dropped when a put waits for memory). jax.Arrays are immutable, so a later
  send of the same array, on any queue or pipe, takes a new lease on the slot.
- *Forwarding.* A received jax.Array that aliases a whole received slot (one buffer, on CPU) is
  sent on by the receiver as a lease on the *owner's* slot: the receiver keeps each segment's
  fd while it is mapped (``Mapper(keep_fds=True)``, at most MAX_KEPT_FDS per process) and
  passes it on, so the next receiver maps the owner's segment, and a chain A->B->C->D or a round
  trip A->B->A copies nothing. The packet names each slot's owner (``owners``, ``where``). An
  owner that never sends to a process itself never tells it which segments it dropped: that
  process unmaps such owners' idle segments beyond FOREIGN_MAPPED_MAX (``trim_foreign``).

Several processes may take leases on one slot at once (the owner re-sending, receivers
forwarding), so taking a lease, and the owner's last look before it frees a slot, happen under
a POSIX record lock over the slot's header (``_os.try_lock_range``): the kernel releases it when
its holder dies, even by SIGKILL inside the section. Record locks belong to the process and
are dropped when the process closes *any* fd of the file, so in each process one lock
(``_headers``) serialises these sections with every close of a kept segment fd. Nobody waits
for a lease: when the table is full, the header lock is held for long (a stopped peer), no fd
is kept, or the host has no record locks (macOS: forwarding only), the array is copied instead.
What still copies: numpy arrays (a receiver's are writeable), arrays that are not exactly a
whole slot (a slice, a sharded array received under ``placement="preserve"``), arrays not on
the CPU, and the in-band path (no shared memory).
"""

from __future__ import annotations

import array
import collections
import contextlib
import functools
import os
import pickle
import secrets
import socket
import struct
import threading
import time
import weakref
from typing import Any

import numpy as np

from .. import _lockorder, _os, _shm
from .._errors import ShmCapacityError, ShmHandleError, TransportError
from .._nojax import find_tracer
from .._pickling import PICKLE_PROTOCOL

MAGIC = "jaxtransport.mp/2"
LEASES = 16  # leases per slot (Note [queue slot lifetime])
_LEASE = struct.Struct("<QQQQ")  # serial, released, holder pid, holder token
HEADER = LEASES * _LEASE.size  # bytes before each slot's data: 512, a multiple of ALIGN
MAX_PACKET = 128 << 10  # larger pickles travel in a slot (Note [queue messages]); see packet_max()
RECV_BUF = 2 * MAX_PACKET  # a receiving thread's buffer (Note [packets read into a buffer] in _os)
MAX_FDS = 250  # SCM_MAX_FD is 253
MAX_KEPT_FDS = 256  # received segments' fds kept to forward from (Note [sending by handle])
FOREIGN_MAPPED_MAX = 1 << 30  # bytes of idle segments kept mapped from owners that never sent here
_MAX_LIVE_LISTED = 64
_CAPACITY_GRACE_S = 10.0  # how long a put waits without any release before giving up
_RELEASE_POLL_S = 0.02

# Serialises, in this process, every header-lock section with every close of a kept segment
# fd (closing any fd of a file drops the process's record locks on it: Note [sending by
# handle]). Taken after Producer.lock or _Consumer.lock, never before; nothing is called under it.
_headers = threading.Lock()


def _proc_start(pid: int) -> int | None:
    """A token of the live process ``pid``, None if it is gone (``_os.process_token``: its
    start time where ``/proc`` exists, so a reused pid reads differently)."""
    return _os.process_token(pid)


@contextlib.contextmanager
def _header_locked(fd: int | None, hoff: int):
    """The slot header at ``hoff`` locked for this process (``_headers``, then the record lock
    over it): yields True when held, False when another process kept it (slow or stopped),
    None when there are no record locks here (or no fd)."""
    with _headers:
        got = None if fd is None else _os.try_lock_range(fd, hoff, HEADER)
        try:
            yield got
        finally:
            if got:
                _os.unlock_range(fd, hoff, HEADER)  # type: ignore[arg-type]


def _take_lease(mm, fd: int | None, hoff: int, forwarding: bool) -> tuple[int, int] | None:
    """A free lease of the slot whose header is at ``hoff`` made in flight: ``(index, serial)``,
    or None (copy instead) when none is free or the header lock cannot be had. The owner may
    go on without record locks where the host has none (then nobody else takes leases);
    a forwarder may not."""
    with _header_locked(fd, hoff) as got:
        if got is False or (got is None and forwarding):
            return None
        for j in range(LEASES):
            off = hoff + j * _LEASE.size
            serial, released, _pid, _tok = _LEASE.unpack_from(mm, off)
            if serial != released:
                continue  # Note [loops that end in a test]
            _LEASE.pack_into(mm, off, released + 1, released, 0, 0)
            return j, released + 1
        return None


def _give_lease(mm, hoff: int, j: int, serial: int) -> None:
    """Free lease ``j`` (a message that was never sent, or a claimed slot given back)."""
    off = hoff + j * _LEASE.size
    try:
        if _LEASE.unpack_from(mm, off)[0] == serial:
            struct.pack_into("<Q", mm, off + 8, serial)
    except (ValueError, TypeError, IndexError):
        pass  # unmapped meanwhile


def _leases_free(mm, hoff: int, dead_too: bool, starts: dict, reap: bool) -> bool:
    """Whether every lease of the slot is free; with ``dead_too`` a lease whose holder died
    counts as free (``reap``: and is freed). A lease in flight is never free."""
    for j in range(LEASES):
        off = hoff + j * _LEASE.size
        serial, released, rpid, rstart = _LEASE.unpack_from(mm, off)
        if serial == released:
            continue
        if not (dead_too and rpid):
            return False
        if rpid not in starts:
            starts[rpid] = _proc_start(rpid)
        if starts[rpid] == rstart:
            return False
        if reap:
            struct.pack_into("<Q", mm, off + 8, serial)
    return True


# --------------------------------------------------------------------------------------------
# sender side


def _pin_died(dead_pins: collections.deque, key: int, _ref) -> None:
    # A weakref callback: any thread, maybe one holding Producer.lock. An atomic append only.
    dead_pins.append(key)


class _HeaderArena:
    """The process's Arena seen by ``_wire.commit``: every slot gets HEADER bytes in front."""

    def __init__(self, producer: Producer):
        self.p = producer

    def alloc(self, nbytes, borrower, wait=None):
        return self.p.alloc(nbytes, wait)

    def release(self, handle, borrower, count=1):
        self.p.drop(handle)
        return True


class _Sent:
    """A slot of this process's arena that a message took: its arena handle, and the array
    pinned to it (Note [sending by handle])."""

    __slots__ = ("entry", "first", "handle", "pin")

    def __init__(self, handle, first: int):
        self.handle, self.first = handle, first  # first: the serial of lease 0, its first message's
        self.pin: int | None = None  # id() of the live jax.Array this slot holds
        self.entry: tuple | None = None  # that array's entry, to send it again


class Producer:
    """The sending half of this process: one Arena for every queue and pipe it sends on."""

    def __init__(self, capacity: int | None):
        self.pid = os.getpid()
        self.key = (self.pid, secrets.token_bytes(8))
        self.arena = _shm.Arena(capacity, label=f"process {self.pid} (jaxtransport.multiprocessing)")
        self.lock = threading.Lock()
        # data handle -> _Sent, oldest first
        self.outstanding: collections.OrderedDict = collections.OrderedDict()
        # id(jax.Array) -> (weakref, data handle, nbytes), oldest first
        self.pins: collections.OrderedDict = collections.OrderedDict()
        self.pinned_bytes = 0
        self.serials = iter(range(1, 1 << 31))  # each slot life's serial base (<< 32)
        self.dead_pins: collections.deque = collections.deque()  # ids, appended by weakref callbacks
        self.frees = 0  # slots freed so far (progress, for waiting puts)
        self.adapter = _HeaderArena(self)
        self._live: tuple | None = None  # ((newest segment id, segment count), live_segments())

    def alloc(self, nbytes: int, wait):
        # Leases are written into the slot headers; look at all of them while few are
        # outstanding (cheap), else at the oldest ones, so a free slot is found before a new
        # segment (fresh pages) is made.
        self.reap(None if len(self.outstanding) <= 256 else 64)
        handle, view = self.arena.alloc(nbytes + HEADER, "q", wait)
        # Every lease starts free at a serial above any this slot had in an earlier life, so a
        # late write for an old life (its holder wrongly judged dead) never matches a new one.
        base = next(self.serials) << 32
        for j in range(LEASES):
            _LEASE.pack_into(view, j * _LEASE.size, base + (j == 0), base, 0, 0)  # lease 0: this message's
        data = (handle.seg, handle.offset + HEADER, nbytes, handle.gen)  # travels as a plain tuple
        with self.lock:
            self.outstanding[data] = _Sent(handle, base + 1)
        return data, view[HEADER:]

    def drop(self, data_handle) -> None:
        """Give back lease 0 of a slot taken by ``alloc`` for a message that was never sent,
        and free the slot at once when nothing else holds it."""
        data = tuple(data_handle)
        with self.lock:
            sent = self.outstanding.get(data)
            seg = None if sent is None else self.arena.segment(data[0])
            if seg is not None and seg.mm is not None:
                _give_lease(seg.mm, sent.handle.offset, 0, sent.first)  # type: ignore[union-attr]
        if sent is not None:
            self.reap(only=[data])

    # -- pins (Note [sending by handle])
    def pin(self, x: Any, data: tuple, entry: tuple) -> None:
        """Keep ``data``'s slot while the jax.Array ``x`` lives, so that sending ``x`` again
        goes by handle; within the budget (half the capacity), the oldest pins dropped first."""
        nbytes = data[2]
        budget = self.arena.capacity // 2
        if nbytes > budget:
            return
        try:
            ref = weakref.ref(x, functools.partial(_pin_died, self.dead_pins, id(x)))
        except TypeError:
            return
        with self.lock:
            self._forget_dead_pins()
            sent = self.outstanding.get(data)
            if sent is None or id(x) in self.pins:
                return
            while True:  # not `while <test>:` (Note [loops that end in a test])
                if not (self.pins and self.pinned_bytes + nbytes > budget):
                    break
                self._unpin(next(iter(self.pins)))
            sent.pin, sent.entry = id(x), entry
            self.pins[id(x)] = (ref, data, nbytes)
            self.pinned_bytes += nbytes

    def _forget_dead_pins(self) -> None:
        # Called with self.lock held.
        while self.dead_pins:
            try:
                key = self.dead_pins.popleft()
            except IndexError:
                return
            rec = self.pins.get(key)
            if rec is not None and rec[0]() is None:
                self._unpin(key)

    def _unpin(self, key: int) -> None:
        # Called with self.lock held.
        _ref, data, nbytes = self.pins.pop(key)
        self.pinned_bytes -= nbytes
        sent = self.outstanding.get(data)
        if sent is not None and sent.pin == key:
            sent.pin, sent.entry = None, None

    def unpin_all(self) -> None:
        """Drop every pin (a put is waiting for memory): arrays sent again are copied again."""
        with self.lock:
            for key in list(self.pins):
                self._unpin(key)

    def lease_pinned(self, x: Any) -> tuple[tuple, int, Any, tuple[int, int]] | None:
        """``(entry, fd, mapping, (lease index, serial))`` to send ``x`` again by handle, when
        ``x`` is a pinned jax.Array and its slot has a free lease; else None."""
        rec = self.pins.get(id(x))
        if rec is None or rec[0]() is not x:
            return None
        try:
            if x.is_deleted():
                return None  # donated: encoding it raises, as for any deleted array
        except Exception:  # noqa: BLE001 - not a jax.Array after all
            return None
        with self.lock:
            self._forget_dead_pins()
            rec = self.pins.get(id(x))
            sent = None if rec is None else self.outstanding.get(rec[1])
            if sent is None or sent.pin != id(x) or sent.entry is None:
                return None
            seg = self.arena.segment(rec[1][0])  # type: ignore[index]
            if seg is None or seg.mm is None or seg.fd is None:
                return None
            lease = _take_lease(seg.mm, seg.fd, sent.handle.offset, forwarding=False)
            if lease is None:
                return None
            return sent.entry, seg.fd, seg.mm, lease

    def reap(self, limit: int | None = None, dead_too: bool = False, only: list | None = None) -> int:
        """Free slots that nothing holds any more: every lease free (with ``dead_too``, a
        lease whose holder died counts as free), no pin. Looks at most ``limit`` slots, oldest
        first (all when None; ``only``: those). Returns slots freed."""
        freed = []
        starts: dict[int, int | None] = {}
        with self.lock:
            self._forget_dead_pins()
            if only is not None:
                # A generator, not a filtered list comprehension (Note [loops that end in a test]).
                todo = list((d, self.outstanding.pop(d)) for d in only if d in self.outstanding)  # noqa: C400
            else:
                n = len(self.outstanding) if limit is None else min(limit, len(self.outstanding))
                todo = [self.outstanding.popitem(last=False) for _ in range(n)]
            keep = []
            for data, sent in todo:
                seg = self.arena.segment(data[0])
                if seg is None or seg.mm is None:
                    freed.append(sent.handle)
                elif sent.pin is None and self._free_now(seg, sent.handle.offset, dead_too, starts):
                    freed.append(sent.handle)
                else:
                    keep.append((data, sent))
            for data, sent in keep:
                self.outstanding[data] = sent
        for h in freed:
            self.arena.release(h, "q")
        if freed:
            self.frees += len(freed)
        return len(freed)

    @staticmethod
    def _free_now(seg, hoff: int, dead_too: bool, starts: dict) -> bool:
        """Whether the slot at ``hoff`` may be freed: a look without the header lock, then
        (where it says yes) a last look under it, so that no lease taken meanwhile by a
        forwarder is missed (Note [sending by handle])."""
        if not _leases_free(seg.mm, hoff, dead_too, starts, reap=False):
            return False
        with _header_locked(seg.fd, hoff) as got:
            return got is not False and _leases_free(seg.mm, hoff, dead_too, starts, reap=True)

    def waiter(self, timeout: float | None):
        """An Arena wait hook for one put: wait while receivers keep releasing memory (or until
        ``timeout``), checking for released slots and dead receivers."""
        start = time.monotonic()
        state = {"progress": start, "frees": self.frees}

        def wait():  # called with no lock held (Arena.alloc)
            self.unpin_all()
            self.reap(None, dead_too=True)
            now = time.monotonic()
            if self.frees != state["frees"]:
                state["frees"], state["progress"] = self.frees, now
                return True  # alloc retries at once
            if timeout is not None:
                if now - start > timeout:
                    return False
            elif now - state["progress"] > _CAPACITY_GRACE_S:
                return False
            return 0.01  # alloc waits this long for a release of its own, then asks again

        return wait

    def live_segments(self):
        """``(epoch, segment ids)`` for receivers to unmap segments this process dropped (Note
        [queue messages]); None when there are too many to list cheaply. Every message carries
        it, so the last answer is kept while the arena's newest id and segment count stay the
        same: ids are never reused, so those two say which segments are live."""
        a = self.arena
        state = (a.last_segment_id, a.segment_count())
        cached = self._live
        if cached is not None and cached[0] == state:
            return cached[1]
        segs = a.segments()
        live = None if len(segs) > _MAX_LIVE_LISTED else (a.last_segment_id, tuple(s.seg_id for s in segs))
        if (a.last_segment_id, len(segs)) == state:  # not changed meanwhile (another thread)
            self._live = (state, live)
        return live

    def held(self) -> tuple[int, int, int]:
        """(slots held for messages or receivers, of which held by a receiver, bytes); a slot
        that only a pin keeps is not counted."""
        with self.lock:
            items = list(self.outstanding.items())
        slots = taken = nbytes = 0
        for data, sent in items:
            seg = self.arena.segment(data[0])
            if seg is None or seg.mm is None:
                continue
            busy = held = False
            for j in range(LEASES):
                serial, released, rpid, _tok = _LEASE.unpack_from(seg.mm, sent.handle.offset + j * _LEASE.size)
                if serial != released:
                    busy, held = True, held or bool(rpid)
            if busy:
                slots, taken, nbytes = slots + 1, taken + held, nbytes + data[2]
        return slots, taken, nbytes


_producer: Producer | None = None
_producer_lock = threading.Lock()
_capacity: int | None = None


def set_shm_capacity(nbytes: int | None) -> None:
    """Cap the shared memory this process sends from (all its queues and pipes together); None
    restores the default (half the free memory). Takes effect for the next segment created."""
    global _capacity
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"shm_capacity must be a positive int (bytes) or None, got {nbytes!r}")
    _capacity = nbytes
    with _producer_lock:
        if _producer is not None and _producer.pid == os.getpid():
            _producer.arena.capacity = nbytes or _shm.default_capacity()


def producer() -> Producer:
    global _producer
    p = _producer
    if p is None or p.pid != os.getpid():
        with _producer_lock:
            p = _producer
            if p is None or p.pid != os.getpid():
                p = _producer = Producer(_capacity)
    return p


def _locate(obj: Any, root: str):
    def locate():
        found = find_tracer(obj, root)
        return None if found is None else (found[0] or root)

    return locate


class Outgoing:
    """A message ready to send: the packet and the fds it carries (the arena's, plus ``owned``:
    fds this message closes once sent or discarded: a bundle socket, duplicates of forwarded
    segments' fds). ``leases``: the leases it took on slots it did not allocate, given back
    if it is discarded."""

    __slots__ = ("fds", "handles", "leases", "owned", "packet")

    def __init__(self, packet, fds, handles, owned=(), leases=()):
        self.packet, self.fds, self.handles, self.owned = packet, fds, handles, list(owned)
        self.leases = list(leases)

    def sent(self) -> None:
        _close_owned(self.owned)
        self.owned = []
        self.leases = []

    def discard(self) -> None:
        leases, self.leases = self.leases, []
        self.sent()
        for mm, hoff, j, serial in leases:
            _give_lease(mm, hoff, j, serial)
        p = producer()
        for h in self.handles:
            p.drop(h)
        self.handles = ()


def _close_owned(fds) -> None:
    if fds:
        with _headers:  # closing a segment's fd drops this process's record locks on it
            _close_all(fds)


class _Reuse:
    """``_wire.commit``'s ``adopt`` for one message: a jax.Array already in shared memory
    (pinned by this process, or received and forwarded) goes as a lease on its slot (Note
    [sending by handle]), booked here, not in the arena (its handle is None). Records, per
    array, the owner, the lease and the fd to pass."""

    def __init__(self, p: Producer):
        self.p = p
        self.c = _consumer if _consumer is not None and _consumer.pid == p.pid else None
        self.owners: list = [p.key]
        self.by_id: dict[int, tuple] = {}  # id(x) -> (owner index, seg id, lease index)
        self.fds: dict[tuple[int, int], int] = {}  # (owner index, seg id) -> fd
        self.owned: list[int] = []  # duplicated fds of forwarded segments
        self.leases: list[tuple] = []  # (mm, hoff, j, serial) taken here

    def __call__(self, x: Any, _borrower: Any) -> tuple[tuple, None] | None:
        pinned = self.p.lease_pinned(x)
        if pinned is not None:  # this process's own slot: the arena's fd, not ours to close
            key, (entry, fd, mm, lease), dup = self.p.key, pinned, False
        else:
            fwd = self.c.forward(x) if self.c is not None and self.c.mappers else None
            if fwd is None:
                return None
            (key, entry, fd, mm, lease), dup = fwd, True  # a duplicate fd, this message's to close
        seg, j = entry[-1][0], lease[0]
        self.leases.append((mm, entry[-1][1] - HEADER, *lease))
        if key not in self.owners:
            self.owners.append(key)
        oi = self.owners.index(key)  # 0: this process (also a round trip's own slot)
        self.by_id[id(x)] = (oi, seg, j)
        if (oi, seg) not in self.fds:
            self.fds[(oi, seg)] = fd
            if dup:
                self.owned.append(fd)
        elif dup:
            _close_owned([fd])
        return entry, None

    def give_back(self) -> None:
        for mm, hoff, j, serial in self.leases:
            _give_lease(mm, hoff, j, serial)
        self.leases = []
        _close_owned(self.owned)
        self.owned = []


def _bundle(fds: list[int]) -> int:
    """A socket holding ``fds`` in flight (SCM_RIGHTS, MAX_FDS at a time), its writing end
    closed: one fd that stands for any number of them (Note [queue messages])."""
    a, b = _os.message_socketpair()
    try:
        for i in range(0, len(fds), MAX_FDS):
            part = fds[i : i + MAX_FDS]
            a.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", part))])
        return b.detach()
    except BaseException:
        b.close()
        raise
    finally:
        a.close()


def _unbundle(fd: int, count: int) -> list[int]:
    """The ``count`` fds a bundle socket holds (closes the bundle; TransportError if short)."""
    got: list[int] = []
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        _close_all([fd])
        raise _garbage("the fd announced as a bundle is not a socket") from None
    try:
        sock.setblocking(False)
        while len(got) < count:
            try:
                _, anc, _flags, _ = sock.recvmsg(16, socket.CMSG_SPACE(MAX_FDS * 4 + 64))
            except BlockingIOError:
                break
            n = len(got)
            for level, typ, data in anc:
                if level != socket.SOL_SOCKET or typ != socket.SCM_RIGHTS:
                    continue  # Note [loops that end in a test]
                a = array.array("i")
                a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
                got.extend(a)
            if len(got) == n:
                break
    finally:
        sock.close()
    if len(got) != count:
        _close_all(got)
        raise _garbage(f"a bundle of {count} segment fds held {len(got)}")
    return got


def prepare(obj: Any, threshold: int, root: str):
    """Phase 1, in the caller: pickle ``obj`` with arrays set aside. Raises TracerTransportError
    (with the key path under ``root``) or the pickling error before anything is queued."""
    _wire = _wire_module()
    if _os.in_band():  # no shared memory to pass here: everything inside the pickle
        _os.warn_in_band("jaxtransport.multiprocessing")
        threshold = _os.IN_BAND_THRESHOLD
    data = _wire.plain_pickle(obj, threshold)  # Note [plain data] in _wire
    if data is not None:
        return _wire.Prepared(data, (), ())
    return _wire.prepare(obj, threshold=threshold, locate=_locate(obj, root))


def commit(prep, timeout: float | None = None) -> Outgoing:
    """Phase 2, in the caller: copy the set-aside arrays into this process's shared memory (may
    wait for receivers to release memory, see Producer.waiter), or take leases on the slots of
    those already there (Note [sending by handle]), and build the packet."""
    p = producer()
    if _consumer is not None and _consumer.pid == p.pid:
        # what this process received and dropped: before allocating, and so that a process
        # that only answers with small messages still gives its senders their memory back
        _consumer.apply_releases()
    if not prep.found and not prep.trees and len(prep.data) <= packet_max() - 1024:
        # Nothing in shared memory and a packet that fits: the packet alone (Note [a message
        # with no arrays]).
        packet = pickle.dumps(
            (MAGIC, p.key, prep.data, (), (), None, p.live_segments(), 0, (p.key,), ()), protocol=PICKLE_PROTOCOL
        )
        return Outgoing(packet, [], ())
    reuse = _Reuse(p) if prep.found and not _os.in_band() else None
    try:
        enc = _wire_module().commit(prep, arena=p.adapter, borrower="q", wait=p.waiter(timeout), adopt=reuse)
    except BaseException as e:
        if reuse is not None:
            reuse.give_back()
        if isinstance(e, ShmCapacityError):
            raise _capacity_error(p, e) from None
        raise
    handles = list(enc.handles)
    owned: list[int] = []
    try:
        where, segs, fds = [], [], []
        seen: set = set()
        for (kind, x), entry in zip(prep.found, enc.entries):
            h = entry[-1]
            got = None if reuse is None else reuse.by_id.get(id(x))
            if got is None:  # copied just now: lease 0 of a new slot of this process
                where.append((0, 0))
                if kind == "jax":
                    p.pin(x, tuple(h), entry)
                oi = 0
            else:
                where.append((got[0], got[2]))
                oi = got[0]
            if (oi, h[0]) in seen:
                continue  # Note [loops that end in a test]
            seen.add((oi, h[0]))
            segs.append((oi, h[0]))
        data, blob = enc.data, None
        if len(data) > packet_max() - 1024 - 64 * len(enc.entries) and not _os.in_band():
            try:
                blob, view = p.alloc(len(data), p.waiter(timeout))
            except ShmCapacityError as e:
                raise _capacity_error(p, e) from None
            handles.append(blob)
            view[: len(data)] = np.frombuffer(data, np.uint8)
            data = None
            where.append((0, 0))
            if (0, blob[0]) not in seen:
                segs.append((0, blob[0]))
        for oi, s in segs:
            fd = None if reuse is None else reuse.fds.get((oi, s))
            if fd is None:
                seg = p.arena.segment(s)
                if seg is None or seg.fd is None:
                    raise ShmHandleError(f"segment {s} of this process's shared memory was closed while sending")
                fd = seg.fd
            fds.append(fd)
        if reuse is not None:
            owned, reuse.owned = reuse.owned, []
        bundled = 0
        if len(fds) > MAX_FDS:  # more than one packet may carry: the rest travel in a bundle
            bundled = len(fds) - (MAX_FDS - 1)
            owned.append(_bundle(fds[MAX_FDS - 1 :]))
            fds = fds[: MAX_FDS - 1] + owned[-1:]
        owners = tuple(reuse.owners) if reuse is not None else (p.key,)
        packet = pickle.dumps(
            (MAGIC, p.key, data, enc.entries, tuple(segs), blob, p.live_segments(), bundled, owners, tuple(where)),
            protocol=PICKLE_PROTOCOL,
        )
    except BaseException:
        for h in handles:
            p.drop(h)
        if reuse is not None:
            reuse.owned.extend(owned)
            reuse.give_back()
        raise
    return Outgoing(packet, fds, handles, owned, reuse.leases if reuse is not None else ())


# Note [a message with no arrays]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Most messages of a request-and-reply loop carry nothing for shared memory: a step's
# observations under the threshold, an acknowledgement, an action. Such a message is its packet
# alone, the same packet the general path makes (so every receiver reads it as before), built
# without the general path's books: no arena call, no leases, no fds. The receiver sees a packet
# naming no segment, no slot and no fd, and only unpickles it and reads the sender's list of live
# segments (a receiver must still unmap what the sender dropped). Both ends still write the
# releases of arrays this process received and dropped, as every message did before: a
# consumer that answers with small messages gives its senders their memory back as it goes.
# Measured in one process on 2 cores, an int put and got: 129 us before these paths (prepare
# 30, commit 21, send 15, take 26, decode 35), against 12 us for the stock SimpleQueue; the
# round trip between two processes was 1.7x the stock Queue's. Plain data skips the routed
# pickler too (Note [plain data] in ``_wire``): an int's put and get in one process then took
# 21 us.


def packet_max() -> int:
    """The largest packet this process sends (Note [queue messages]): MAX_PACKET, or less where
    a Unix packet socket's send buffer leaves less room (a packet longer than the buffer can
    never be sent: EMSGSIZE). Up to 32 KiB (and 113 KB of observations) the pickle went into a
    shared-memory slot before, its own allocation, copy, fd and release each time: a round trip
    of those observations took 2x the stock Queue's time and 3x the stock Pipe's."""
    global _PACKET_MAX
    if _PACKET_MAX is None:
        room = _os.packet_room()
        _PACKET_MAX = MAX_PACKET if room is None else max(min(MAX_PACKET, room - (16 << 10)), 16 << 10)
    return _PACKET_MAX


_PACKET_MAX: int | None = None


def _wire_module() -> Any:
    """``jaxtransport._wire``, imported on first use (as every phase here did with a local
    import; this saves each message the import statement's lookups)."""
    global _WIRE
    if _WIRE is None:
        from .. import _wire

        _WIRE = _wire
    return _WIRE


_WIRE: Any = None


def _capacity_error(p: Producer, e: ShmCapacityError) -> ShmCapacityError:
    slots, taken, nbytes = p.held()
    return ShmCapacityError(
        f"jaxtransport.multiprocessing could not put this message: the shared memory of process "
        f"{p.pid} is full (shm_capacity={p.arena.capacity} bytes, {_shm.format_bytes(p.arena.capacity)}) and no "
        f"receiver released any in time. {slots} slots ({_shm.format_bytes(nbytes)}) are held: {slots - taken} by "
        f"messages no process has taken from their queue or pipe yet, {taken} by arrays receivers still "
        "keep alive. The consumer is slower than this producer, stopped, or gone. Fixes: bound the "
        "queue (Queue(maxsize=...)) so that put() waits for the consumer, drop received arrays sooner, "
        "raise jaxtransport.multiprocessing.set_shm_capacity(...), or pass put(timeout=...) to wait "
        f"longer. ({e})"
    )


def send_packet(
    sock: socket.socket, out: Outgoing, timeout: float | None = None, nowait: bool = False, lock: Any = None
) -> None:
    """Send one message (blocking while the socket buffer is full; ``timeout`` bounds that;
    ``nowait``: BlockingIOError instead of waiting). ``lock``: the writer lock of a stream
    several processes write to (Note [message framing] in ``_os``), held for the message."""
    if lock is not None:
        if not (lock.acquire(False) if nowait else lock.acquire(True, timeout)):
            if nowait:
                raise BlockingIOError("another writer holds the queue's writer lock")
            raise TimeoutError("another writer held the queue's writer lock")
        try:
            _send_packet(sock, out, timeout, nowait)
        finally:
            lock.release()
        return
    _send_packet(sock, out, timeout, nowait)


def _send_packet(sock: socket.socket, out: Outgoing, timeout: float | None, nowait: bool) -> None:
    if nowait:
        _os.send_message(sock, out.packet, out.fds, _os.DONTWAIT)
        out.sent()
        return
    if timeout is None:
        _os.send_message(sock, out.packet, out.fds)
        out.sent()
        return
    import select

    deadline = time.monotonic() + timeout
    while True:
        try:
            _os.send_message(sock, out.packet, out.fds, _os.DONTWAIT)
            out.sent()
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the receiver is not reading (socket buffer full)") from None
            select.select([], [sock], [], left)


# --------------------------------------------------------------------------------------------
# receiver side


class _Consumer:
    """The receiving half of this process: one Mapper per sending process, and a thread that
    applies releases (Note [queue slot lifetime])."""

    def __init__(self):
        self.pid = os.getpid()
        self.start = _proc_start(self.pid) or 0
        self.lock = threading.Lock()  # one thread decodes at a time (Mapper is not thread-safe)
        self.mappers: dict[tuple, _shm.Mapper] = {}
        self.epochs: dict[tuple, int] = {}  # newest segment list seen per sender
        self.senders: set[tuple] = set()  # owners that sent to this process themselves
        # The release thread parks on it; get() wakes it from the caller's thread, where a
        # Ctrl-C cannot leave it held (Note [waits a Ctrl-C cannot break] in _lockorder).
        self.wake = _lockorder.condition("Consumer.wake")
        self.thread: threading.Thread | None = None
        from multiprocessing import util

        # at exit (a spawned child's too: multiprocessing runs these, not atexit's)
        util.Finalize(None, _flush_at_exit, args=(weakref.ref(self),), exitpriority=5)

    def mapper(self, key) -> _shm.Mapper:
        m = self.mappers.get(key)
        if m is None:
            m = self.mappers[key] = _shm.Mapper(None, label=f"process {key[0]}", keep_fds=True)
        return m

    def forward(self, x: Any) -> tuple[Any, tuple, int, Any, tuple[int, int]] | None:
        """``(owner key, entry, fd, mapping, lease)`` to send the received jax.Array ``x`` on by
        handle: ``x`` is exactly the one buffer of a live received slot, whose segment's fd is
        kept here (``fd``: a duplicate, the caller's to close) and which had a free lease
        (Note [sending by handle]). None otherwise (copy it)."""
        from .. import _codec, _wire

        ptr = _wire._pointer(x)
        if ptr is None:
            return None
        with self.lock:
            # ``live`` loses entries from finalizers in any thread: one ``get`` per mapper.
            found = next(((k, m, h) for k, m in self.mappers.items() if (h := m.live.get(ptr)) is not None), None)
            if found is None:
                return None
            key, m, h = found
            seg = m.segs.get(h.seg)
            if seg is None or seg.fd is None or seg.mm is None:
                return None
            try:
                meta, bufs = _codec.encode(x)
            except Exception:  # noqa: BLE001 - not ours to judge here: the copy path raises it
                return None
            if meta.indices or len(bufs) != 1 or bufs[0].nbytes > h.nbytes or _wire._pointer(bufs[0]) != ptr:
                return None
            lease = _take_lease(seg.mm, seg.fd, h.offset - HEADER, forwarding=True)
            if lease is None:
                return None
            try:
                fd = os.dup(seg.fd)
            except OSError:  # out of fds: copy instead
                _give_lease(seg.mm, h.offset - HEADER, *lease)
                return None
            entry = ("jax", tuple(meta), ((0, bufs[0].nbytes),), tuple(h))
            return key, entry, fd, seg.mm, lease

    def trim_fds(self) -> None:
        """Keep at most MAX_KEPT_FDS segment fds, and a quarter of the open-file limit (the
        oldest mapped ones are closed first: their arrays are copied when forwarded). Called
        with ``self.lock`` held."""
        kept = [(m, s) for m in self.mappers.values() for s in m.segs.values() if s.fd is not None]
        if len(kept) <= 8:
            return
        budget = min(MAX_KEPT_FDS, _os.fd_limit() // 4)
        if len(kept) <= budget:
            return
        with _headers:
            for _m, seg in kept[: len(kept) - budget]:
                if seg.mm is None:
                    continue  # Note [loops that end in a test]
                fd, seg.fd = seg.fd, None
                _close_all([fd])

    def trim_foreign(self) -> None:
        """Unmap idle segments of owners whose slots only reached this process forwarded (no
        message of theirs says which segments they dropped, Note [queue messages]) beyond
        FOREIGN_MAPPED_MAX bytes: a segment with no array over it and no release pending; a
        later message naming it brings its fd again. Called with ``self.lock`` held."""
        foreign = [m for k, m in self.mappers.items() if k not in self.senders]
        total = sum(s.size for m in foreign for s in m.segs.values() if s.mm is not None)
        if total <= FOREIGN_MAPPED_MAX:
            return
        for m in foreign:
            for tok in m.take_releases():
                _write_release(m, tok)
            try:  # ``live`` first, then ``pending``: a dying holder is in one of them (_on_holder_dead)
                busy = {h.seg for h in list(m.live.values())}
                busy.update(t[0] for t in list(m.pending) if isinstance(t, tuple) and t)
            except RuntimeError:  # changed by a finalizer while copied: next time
                return
            for seg_id, seg in list(m.segs.items()):
                if total <= FOREIGN_MAPPED_MAX:
                    return
                if seg.mm is not None and seg_id not in busy:
                    with _headers:  # a close drops this process's header locks on the file
                        total -= m.unmap(seg_id)

    def apply_releases(self) -> None:
        """Write the releases of dropped arrays into their slot headers (cheap when none)."""
        for m in list(self.mappers.values()):
            if m.live or m.pending:
                for tok in m.take_releases():
                    _write_release(m, tok)

    def ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            ref = weakref.ref(self)
            self.thread = threading.Thread(
                target=_release_loop, args=(ref,), name="jaxtransport-mp-release", daemon=True
            )
            self.thread.start()
        with self.wake:
            self.wake.wake_all()


def _flush_at_exit(ref) -> None:
    """Write the releases of the arrays this process received and has dropped, as it exits.

    A consumer that drops what it received, answers and returns (``del got; out.put("done")``)
    would otherwise exit before its releases are written: jaxlib drops its reference to a
    received array's memory from a runtime thread, so the array may still look alive when the
    answer goes (its put writes the releases it sees), and the release thread dies with the
    process. Its senders would then get that memory back only once they run short of it (a
    dead receiver's lease counts as released then). Tries for at most EXIT_FLUSH_S while
    received arrays look alive (arrays the process still holds at exit keep it that long). In
    child processes only (see below)."""
    c = ref()
    if c is None or c.pid != os.getpid():
        return
    import multiprocessing

    if multiprocessing.parent_process() is None:
        # The main process runs this from atexit, after JAX's own exit handlers (registered
        # later, run first): no jaxlib call then. A child exits through multiprocessing's
        # bootstrap, which runs this before anything is torn down.
        return
    deadline = time.monotonic() + EXIT_FLUSH_S
    while True:
        if not c.lock.acquire(timeout=0.05):  # a thread stopped while decoding: leave it
            return
        try:
            c.apply_releases()
            live = any(m.live for m in list(c.mappers.values()))
        except Exception:  # noqa: BLE001 - at exit: nothing more to do
            return
        finally:
            c.lock.release()
        if not live or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


EXIT_FLUSH_S = 0.05


def _release_loop(ref) -> None:
    while True:
        c = ref()
        if c is None:
            return
        busy = any(m.live or m.pending for m in list(c.mappers.values()))
        if busy:
            try:
                c.apply_releases()
            except Exception:  # noqa: BLE001 - never let the release thread die
                pass
            wake, ticket = None, None
        else:
            wake = c.wake
            with wake:
                ticket = wake.park()
        del c
        if wake is None:
            time.sleep(_RELEASE_POLL_S)
        elif not _lockorder.sleep(ticket, 1.0):
            with wake:
                wake.unpark(ticket)


def _write_release(m: _shm.Mapper, tok) -> None:
    if not isinstance(tok, tuple) or len(tok) != 3:
        return
    seg_id, off, serial = tok
    seg = m.segs.get(seg_id)
    mm = None if seg is None else seg.mm
    if mm is None:
        return
    try:
        struct.pack_into("<Q", mm, off + 8, serial)
    except (ValueError, TypeError, IndexError):
        pass  # unmapped meanwhile: its sender dropped it


_consumer: _Consumer | None = None


def consumer() -> _Consumer:
    global _consumer
    c = _consumer
    if c is None or c.pid != os.getpid():
        with _producer_lock:
            c = _consumer
            if c is None or c.pid != os.getpid():
                c = _consumer = _Consumer()
    return c


def recv_packet(sock: socket.socket, nowait: bool = False) -> tuple[bytes, list[int]]:
    """One packet and the fds that came with it. Raises EOFError when every writer is gone,
    BlockingIOError (``nowait``) when there is none, TransportError (fds closed) for a
    truncated packet."""
    try:
        msg, got, truncated = _os.recv_message(sock, RECV_BUF, MAX_FDS, _os.DONTWAIT if nowait else 0)
    except ValueError as e:  # a garbled stream (Note [message framing] in _os)
        raise _garbage(str(e)) from None
    if truncated:
        _close_all(got)
        raise TransportError(
            "Corrupt message on a jaxtransport.multiprocessing queue or pipe: the packet or its fds "
            "were truncated (something other than jaxtransport wrote to it). The message is lost."
        )
    if not msg and not got:
        raise EOFError
    return msg, got


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _garbage(why: str) -> TransportError:
    return TransportError(
        f"Corrupt message on a jaxtransport.multiprocessing queue or pipe: {why}. Something other "
        "than jaxtransport.multiprocessing wrote to it (both ends must use jaxtransport.multiprocessing "
        "objects). The message is lost; later messages are unaffected."
    )


def _parse(packet: bytes) -> tuple:
    rec = pickle.loads(packet)
    magic, key, data, entries, segs, blob, live, bundled, owners, where = rec
    if magic != MAGIC:
        raise ValueError("bad magic")
    key = (int(key[0]), bytes(key[1]))
    if not (entries or segs or where or bundled) and blob is None:  # Note [a message with no arrays]
        if len(owners) != 1 or (int(owners[0][0]), bytes(owners[0][1])) != key:
            raise ValueError("the owner is not the sender")
        if type(data) is not bytes:
            raise ValueError(f"the message's pickle is a {type(data).__name__}, not bytes")
        return data, (), (), None, live, 0, (key,), ()
    owners = tuple((int(k[0]), bytes(k[1])) for k in owners)
    if not owners or owners[0] != key:
        raise ValueError("the first owner is not the sender")
    segs = tuple((int(oi), int(s)) for oi, s in segs)
    where = tuple((int(oi), int(j)) for oi, j in where)
    narrays = sum(1 for e in entries if isinstance(e, tuple) and e and e[0] in ("np", "jax"))
    if len(where) != narrays + (blob is not None):
        raise ValueError(f"{len(where)} leases for {narrays + (blob is not None)} slots")
    for oi, s in segs:
        if not 0 <= oi < len(owners) or s < 0:
            raise ValueError(f"segment {s} of owner {oi} is out of range")
    for oi, j in where:
        if not 0 <= oi < len(owners) or not 0 <= j < LEASES:
            raise ValueError(f"lease {j} of owner {oi} is out of range")
    return data, entries, segs, blob, live, int(bundled), owners, where


def decode(packet: bytes, fds: list[int], placement: str, raw: bool = False) -> Any:
    """Rebuild a message: map its segments (once per segment), claim its slots, and unpickle with
    arrays aliasing them. Raises ShmHandleError / TransportError for a corrupt message (its fds
    closed, its slots released).

    ``raw`` (``Connection.recv_bytes``): return the message's pickle (bytes) without unpickling
    it, as the stock ``recv_bytes`` returns a ``send()``'s bytes. A message whose arrays are in
    shared memory comes back as one pickle with the arrays' bytes copied in (``_wire.standalone``:
    ``pickle.loads`` rebuilds the object, as from the stock module's bytes), and its slots are
    given back at once."""
    try:
        data, entries, segs, blob, live, bundled, owners, where = _parse(packet)
    except Exception as e:  # noqa: BLE001 - anything: the packet is garbage
        _close_all(fds)
        raise _garbage(f"{type(e).__name__}: {e}"[:300]) from None
    if not (fds or segs or entries or bundled) and blob is None:  # Note [a message with no arrays]
        c = consumer()
        with c.lock:
            if c.mappers:
                c.apply_releases()
                _forget_dropped(c, owners[0], live)
            c.senders.add(owners[0])
        return data if raw else _wire_module().loads(data, placement)
    if bundled:
        if not fds:
            raise _garbage("a bundle of fds was announced but none came")
        try:
            extra = _unbundle(fds[-1], bundled)
        except BaseException:
            _close_all(fds[:-1])
            raise
        fds = fds[:-1] + extra
    if len(segs) != len(fds):
        _close_all(fds)
        raise _garbage(f"{len(fds)} fds came with a message naming {len(segs)} segments")
    from .. import _wire

    handles = [e[-1] for e in entries if isinstance(e, tuple) and e and e[0] in ("np", "jax")]
    c = consumer()
    with c.lock:
        c.apply_releases()
        with _headers:  # a duplicate fd closed here would drop this process's header locks
            for i, ((oi, s), fd) in enumerate(zip(segs, fds)):
                try:
                    c.mapper(owners[oi]).adopt(s, fd)
                except BaseException:
                    _close_all(fds[i + 1 :])
                    raise
        claimed: list[tuple] = []  # (mapper, token, handle) per slot, in order
        try:
            for h, (oi, j) in zip(handles + ([blob] if blob is not None else []), where):
                m = c.mapper(owners[oi])
                claimed.append((m, _claim(m, h, c, j), h))
            if blob is not None:
                m, tok, _h = claimed.pop()
                mm = m.mapping(int(blob[0]))
                boff, bn = int(blob[1]), int(blob[2])
                data = bytes(memoryview(mm)[boff : boff + bn])
                _write_release(m, tok)
        except BaseException:
            for m, t, _h in claimed:  # no holder exists yet: give every claimed slot back
                _write_release(m, t)
            raise
        if raw:
            try:
                if entries:
                    views = iter(claimed)
                    data = _wire.standalone(data, entries, lambda h: _slot_view(next(views)[0], h))
            finally:
                for m, t, _h in claimed:  # no holder: each claimed slot goes back now
                    _write_release(m, t)
                _forget_dropped(c, owners[0], live)
            return data
        try:
            obj = _wire.decode(data, entries, _Claimed(claimed), placement)  # type: ignore[arg-type]
        except BaseException as e:
            for i in getattr(e, "unheld", ()):
                if i >= len(claimed):
                    continue  # Note [loops that end in a test]
                _write_release(claimed[i][0], claimed[i][1])
            raise
        _forget_dropped(c, owners[0], live)
        c.senders.add(owners[0])
        if fds:  # only a message's fds add kept ones
            c.trim_fds()
        if len(owners) > 1:
            c.trim_foreign()
        busy = any(m.live for m in c.mappers.values())
    if busy:
        c.ensure_thread()
    return obj


def _forget_dropped(c: _Consumer, key, live) -> None:
    """Unmap the sender's segments that it no longer has. Segment ids are never reused, and a
    segment is dropped only when no message or array holds a slot in it; only the newest
    list seen is applied (a list from an older epoch may lack segments made since, which may
    have reached this process forwarded by another: only ids up to the epoch are judged)."""
    try:
        epoch, ids = int(live[0]), live[1]
    except (TypeError, ValueError, IndexError):
        return
    if epoch < c.epochs.get(key, 0):
        return
    c.epochs[key] = epoch
    m = c.mappers.get(key)
    if m is None or not m.segs:
        return
    try:
        ids = set(ids)
    except TypeError:
        return
    gone = [s for s in m.segs if s <= epoch and s not in ids]
    if gone:
        with _headers:
            m.forget(gone)


def _claim(m: _shm.Mapper, h, c: _Consumer, j: int):
    try:
        seg_id, off, nbytes, _gen = (int(x) for x in h)
    except (TypeError, ValueError):
        raise ShmHandleError(
            f"Bad shared-memory handle {h!r}: expected (segment, offset, nbytes, generation)"
        ) from None
    mm = m.mapping(seg_id)
    hoff = off - HEADER
    if hoff < 0 or off + nbytes > len(mm):
        raise ShmHandleError(f"Bad shared-memory handle {h!r}: outside segment {seg_id} of {m.label}")
    loff = hoff + j * _LEASE.size
    serial, released, rpid, _tok = _LEASE.unpack_from(mm, loff)
    if serial == released or rpid:
        raise ShmHandleError(
            f"Bad shared-memory handle {h!r}: lease {j} of its slot in segment {seg_id} of {m.label} is not "
            "in flight (the message was received twice, or is stale or corrupt)"
        )
    struct.pack_into("<QQ", mm, loff + 16, c.pid, c.start)
    return (seg_id, loff, serial)


def _slot_view(m: _shm.Mapper, h) -> memoryview:
    """The bytes of slot ``h`` (already claimed, so within its segment) as a memoryview."""
    seg_id, off, nbytes, _gen = (int(x) for x in h)
    return memoryview(m.mapping(seg_id))[off : off + nbytes]


class _Claimed:
    """The Mappers as ``_wire.decode`` sees them: the message's claimed slots in order, each
    holder's release token naming the lease to write (Note [queue slot lifetime])."""

    __slots__ = ("claimed", "i")

    def __init__(self, claimed: list):
        self.claimed, self.i = claimed, 0

    def holder(self, handle, release=None):
        if self.i >= len(self.claimed):
            raise ShmHandleError(f"Corrupt message: handle {handle!r} is not among the message's slots")
        m, tok, h = self.claimed[self.i]
        if not isinstance(handle, (tuple, list)) or tuple(handle) != tuple(h):
            raise ShmHandleError(f"Corrupt message: handle {handle!r} is not among the message's slots")
        self.i += 1
        return m.holder(handle, tok)
