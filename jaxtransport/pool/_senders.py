"""The parent's end of one worker's pipe: a :class:`Sender` that never blocks its caller and a
:class:`FrameReader` that never blocks the manager (the frames themselves: ``_framing``).

Each worker has its own sender thread, the only thread that may block writing to that worker
(a worker that is busy, stopped or slow to read stalls only its own sender). ``post`` first
tries a non-blocking write from the calling thread when nothing is queued (the common small
message: no thread hop); what does not fit is queued for the sender thread. Segment fds a
message refers to go first, over the worker's fd socket, in the same FIFO.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
from collections.abc import Sequence

from .. import _lockorder, _os, _shm
from ._framing import HEADER, advance, frame_header, pieces

_RECV = 1 << 20  # the most one non-blocking read of a worker's pipe takes


def _send_some(sock: socket.socket, bufs: list) -> list:
    """One write of ``bufs`` (waiting for room): what is left of them (empty when all went)."""
    return advance(bufs, _os.send_some(sock, bufs))


class Sender:
    """A FIFO of messages to one worker, written by its own thread. ``post`` never blocks."""

    def __init__(self, sock: socket.socket, fdsock: socket.socket, name: str):
        self.sock, self.fdsock = sock, fdsock
        self.send_nowait = _os.nowait_sender(sock)
        # Guards queue/writing/closed only; the thread parks on it (Note [waits a Ctrl-C
        # cannot break] in _lockorder: post() runs in the caller's thread, a Ctrl-C there
        # cannot leave it held).
        self.cond = self.mutex = _lockorder.condition("Sender.cond")
        self.queue: collections.deque = collections.deque()
        self.writing = False
        self.closed = False
        # Set just before post() writes or queues anything (Note [a Ctrl-C while dispatching]
        # in _engine): cleared by a dispatching caller first, it says whether an interrupted
        # post() did anything at all.
        self.committed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def post(self, payload: bytes | Sequence, segments=()) -> None:
        """Send ``payload`` (one message, or a list of messages sent in one write) after
        passing ``segments`` ((seg_id, size, fd) each; the fd is duplicated here, so the arena
        may close its own at any time)."""
        out = pieces(payload if isinstance(payload, list) else [payload])
        fds = [(seg_id, size, os.dup(fd)) for seg_id, size, fd in segments] if segments else []
        with self.mutex:
            if self.closed:
                _close_fds(fds)
                return
            if not fds and not self.queue and not self.writing:
                try:
                    self.committed = True  # no call between this and the write
                    sent = self.send_nowait(out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    self._close_locked()  # the worker is gone: the manager sees its sentinel
                    return
                if len(out) == 1 and sent == len(out[0]):
                    return  # the common small message: all of it went
                out = advance(out, sent)
                if not out:
                    return
            self.committed = True  # no call between this and the append
            self.queue.append((out, fds))
            self.cond.wake_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                if self.closed:
                    return
                item = self.queue.popleft() if self.queue else None
                if item is None:
                    ticket = self.cond.park()
                else:
                    self.writing = True
            if item is None:
                _lockorder.sleep(ticket)
                continue
            left, fds = item
            try:
                for seg_id, size, fd in fds:
                    _shm.send_segment(self.fdsock, seg_id, size, fd)
                while True:  # EINTR is retried by Python itself (PEP 475)
                    if not left:
                        break
                    left = _send_some(self.sock, left)
            except OSError:
                with self.cond:
                    self._close_locked()
            finally:
                _close_fds(fds)
                with self.cond:
                    self.writing = False
            del item, left, fds

    def _close_locked(self) -> None:
        self.closed = True
        for _pieces_left, fds in self.queue:
            _close_fds(fds)
        self.queue.clear()
        self.cond.wake_all()

    def close(self, timeout: float = 5.0) -> None:
        """Drop what is queued and end the thread (a write in progress ends when the worker
        reads or dies)."""
        with self.cond:
            self._close_locked()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)


_SCRATCH = 64 << 10  # the first read of a worker's pipe: results without arrays are small
_local = threading.local()


def _buffer(name: str, size: int) -> tuple[bytearray, memoryview]:
    """This thread's read buffer ``name`` of ``size`` bytes (the manager's, in practice), made
    at its first use: ``small`` for every first read, ``large`` for the rest of a long message."""
    try:
        return getattr(_local, name)
    except AttributeError:
        b = bytearray(size)
        pair = (b, memoryview(b))
        setattr(_local, name, pair)
        return pair


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
        self.recv_into = _os.nowait_receiver(sock)
        self.buf = bytearray()

    def read(self) -> tuple[list[bytes], bool]:
        """(the complete frames available now, whether the worker closed its end)."""
        eof = False
        recv_into, buf = self.recv_into, self.buf
        scratch, view = _buffer("small", _SCRATCH)
        room = len(scratch)
        while True:  # into one buffer kept per thread: no allocation per read
            try:
                k = recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not k:
                eof = True
                break
            buf += view[:k]
            if k < room:
                break
            if room < _RECV:  # a long message: read the rest in larger steps
                scratch, view = _buffer("large", _RECV)
                room = _RECV
        frames = []
        buf, pos, end = self.buf, 0, len(self.buf)
        unpack = HEADER.unpack_from
        while True:
            if end - pos >= 4:  # a short header (frame_header, inline: a call per result costs)
                (n,) = unpack(buf, pos)
                if n >= 0:
                    if end - pos - 4 < n:
                        break
                    frames.append(bytes(buf[pos + 4 : pos + 4 + n]))
                    pos += 4 + n
                    continue
            header = frame_header(buf, pos)
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
