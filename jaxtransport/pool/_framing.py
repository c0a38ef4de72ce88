"""The frames on a Pool's pipes, written and read at both ends.

Frames are ``multiprocessing.connection``'s (a 4-byte big-endian length, or -1 and an 8-byte
length), so either end could still read them with ``Connection.recv_bytes``. The parent's
``_senders.Sender`` and ``_senders.FrameReader`` build and parse them with
:func:`pieces` and :func:`frame_header`; the worker writes with :func:`write_frame` and reads
with :class:`BufferedFrames` (the system calls under both: Note [pipe io] in ``_os``).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from .._os import IOV, advance, wait_readable, worker_reader_socket

__all__ = ["HEADER", "IOV", "BufferedFrames", "advance", "frame_header", "pieces", "write_frame"]

HEADER = struct.Struct("!i")  # a frame's length (-1: a long frame, its length follows)
_HEADER_LONG = struct.Struct("!Q")


def frame_header(buf, pos: int) -> tuple[int, int] | None:
    """(header length, payload length) of the frame starting at ``buf[pos]``: None while its
    header is incomplete; a payload length of -1 when it is not a frame (a negative length
    other than the long-frame mark)."""
    if len(buf) - pos < 4:
        return None
    (n,) = HEADER.unpack_from(buf, pos)
    if n == -1:
        if len(buf) - pos < 12:
            return None
        return 12, _HEADER_LONG.unpack_from(buf, pos + 4)[0]
    return 4, (n if n >= 0 else -1)


def _head(n: int) -> bytes:
    return HEADER.pack(-1) + _HEADER_LONG.pack(n) if n > 0x7FFFFFFF else HEADER.pack(n)


_JOIN_BELOW = 64 << 10  # messages smaller than this in all are joined into one buffer


def pieces(payloads: list) -> list:
    """Frames as buffers to write in order: each header, then its payload as it is (a large
    payload is not copied into a frame; ``sendmsg`` gathers them). A payload may itself be
    buffers (``_protocol.Pieces``): one frame."""
    out: list = []
    append, pack = out.append, HEADER.pack
    for p in payloads:
        if isinstance(p, tuple):
            out.append(_head(sum(map(len, p))))
            out.extend(p)
        else:
            n = len(p)
            append(pack(n) if n <= 0x7FFFFFFF else _head(n))
            append(p)
    if sum(map(len, out)) < _JOIN_BELOW:
        return [b"".join(out)]
    return out


def write_frame(write: Callable[[list], None], payload) -> None:
    """Write one frame (a payload, or its buffers) with ``write`` (``_os.worker_writer``: whole
    and in order, gathering buffers where the OS can: no copy of a large payload into the
    frame)."""
    if type(payload) is bytes and len(payload) < _JOIN_BELOW:  # the common small message
        write([HEADER.pack(len(payload)) + payload])
    else:
        write(pieces([payload]))


class BufferedFrames:
    """The worker's reads of whole frames from its parent, buffered: one ``recv`` takes every
    small message already in the pipe (``Connection.recv_bytes`` costs two system calls per
    message), and a large frame is read straight into a buffer of its own size (no extra copy).

    ``next(timeout)``: the next frame, or None when no byte of one arrives within ``timeout``
    seconds (None: wait). Once a frame has begun it is read to its end, as ``recv_bytes`` does.
    Raises EOFError when the parent's end is closed. A negative length yields ``b""`` (not a
    frame: the caller reports a corrupt message)."""

    CHUNK = 1 << 16

    def __init__(self, conn):
        import select

        self.sock = worker_reader_socket(conn)  # blocking (Note [pipe io] in _os)
        self.buf = bytearray()
        self.poller = None
        if not isinstance(conn, socket.socket):  # a POSIX Pipe's Connection: poll its fd
            self.poller = select.poll()
            self.poller.register(self.sock.fileno(), select.POLLIN)

    def _recv(self) -> None:
        data = self.sock.recv(self.CHUNK)
        if not data:
            raise EOFError("the parent closed the pipe")
        self.buf += data

    def next(self, timeout: float | None) -> bytes | bytearray | None:
        buf = self.buf
        while True:
            header = frame_header(buf, 0)
            if header is not None:
                head, n = header
                if n < 0:
                    buf.clear()
                    return b""
                if len(buf) >= head + n:
                    out = bytes(buf[head : head + n])
                    del buf[: head + n]
                    return out
                if head + n - len(buf) > self.CHUNK:
                    return self._read_large(head, n)
                self._recv()
                continue
            if not buf and timeout is not None and not wait_readable(self.sock, timeout, self.poller):
                return None
            self._recv()

    def _read_large(self, head: int, n: int) -> bytearray:
        out = bytearray(n)
        have = len(self.buf) - head
        out[:have] = self.buf[head:]
        self.buf.clear()
        view = memoryview(out)[have:]
        while view:
            k = self.sock.recv_into(view)
            if not k:
                raise EOFError("the parent closed the pipe mid-message")
            view = view[k:]
        view.release()
        return out

    def close(self) -> None:
        self.sock.close()
