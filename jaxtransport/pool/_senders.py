"""The parent's end of one worker's pipe: a :class:`Sender` that never blocks its caller and a
:class:`FrameReader` that never blocks the manager.

Each worker has its own sender thread, the only thread that may block writing to that worker
(a worker that is busy, stopped or slow to read stalls only its own sender). ``post`` first
tries a non-blocking write from the calling thread when nothing is queued (the common small
message: no thread hop); what does not fit is queued for the sender thread. Segment fds a
message refers to go first, over the worker's fd socket, in the same FIFO.

Frames are ``multiprocessing.connection``'s (a 4-byte big-endian length, or -1 and an 8-byte
length), so the worker keeps reading with ``Connection.recv_bytes``.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
from collections.abc import Sequence

from .. import _lockorder, _shm

_HEADER = struct.Struct("!i")
_HEADER_LONG = struct.Struct("!Q")
_RECV = 1 << 20


def _header(buf, pos: int) -> tuple[int, int] | None:
    """(header length, payload length) of the frame starting at ``buf[pos]``: None while its
    header is incomplete; a payload length of -1 when it is not a frame (a negative length
    other than the long-frame mark)."""
    if len(buf) - pos < 4:
        return None
    (n,) = _HEADER.unpack_from(buf, pos)
    if n == -1:
        if len(buf) - pos < 12:
            return None
        return 12, _HEADER_LONG.unpack_from(buf, pos + 4)[0]
    return 4, (n if n >= 0 else -1)


def _head(n: int) -> bytes:
    return _HEADER.pack(-1) + _HEADER_LONG.pack(n) if n > 0x7FFFFFFF else _HEADER.pack(n)


_JOIN_BELOW = 64 << 10  # messages smaller than this in all are joined into one buffer
_IOV = 512  # buffers per sendmsg (the system's limit is IOV_MAX, 1024 on Linux)


def _pieces(payloads: list) -> list:
    """Frames as buffers to write in order: each header, then its payload as it is (a large
    payload is not copied into a frame; ``sendmsg`` gathers them). A payload may itself be
    buffers (``_protocol.Pieces``): one frame."""
    out = []
    for p in payloads:
        if isinstance(p, tuple):
            out.append(_head(sum(map(len, p))))
            out.extend(p)
        else:
            out.append(_head(len(p)))
            out.append(p)
    if sum(map(len, out)) < _JOIN_BELOW:
        return [b"".join(out)]
    return out


def _advance(pieces: list, n: int) -> list:
    """What is left of ``pieces`` once their first ``n`` bytes are written."""
    i = 0
    while i < len(pieces) and n >= len(pieces[i]):
        n -= len(pieces[i])
        i += 1
    rest = pieces[i:]
    if n:
        rest[0] = memoryview(rest[0])[n:]
    return rest


def _send_some(sock: socket.socket, pieces: list, flags: int = 0) -> list:
    """One ``sendmsg`` of ``pieces``: what is left of them (empty when all went)."""
    return _advance(pieces, sock.sendmsg(pieces[:_IOV], (), flags))


def write_frame(fd: int, payload) -> None:
    """Write one frame (a payload, or its buffers) to the blocking ``fd`` with gathering
    writes (the worker's results: no copy of a large payload into the frame)."""
    pieces = _pieces([payload])
    while pieces:  # EINTR is retried by Python itself (PEP 475)
        pieces = _advance(pieces, os.writev(fd, pieces[:_IOV]))


class Sender:
    """A FIFO of messages to one worker, written by its own thread. ``post`` never blocks."""

    def __init__(self, sock: socket.socket, fdsock: socket.socket, name: str):
        self.sock, self.fdsock = sock, fdsock
        self.cond = _lockorder.condition("Sender.cond")  # guards queue/writing/closed only
        self.queue: collections.deque = collections.deque()
        self.writing = False
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def post(self, payload: bytes | Sequence, segments=()) -> None:
        """Send ``payload`` (one message, or a list of messages sent in one write) after
        passing ``segments`` ((seg_id, size, fd) each; the fd is duplicated here, so the arena
        may close its own at any time)."""
        pieces = _pieces(payload if isinstance(payload, list) else [payload])
        fds = [(seg_id, size, os.dup(fd)) for seg_id, size, fd in segments]
        with self.cond:
            if self.closed:
                _close_fds(fds)
                return
            if not fds and not self.queue and not self.writing:
                try:
                    pieces = _send_some(self.sock, pieces, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self._close_locked()  # the worker is gone: the manager sees its sentinel
                    return
                if not pieces:
                    return
            self.queue.append((pieces, fds))
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                pieces, fds = self.queue.popleft()
                self.writing = True
            try:
                for seg_id, size, fd in fds:
                    _shm.send_segment(self.fdsock, seg_id, size, fd)
                while pieces:  # EINTR is retried by Python itself (PEP 475)
                    pieces = _send_some(self.sock, pieces)
            except OSError:
                with self.cond:
                    self._close_locked()
            finally:
                _close_fds(fds)
                with self.cond:
                    self.writing = False
            del pieces, fds

    def _close_locked(self) -> None:
        self.closed = True
        for _pieces_left, fds in self.queue:
            _close_fds(fds)
        self.queue.clear()
        self.cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Drop what is queued and end the thread (a write in progress ends when the worker
        reads or dies)."""
        with self.cond:
            self._close_locked()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)


def _close_fds(fds) -> None:
    for _seg_id, _size, fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FrameReader:
    """Non-blocking reads of whole frames from one worker: a partly written message (a worker
    stopped mid-write) stays in the buffer and blocks nobody."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def read(self) -> tuple[list[bytes], bool]:
        """(the complete frames available now, whether the worker closed its end)."""
        eof = False
        while True:
            try:
                data = self.sock.recv(_RECV, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not data:
                eof = True
                break
            self.buf += data
            if len(data) < _RECV:
                break
        frames = []
        buf, pos, end = self.buf, 0, len(self.buf)
        while True:
            header = _header(buf, pos)
            if header is None:
                break
            head, n = header
            if n < 0:
                frames.append(b"")  # not a frame: the caller reports a corrupt message
                pos = end
                break
            if end - pos - head < n:
                break
            frames.append(bytes(buf[pos + head : pos + head + n]))
            pos += head + n
        if pos:
            del buf[:pos]
        return frames, eof


class BufferedFrames:
    """The worker's reads of whole frames from its parent, buffered: one ``recv`` takes every
    small message already in the pipe (``Connection.recv_bytes`` costs two system calls per
    message), and a large frame is read straight into a buffer of its own size (no extra copy).

    ``next(timeout)``: the next frame, or None when no byte of one arrives within ``timeout``
    seconds (None: wait). Once a frame has begun it is read to its end, as ``recv_bytes`` does.
    Raises EOFError when the parent's end is closed. A negative length yields ``b""`` (not a
    frame: the caller reports a corrupt message)."""

    CHUNK = 1 << 16

    def __init__(self, fd: int):
        import select

        self.sock = socket.socket(fileno=os.dup(fd))
        self.sock.setblocking(True)
        self.buf = bytearray()
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
            header = _header(buf, 0)
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
            if not buf and timeout is not None and not self.poller.poll(max(0, int(timeout * 1000))):
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
