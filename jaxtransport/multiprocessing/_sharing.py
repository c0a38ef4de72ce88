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

    (MAGIC, producer, data | None, entries, segs, blob, live, bundled)

- ``producer``: ``(pid, token)`` of the sending process (its slots' owner).
- ``data``, ``entries``: what ``jaxtransport._wire`` made of the object: the pickle and the arrays set
  aside into slots of the sender's :class:`~jaxtransport._shm.Arena` (the same encoder as the
  Pool, so the same dtypes, weak types, PRNG keys and shardings).
- ``segs``: the segment id of each fd in the packet, in order.
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
the Pool's workers do. Instead every slot starts with a 64-byte header in the shared memory
itself::

    [0:8) serial (written by the sender at put)   [8:16) released serial (written by the receiver)
    [16:24) receiver pid                          [24:32) receiver token (start time: pid reuse)

The receiver writes its pid when it takes the message, wraps each slot in a per-transfer holder as
the Pool does (Note [slot lifetime] in ``_shm``), and writes ``released = serial`` when the last
array over the slot is gone (a background thread in the receiver applies releases and runs
``collect_deferred``). The sender frees slots whose header says released, and, when it runs out
of capacity, also slots whose receiver process is dead. A slot whose message nobody has taken
stays held: a producer that outpaces its consumers waits for releases, then raises
ShmCapacityError.
"""

from __future__ import annotations

import array
import collections
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

from .. import _os, _shm
from .._errors import ShmCapacityError, ShmHandleError, TransportError
from .._nojax import find_tracer
from .._pickling import PICKLE_PROTOCOL

MAGIC = "jaxtransport.mp/1"
HEADER = 64  # bytes before each slot's data (Note [queue slot lifetime])
_HDR = struct.Struct("<QQQQ")
MAX_PACKET = 32 << 10  # larger pickles travel in a slot (Note [queue messages])
RECV_BUF = 64 << 10
MAX_FDS = 250  # SCM_MAX_FD is 253
_MAX_LIVE_LISTED = 64
_CAPACITY_GRACE_S = 10.0  # how long a put waits without any release before giving up
_RELEASE_POLL_S = 0.02


def _proc_start(pid: int) -> int | None:
    """A token of the live process ``pid``, None if it is gone (``_os.process_token``: its
    start time where ``/proc`` exists, so a reused pid reads differently)."""
    return _os.process_token(pid)


# --------------------------------------------------------------------------------------------
# sender side


class _HeaderArena:
    """The process's Arena seen by ``_wire.commit``: every slot gets HEADER bytes in front."""

    def __init__(self, producer: Producer):
        self.p = producer

    def alloc(self, nbytes, borrower, wait=None):
        return self.p.alloc(nbytes, wait)

    def release(self, handle, borrower, count=1):
        self.p.drop(handle)
        return True


class Producer:
    """The sending half of this process: one Arena for every queue and pipe it sends on."""

    def __init__(self, capacity: int | None):
        self.pid = os.getpid()
        self.key = (self.pid, secrets.token_bytes(8))
        self.arena = _shm.Arena(capacity, label=f"process {self.pid} (jaxtransport.multiprocessing)")
        self.lock = threading.Lock()
        self.serials = iter(range(1, 1 << 62))
        # data handle -> (arena handle, serial); oldest first
        self.outstanding: collections.OrderedDict = collections.OrderedDict()
        self.frees = 0  # slots freed so far (progress, for waiting puts)
        self.adapter = _HeaderArena(self)

    def alloc(self, nbytes: int, wait):
        # Releases are written into the slot headers; look at all of them while few are
        # outstanding (cheap), else at the oldest ones, so a free slot is found before a new
        # segment (fresh pages) is made.
        self.reap(None if len(self.outstanding) <= 256 else 64)
        handle, view = self.arena.alloc(nbytes + HEADER, "q", wait)
        with self.lock:
            serial = next(self.serials)
            _HDR.pack_into(view, 0, serial, 0, 0, 0)
            data = (handle.seg, handle.offset + HEADER, nbytes, handle.gen)  # travels as a plain tuple
            self.outstanding[data] = (handle, serial)
        return data, view[HEADER:]

    def drop(self, data_handle) -> None:
        """Free a slot at once (its message was never sent)."""
        with self.lock:
            rec = self.outstanding.pop(tuple(data_handle), None)
        if rec is not None:
            self.arena.release(rec[0], "q")

    def reap(self, limit: int | None = None, dead_too: bool = False) -> int:
        """Free slots whose receiver released them (and, with ``dead_too``, slots whose receiver
        died). Looks at most ``limit`` slots, oldest first (all when None). Returns slots freed."""
        freed = []
        starts: dict[int, int | None] = {}
        with self.lock:
            n = len(self.outstanding) if limit is None else min(limit, len(self.outstanding))
            keep = []
            for _ in range(n):
                data, rec = self.outstanding.popitem(last=False)
                seg = self.arena.segment(data[0])
                free = seg is None or seg.mm is None
                if not free:
                    _serial, released, rpid, rstart = _HDR.unpack_from(seg.mm, rec[0][1])  # type: ignore[union-attr]
                    free = released == rec[1]
                    if not free and dead_too and rpid:
                        if rpid not in starts:
                            starts[rpid] = _proc_start(rpid)
                        free = starts[rpid] != rstart
                if free:
                    freed.append(rec[0])
                else:
                    keep.append((data, rec))
            for data, rec in keep:
                self.outstanding[data] = rec
        for h in freed:
            self.arena.release(h, "q")
        if freed:
            self.frees += len(freed)
        return len(freed)

    def waiter(self, timeout: float | None):
        """An Arena wait hook for one put: wait while receivers keep releasing memory (or until
        ``timeout``), checking for released slots and dead receivers."""
        start = time.monotonic()
        state = {"progress": start, "frees": self.frees}

        def wait():  # called with no lock held (Arena.alloc)
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
        [queue messages]); None when there are too many to list cheaply."""
        segs = self.arena.segments()
        if len(segs) > _MAX_LIVE_LISTED:
            return None
        return (self.arena.last_segment_id, tuple(s.seg_id for s in segs))

    def held(self) -> tuple[int, int, int]:
        """(slots not yet released, of which taken by a receiver, bytes)."""
        with self.lock:
            items = list(self.outstanding.items())
        taken = nbytes = 0
        for data, rec in items:
            seg = self.arena.segment(data[0])
            nbytes += data[2]
            if seg is not None and seg.mm is not None and _HDR.unpack_from(seg.mm, rec[0][1])[2]:
                taken += 1
        return len(items), taken, nbytes


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
    a bundle socket this message closes once sent or discarded)."""

    __slots__ = ("fds", "handles", "owned", "packet")

    def __init__(self, packet, fds, handles, owned=()):
        self.packet, self.fds, self.handles, self.owned = packet, fds, handles, list(owned)

    def sent(self) -> None:
        _close_all(self.owned)
        self.owned = []

    def discard(self) -> None:
        self.sent()
        p = producer()
        for h in self.handles:
            p.drop(h)
        self.handles = ()


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
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
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
    from .. import _wire

    if _os.in_band():  # no shared memory to pass here: everything inside the pickle
        _os.warn_in_band("jaxtransport.multiprocessing")
        threshold = _os.IN_BAND_THRESHOLD
    return _wire.prepare(obj, threshold=threshold, locate=_locate(obj, root))


def commit(prep, timeout: float | None = None) -> Outgoing:
    """Phase 2, in the caller: copy the set-aside arrays into this process's shared memory (may
    wait for receivers to release memory, see Producer.waiter) and build the packet."""
    from .. import _wire

    p = producer()
    if _consumer is not None and _consumer.pid == p.pid:
        _consumer.apply_releases()  # what this process received and dropped, before allocating
    try:
        enc = _wire.commit(prep, arena=p.adapter, borrower="q", wait=p.waiter(timeout))  # type: ignore[arg-type]
    except ShmCapacityError as e:
        raise _capacity_error(p, e) from None
    handles = list(enc.handles)
    try:
        data, blob = enc.data, None
        if len(data) > MAX_PACKET - 1024 - 64 * len(enc.entries) and not _os.in_band():
            try:
                blob, view = p.alloc(len(data), p.waiter(timeout))
            except ShmCapacityError as e:
                raise _capacity_error(p, e) from None
            handles.append(blob)
            view[: len(data)] = np.frombuffer(data, np.uint8)
            data = None
        segs = sorted({_shm.Handle(*h).seg for h in handles})
        fds = []
        for s in segs:
            seg = p.arena.segment(s)
            if seg is None or seg.fd is None:
                raise ShmHandleError(f"segment {s} of this process's shared memory was closed while sending")
            fds.append(seg.fd)
        owned, bundled = [], 0
        if len(fds) > MAX_FDS:  # more than one packet may carry: the rest travel in a bundle
            bundled = len(fds) - (MAX_FDS - 1)
            owned.append(_bundle(fds[MAX_FDS - 1 :]))
            fds = fds[: MAX_FDS - 1] + owned
        packet = pickle.dumps(
            (MAGIC, p.key, data, enc.entries, tuple(segs), blob, p.live_segments(), bundled), protocol=PICKLE_PROTOCOL
        )
    except BaseException:
        for h in handles:
            p.drop(h)
        raise
    return Outgoing(packet, fds, handles, owned)


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
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def mapper(self, key) -> _shm.Mapper:
        m = self.mappers.get(key)
        if m is None:
            m = self.mappers[key] = _shm.Mapper(None, label=f"process {key[0]}")
        return m

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
        self.wake.set()


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
            wake = None
        else:
            wake = c.wake
            wake.clear()
        del c
        if wake is None:
            time.sleep(_RELEASE_POLL_S)
        else:
            wake.wait(1.0)


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
        rec = pickle.loads(packet)
        magic, key, data, entries, segs, blob, live, bundled = rec
        if magic != MAGIC:
            raise ValueError("bad magic")
        key = (int(key[0]), bytes(key[1]))
        segs = tuple(int(s) for s in segs)
        bundled = int(bundled)
    except Exception as e:  # noqa: BLE001 - anything: the packet is garbage
        _close_all(fds)
        raise _garbage(f"{type(e).__name__}: {e}"[:300]) from None
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

    c = consumer()
    with c.lock:
        c.apply_releases()
        m = c.mapper(key)
        for i, (s, fd) in enumerate(zip(segs, fds)):
            try:
                m.adopt(s, fd)
            except BaseException:
                _close_all(fds[i + 1 :])
                raise
        handles = [e[-1] for e in entries if isinstance(e, tuple) and e and e[0] in ("np", "jax")]
        tokens = []
        try:
            for h in handles + ([blob] if blob is not None else []):
                tokens.append(_claim(m, h, c))
            if blob is not None:
                mm = m.mapping(int(blob[0]))
                boff, bn = int(blob[1]), int(blob[2])
                data = bytes(memoryview(mm)[boff : boff + bn])
                _write_release(m, tokens.pop())
        except BaseException:
            for t in tokens:  # no holder exists yet: give every claimed slot back
                _write_release(m, t)
            raise
        if raw:
            try:
                if entries:
                    data = _wire.standalone(data, entries, lambda h: _slot_view(m, h))
            finally:
                for t in tokens:  # no holder: each claimed slot goes back now
                    _write_release(m, t)
                _forget_dropped(c, key, m, live)
            return data
        releases = {tuple(h): t for h, t in zip(handles, tokens)}
        try:
            obj = _decode_entries(_wire, data, entries, m, placement, releases)
        except BaseException as e:
            for i in getattr(e, "unheld", ()):
                h = entries[i][-1] if i < len(entries) else None
                t = releases.get(tuple(h)) if isinstance(h, tuple) else None
                if t is not None:
                    _write_release(m, t)
            raise
        _forget_dropped(c, key, m, live)
    if m.live:
        c.ensure_thread()
    return obj


def _forget_dropped(c: _Consumer, key, m: _shm.Mapper, live) -> None:
    """Unmap the sender's segments that it no longer has. Segment ids are never reused, and a
    segment is dropped only when no message or array holds a slot in it; only the newest
    list seen is applied (a list from an older epoch may lack segments made since)."""
    try:
        epoch, ids = int(live[0]), set(live[1])
    except (TypeError, ValueError, IndexError):
        return
    if epoch < c.epochs.get(key, 0):
        return
    c.epochs[key] = epoch
    gone = [s for s in m.segs if s not in ids]
    if gone:
        m.forget(gone)


def _claim(m: _shm.Mapper, h, c: _Consumer):
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
    serial = struct.unpack_from("<Q", mm, hoff)[0]
    struct.pack_into("<QQ", mm, hoff + 16, c.pid, c.start)
    return (seg_id, hoff, serial)


def _slot_view(m: _shm.Mapper, h) -> memoryview:
    """The bytes of slot ``h`` (already claimed, so within its segment) as a memoryview."""
    seg_id, off, nbytes, _gen = (int(x) for x in h)
    return memoryview(m.mapping(seg_id))[off : off + nbytes]


class _Claimed:
    """The Mapper as ``_wire.decode`` sees it: each holder's release token names the slot
    header to write (Note [queue slot lifetime])."""

    __slots__ = ("m", "tokens")

    def __init__(self, m: _shm.Mapper, tokens: dict):
        self.m, self.tokens = m, tokens

    def holder(self, handle, release=None):
        tok = self.tokens.get(tuple(handle)) if isinstance(handle, (tuple, list)) else None
        if tok is None:
            raise ShmHandleError(f"Corrupt message: handle {handle!r} is not among the message's slots")
        return self.m.holder(handle, tok)


def _decode_entries(_wire, data, entries, m: _shm.Mapper, placement: str, releases: dict):
    return _wire.decode(data, entries, _Claimed(m, releases), placement)
