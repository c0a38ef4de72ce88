"""Sockets that carry messages and fds between processes (Note [message framing]).

Note [message framing]
On Linux a message is one ``SOCK_SEQPACKET`` packet on a Unix socket pair, the fds it names
riding along as SCM_RIGHTS: a packet is atomic, so several processes put and get on one socket
without locks. macOS has no SEQPACKET on Unix sockets (and its ``SOCK_DGRAM`` is capped at 2 KiB
a datagram by default), so there, and in ``JAXTRANSPORT_PLATFORM=portable``, messages go on a
``SOCK_STREAM`` Unix socket pair, each an 8-byte little-endian length and then the bytes, its fds
attached to the first bytes sent (the kernel hands them over with the first bytes read). A
stream is not atomic: where several processes share one (a queue), a writer lock and a reader
lock, process-shared, keep messages whole (:func:`stream_locks`; ``multiprocessing.Queue`` does
the same). Without fd passing (Windows, or ``JAXTRANSPORT_PLATFORM=inband``) the pair is
whatever ``socket.socketpair()`` gives (a TCP pair on Windows) and carries no fds.
Which framing a socket has is read from the socket itself (:func:`is_stream`), so both ends
agree whatever each process's mode is.
"""

from __future__ import annotations

import _socket
import array
import errno
import select
import socket
import struct
import threading
from typing import Any

from . import _mode
from ._pipes import no_delay

__all__ = [
    "DONTWAIT",
    "fd_passing",
    "framing",
    "is_stream",
    "message_socketpair",
    "packet_room",
    "recv_fd",
    "recv_message",
    "send_fd",
    "send_message",
    "stream_locks",
]

_LEN = struct.Struct("<Q")
# The flag that makes one send or receive not wait: MSG_DONTWAIT where the OS has it; elsewhere
# (Windows) a bit of our own, which only streams take (a send raises, a receive checks first).
DONTWAIT: int = int(getattr(socket, "MSG_DONTWAIT", 1 << 30))  # an int: enum flags cost a call per use
_REAL_DONTWAIT = hasattr(socket, "MSG_DONTWAIT")
MAX_MESSAGE = 1 << 40  # a longer length in a stream's header is garbage, not a message


def fd_passing() -> bool:
    """Whether fds can be passed between processes here (Unix sockets with SCM_RIGHTS), and
    the mode allows it (not ``inband``). Both are fixed for the life of the process (the mode
    is read once), so the answer is worked out once: every message asks."""
    global _fd_passing
    if _fd_passing is None:
        _fd_passing = _mode.mode() != _mode.INBAND and all(
            hasattr(socket, n) for n in ("AF_UNIX", "SCM_RIGHTS", "send_fds", "recv_fds")
        )
    return _fd_passing


_fd_passing: bool | None = None


def _seqpacket() -> bool:
    return _mode.mode() == _mode.AUTO and hasattr(socket, "SOCK_SEQPACKET") and fd_passing()


def framing() -> str:
    """What :func:`message_socketpair` makes here: ``"seqpacket"``, ``"stream"`` (Unix, with
    fds) or ``"socketpair"`` (no fd passing)."""
    if _seqpacket():
        return "seqpacket"
    return "stream" if fd_passing() else "socketpair"


def message_socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair for messages (Note [message framing]): Unix SEQPACKET where it exists,
    else a Unix stream, else (no fd passing) the platform's ``socketpair()``."""
    if _seqpacket():
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if fd_passing():
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = no_delay(*socket.socketpair())  # a TCP pair on Windows: no Nagle between header and body
    return a, b


def packet_room() -> int | None:
    """The send buffer of a message socket pair where messages are packets (a packet longer
    than it can never be sent), or None where they are framed on a stream (any length)."""
    if not _seqpacket():
        return None
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return 32 << 10
    try:
        return int(a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
    finally:
        a.close()
        b.close()


def is_stream(sock: socket.socket) -> bool:
    """Whether ``sock`` frames messages itself (a stream), not one packet per message."""
    return _sock_type(sock) == _STREAM


# The socket's type as the int the C object holds: ``socket.type`` converts it to an enum
# member at every read (three enum calls, a tenth of a small message's cost).
_sock_type = _socket.socket.type.__get__
_STREAM = int(socket.SOCK_STREAM)


def stream_locks(ctx: Any, sock: socket.socket) -> tuple[Any, Any]:
    """``(reader lock, writer lock)`` for a socket several processes share: ``ctx.Lock()``s for
    a stream (Note [message framing]), ``(None, None)`` for packets (atomic already)."""
    if is_stream(sock):
        return ctx.Lock(), ctx.Lock()
    return None, None


def _anc(fds) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def _fds_of(anc) -> list[int]:
    got: list[int] = []
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
            got.extend(a)
    return got


def send_message(sock: socket.socket, payload: bytes, fds=(), flags: int = 0) -> None:
    """Send one message with ``fds``. ``flags`` may hold :data:`DONTWAIT`: BlockingIOError when
    it cannot all go at once. On a stream a message once begun must be sent to its end, and
    only the kernel knows whether it will fit, so there MSG_DONTWAIT always raises
    BlockingIOError (the caller's feeder thread sends it, as ``multiprocessing.Queue``'s does):
    a put must never block its own caller on a reader that is that same caller."""
    if not is_stream(sock):
        sock.sendmsg([payload], _anc(fds), flags)
        return
    if flags & DONTWAIT:
        raise BlockingIOError(errno.EAGAIN, "a stream message is sent whole, by a thread that may block")
    head = _LEN.pack(len(payload))
    if fds:
        sent = sock.sendmsg([head], _anc(fds))  # the fds ride on the first bytes
        if sent < len(head):
            _send_rest(sock, memoryview(head)[sent:])
    else:
        _send_rest(sock, memoryview(head))
    _send_rest(sock, memoryview(payload))


def _send_rest(sock: socket.socket, view: memoryview) -> None:
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            select.select([], [sock], [])
            continue
        view = view[n:]


def _recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    out = into if into is not None else bytearray(n)
    view = memoryview(out)[len(out) - n :]
    while view:
        try:
            k = sock.recv_into(view)
        except BlockingIOError:
            select.select([sock], [], [])
            continue
        if not k:
            raise EOFError("the peer closed the socket mid-message")
        view = view[k:]
    return out


_CMSG: dict[int, int] = {}
_TRUNCATED = int(getattr(socket, "MSG_TRUNC", 0)) | int(getattr(socket, "MSG_CTRUNC", 0))


def _cmsg_space(maxfds: int) -> int:
    n = _CMSG.get(maxfds)
    if n is None:
        n = _CMSG[maxfds] = socket.CMSG_SPACE(maxfds * 4 + 64)
    return n


_local = threading.local()


def _packet_buffer(bufsize: int) -> memoryview:
    """This thread's buffer for one packet (Note [packets read into a buffer])."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < bufsize:
        buf = _local.buf = memoryview(bytearray(bufsize))
    return buf


# Note [packets read into a buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A packet is read into a buffer of this thread's, kept from one packet to the next, and
# returned as a view of it: ``recvmsg(bufsize)`` made a new bytes object of the largest size a
# packet may have for every packet, then shrank it; once that size passes the allocator's mmap
# threshold (128 KiB), each small message paid a fresh mapping and its page faults (22 us
# against 7 us for 50 bytes, here). The view is valid until this thread reads its next packet:
# its one reader (``_sharing._parse``) unpickles it at once, and what that makes is its own.
def recv_message(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple[Any, list[int], bool]:
    """One message: ``(bytes, fds, truncated)``; ``(b"", [], False)`` at end of stream. A
    packet comes as a view of this thread's buffer, valid until its next packet (Note [packets
    read into a buffer]).
    ``flags`` may hold :data:`DONTWAIT` (BlockingIOError when none has begun). A packet longer
    than ``bufsize`` is truncated (and says so); a stream message is read whole. ValueError
    (its fds closed) for a stream header no message has: something else wrote to the stream,
    and unlike packets, the messages after it cannot be found again."""
    cmsg = _cmsg_space(maxfds) if fd_passing() else 0
    if not is_stream(sock):
        buf = _packet_buffer(bufsize)
        n, anc, mflags, _ = sock.recvmsg_into([buf], cmsg, flags)
        return buf[:n], _fds_of(anc) if anc else [], bool(mflags & _TRUNCATED)
    if flags & DONTWAIT and not _REAL_DONTWAIT:  # no per-call flag here: look first
        if not select.select([sock], [], [], 0)[0]:
            raise BlockingIOError(errno.EAGAIN, "no message has begun")
        flags &= ~DONTWAIT
    head, anc, mflags, _ = sock.recvmsg(_LEN.size, cmsg, flags) if cmsg else (sock.recv(_LEN.size, flags), [], 0, None)
    fds = _fds_of(anc)
    if not head:
        return b"", fds, False
    try:
        if len(head) < _LEN.size:
            head = bytes(_recv_exact(sock, _LEN.size - len(head), bytearray(head) + bytearray(_LEN.size - len(head))))
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise ValueError(f"a message header announces {n} bytes: not a message (the stream is garbled)")
        body = _recv_exact(sock, n) if n else bytearray()
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    return bytes(body), fds, bool(mflags & socket.MSG_CTRUNC)


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


# -- the Pool's fd channel: fixed-size records, each with one fd


def send_fd(sock: socket.socket, record: bytes, fd: int) -> None:
    """Pass ``fd`` with a fixed-size ``record`` (SCM_RIGHTS). Raises OSError if the peer is
    gone. One thread sends on a channel."""
    socket.send_fds(sock, [record], [fd])


def recv_fd(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    """One fixed-size record and its fds (``b""`` at end of stream). On a stream the rest of a
    record that arrived in parts is read (it is on its way)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, size, 4)
    if data and len(data) < size and is_stream(sock):
        data = bytes(_recv_exact(sock, size - len(data), bytearray(data) + bytearray(size - len(data))))
    return data, fds
