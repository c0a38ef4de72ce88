"""The Pool's pipes to its workers: waiting, non-blocking writes and reads (Note [pipe io]).

Note [pipe io]
Where POSIX I/O exists (``select.poll``, ``os.writev``, ``sendmsg`` and ``MSG_DONTWAIT``: Linux,
macOS), a worker's pipe is ``multiprocessing``'s duplex ``Pipe`` (a Unix socket pair): the parent
holds a blocking socket over it and makes each write non-blocking per call (``MSG_DONTWAIT``),
gathering buffers with ``sendmsg``; the manager waits with ``select.poll`` over fds (the wake
pipe is an ``os.pipe``); the worker writes with ``os.writev``.

Elsewhere (Windows has none of those; its ``Pipe`` is a named pipe, which no socket call or
``select`` accepts), and in ``JAXTRANSPORT_PLATFORM=inband``, each pipe is a ``socketpair()``
(a TCP loopback pair on Windows), passed to the worker as a socket (``multiprocessing`` pickles
it with ``DupSocket`` on Windows): the parent's end is non-blocking for good, and a write that
must wait (the sender thread's) waits in ``select()`` for room; the manager waits on a selector
kept over the sockets (``select()`` on Windows) and looks at the workers' process handles with
``multiprocessing.connection.wait`` now and then (:class:`Poller`); the wake pipe is a socket
pair; the worker's end stays blocking and it writes with ``sendall``. Nothing here passes
fds (in-band mode).

Process liveness follows the same split: ``os.kill(pid, 0)`` probes a process only where
``os.kill`` is POSIX ``kill(2)`` (:func:`kill_probes`: ``os.killpg`` exists); on Windows
``os.kill`` *terminates* the process for any signal number, so a worker there watches its
parent through ``multiprocessing.parent_process().sentinel`` (a process handle) instead.
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from . import _mode

__all__ = [
    "IOV",
    "Poller",
    "Wake",
    "advance",
    "kill_probes",
    "nowait_receiver",
    "nowait_sender",
    "parent_socket",
    "posix_io",
    "send_some",
    "wait_readable",
    "worker_pipe",
    "worker_reader_socket",
    "worker_writer",
]

IOV = 512  # buffers per sendmsg (the system's limit is IOV_MAX, 1024 on Linux)
# Handles per multiprocessing.connection.wait: on Windows one wait takes at most 63 (the
# system's MAXIMUM_WAIT_OBJECTS, 64), so a pool of more workers looks at them in groups.
WAIT_HANDLES = 60

_POSIX: bool | None = None


def posix_io() -> bool:
    """Whether the Pool's pipes use POSIX I/O here (Note [pipe io]): probed once per process."""
    global _POSIX
    if _POSIX is None:
        _POSIX = (
            _mode.mode() != _mode.INBAND
            and hasattr(select, "poll")
            and hasattr(os, "writev")
            and hasattr(socket, "MSG_DONTWAIT")
            and hasattr(socket.socket, "sendmsg")
            and hasattr(socket, "AF_UNIX")
        )
    return _POSIX


def kill_probes() -> bool:
    """Whether ``os.kill(pid, 0)`` only probes ``pid`` (POSIX ``kill(2)``). False on Windows,
    where ``os.kill`` terminates the process whatever the signal number."""
    return hasattr(os, "killpg")


# -- the parent's side


def worker_pipe(ctx: Any) -> tuple[Any, Any]:
    """``(parent end, child end)`` of a new worker's pipe. The child end goes into the
    worker ``Process``'s arguments; the parent closes its copy once the process started."""
    if posix_io():
        return ctx.Pipe(duplex=True)
    a, b = no_delay(*socket.socketpair())
    return a, b


def no_delay(*socks: socket.socket) -> tuple[socket.socket, ...]:
    """``socks``, with Nagle's algorithm off where they are TCP (Windows' ``socketpair()`` is a
    loopback TCP pair): a frame's header and payload are separate sends there, and Nagle would
    hold the second back for the peer's delayed ACK (40-200 ms)."""
    for s in socks:
        if s.family in (socket.AF_INET, getattr(socket, "AF_INET6", None)):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def parent_socket(parent_end: Any) -> socket.socket:
    """The parent's socket over its end of a worker's pipe: a blocking socket of its own over
    the ``Connection``'s fd (POSIX: each call chooses to wait or not), or the socket itself made
    non-blocking (elsewhere)."""
    if posix_io():
        return socket.socket(fileno=os.dup(parent_end.fileno()))
    parent_end.setblocking(False)
    return parent_end


def nowait_sender(sock: socket.socket) -> Callable[[list], int]:
    """``send(bufs)``: writes what fits of ``bufs`` now, without waiting, and returns the bytes
    written (BlockingIOError when nothing fits). Built once per socket: a call per message."""
    if posix_io():
        sendmsg, dontwait = sock.sendmsg, socket.MSG_DONTWAIT
        return lambda bufs: sendmsg(bufs[:IOV], (), dontwait)
    send = sock.send
    return lambda bufs: send(bufs[0])


def send_some(sock: socket.socket, bufs: list) -> int:
    """Write some of ``bufs``, waiting for room if there is none: the bytes written."""
    if posix_io():
        return sock.sendmsg(bufs[:IOV])
    while True:
        try:
            return sock.send(bufs[0])
        except BlockingIOError:
            select.select([], [sock], [])


def nowait_receiver(sock: socket.socket) -> Callable[[Any], int]:
    """``recv_into(buf)``: reads up to ``len(buf)`` bytes already there into ``buf`` and returns
    how many (BlockingIOError: none; 0: the peer closed). Built once per socket. Into a buffer
    the caller keeps: a ``recv(n)`` allocates ``n`` bytes each call, and above malloc's mmap
    threshold that is an mmap, page faults, an mremap and a munmap per message (10 us)."""
    if posix_io():
        recv_into, dontwait = sock.recv_into, socket.MSG_DONTWAIT
        return lambda buf: recv_into(buf, 0, dontwait)
    return sock.recv_into


class Wake:
    """A self-pipe: :meth:`set` from any thread wakes a :class:`Poller` waiting on
    :attr:`waitable`. An ``os.pipe`` with POSIX I/O, a socket pair elsewhere."""

    def __init__(self) -> None:
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        if posix_io():
            self._r, self._w = os.pipe()
            os.set_blocking(self._w, False)
            self.waitable: Any = self._r
        else:
            r, w = no_delay(*socket.socketpair())
            r.setblocking(False)
            w.setblocking(False)
            self._sockets = (r, w)
            self._r = self._w = -1
            self.waitable = r
        self.closed = False

    def set(self) -> None:
        if self.closed:
            return  # never write to a number the OS may have reused
        try:
            if self._sockets is None:
                os.write(self._w, b"x")
            else:
                self._sockets[1].send(b"x")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed

    def drain(self) -> None:
        try:
            if self._sockets is None:
                os.read(self._r, 4096)
            else:
                self._sockets[0].recv(4096)
        except OSError:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._sockets is not None:
            for s in self._sockets:
                s.close()
            return
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class Poller:
    """Waits until some of the registered waitables (fds, sockets, process sentinels) are
    readable. With POSIX I/O: one ``select.poll`` over all of them. Elsewhere: a selector kept
    over the sockets (``select()`` on Windows, which takes sockets only), and the others
    (process handles) looked at with ``multiprocessing.connection.wait`` when the sockets had
    nothing, or every :attr:`OTHERS_S` seconds: a worker that dies closes its socket (EOF:
    readable at once), so its handle is the second word, and a wait over every handle per
    message (Windows' overlapped reads) would cost more than the message."""

    OTHERS_S = 0.05

    def __init__(self) -> None:
        self._fds: dict[int, Any] = {}  # fd -> key (POSIX)
        self._poll = select.poll() if posix_io() else None
        self._sel: selectors.BaseSelector | None = None if posix_io() else selectors.DefaultSelector()
        self._others: dict[Any, Any] = {}  # not a socket -> key (elsewhere)
        self._others_at = 0.0

    def set(self, wanted: dict) -> None:
        """Wait on exactly ``wanted`` (waitable -> key) from now on."""
        if self._poll is not None:
            for fd in self._fds:
                try:
                    self._poll.unregister(fd)
                except (KeyError, ValueError, OSError):
                    pass
            self._fds = {}
            for waitable, key in wanted.items():
                fd = waitable if isinstance(waitable, int) else waitable.fileno()
                self._poll.register(fd, select.POLLIN)
                self._fds[fd] = key
            return
        assert self._sel is not None
        for sk in list(self._sel.get_map().values()):
            self._sel.unregister(sk.fileobj)
        self._others = {}
        for waitable, key in wanted.items():
            if isinstance(waitable, socket.socket):
                self._sel.register(waitable, selectors.EVENT_READ, key)
            else:
                self._others[waitable] = key

    def close(self) -> None:
        """Release the selector (its fd, where it has one)."""
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        self._poll = None

    def poll(self, timeout_s: float) -> list:
        """The keys of the waitables ready within ``timeout_s`` seconds (empty: none)."""
        if self._poll is not None:
            try:
                events = self._poll.poll(timeout_s * 1000)
            except InterruptedError:
                return []
            fds = self._fds
            return [fds[fd] for fd, _ev in events if fd in fds]
        assert self._sel is not None
        try:
            keys = [sk.data for sk, _ev in self._sel.select(timeout_s)]
        except InterruptedError:
            keys = []
        if self._others:
            now = time.monotonic()
            if not keys or now - self._others_at >= self.OTHERS_S:
                self._others_at = now
                from multiprocessing.connection import wait

                others = list(self._others)
                for i in range(0, len(others), WAIT_HANDLES):
                    keys += [self._others[o] for o in wait(others[i : i + WAIT_HANDLES], 0)]
        return keys


# -- the worker's side


def worker_reader_socket(conn: Any) -> socket.socket:
    """The worker's blocking socket for reading its pipe: its own over the ``Connection``'s fd
    (POSIX) or the pipe's socket itself."""
    if isinstance(conn, socket.socket):
        conn.setblocking(True)
        return conn
    return socket.socket(fileno=os.dup(conn.fileno()))


def wait_readable(sock: socket.socket, timeout: float, poller: Any = None) -> bool:
    """Whether ``sock`` is readable within ``timeout`` seconds. ``poller``: a ``select.poll``
    with ``sock`` registered (POSIX; built by the caller once), else ``select()``."""
    if poller is not None:
        return bool(poller.poll(max(0, int(timeout * 1000))))
    return bool(select.select([sock], [], [], max(0.0, timeout))[0])


def worker_writer(conn: Any):
    """A function writing bytes-like buffers, in order and whole, to the worker's pipe
    (blocking): ``os.writev`` on the ``Connection``'s fd (POSIX), ``sendall`` on the socket."""
    if isinstance(conn, socket.socket):
        sendall = conn.sendall

        def write(bufs: list) -> None:
            for b in bufs:
                sendall(b)

        return write
    fd = conn.fileno()
    write1, writev_ = os.write, os.writev

    def writev(bufs: list) -> None:
        if len(bufs) == 1:  # the common small message: one write
            n = write1(fd, bufs[0])
            if n == len(bufs[0]):
                return
            left = [memoryview(bufs[0])[n:]]
        else:
            left = bufs
        while left:  # EINTR is retried by Python itself (PEP 475)
            left = advance(left, writev_(fd, left[:IOV]))

    return writev


def advance(bufs: list, n: int) -> list:
    """What is left of ``bufs`` once their first ``n`` bytes are written."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if n:
        rest[0] = memoryview(rest[0])[n:]
    return rest
