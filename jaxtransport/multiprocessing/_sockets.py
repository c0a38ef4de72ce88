"""The socket ends that ``Queue``, ``SimpleQueue`` and ``Pipe`` share: checking their options,
making and inheriting a message socket pair (``SOCK_SEQPACKET`` on Linux, a framed stream
elsewhere: Note [message framing] in ``_os``), and waiting for and taking one message (its
format and its fds: Note [queue messages] in ``_sharing``)."""

from __future__ import annotations

import queue
import select
import socket
import time
from typing import Any

from .. import _nojax, _os
from . import _sharing

__all__ = ["check_options", "socket_from", "socket_handle", "socketpair", "take_packet", "wait_readable"]


def check_options(shm_threshold: Any, placement: Any) -> None:
    """ValueError unless ``shm_threshold`` is a non-negative int and ``placement`` a placement."""
    if not isinstance(shm_threshold, int) or isinstance(shm_threshold, bool) or shm_threshold < 0:
        raise ValueError(f"shm_threshold must be a non-negative int (bytes), got {shm_threshold!r}")
    _nojax.check_placement(placement)


def wait_readable(sock: socket.socket, deadline: float | None) -> bool:
    """Whether ``sock`` has a packet (or EOF) before ``deadline`` (``time.monotonic()``; None:
    wait for ever)."""
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            r, _, _ = select.select([sock], [], [], left)
        except InterruptedError:
            continue
        return bool(r)


def take_packet(reader: socket.socket, block: bool, timeout: float | None, lock: Any = None) -> tuple[bytes, list[int]]:
    """Take one packet and its fds (waiting as ``block``/``timeout`` say, as ``Queue.get``);
    ``queue.Empty`` if none came. Several processes may take from one socket: a packet another
    one took first is waited past; on a stream they take turns under ``lock`` (the reader
    lock, held only to take a packet that is there). Nothing is rebuilt here (``_sharing.decode`` does that)."""
    if timeout is not None and timeout < 0:
        raise ValueError("'timeout' must be a non-negative number")
    deadline = None if (block and timeout is None) else time.monotonic() + (timeout if block and timeout else 0.0)
    if lock is not None:
        # Wait with no lock held, then take the packet under the reader lock's own C semaphore
        # (``multiprocessing``'s Lock wraps it in Python ``__enter__``/``acquire`` code): with
        # ``with``, a Ctrl-C cannot leave a lock held that every consumer process shares (Note
        # [waits a Ctrl-C cannot break] in jaxtransport._lockorder).
        semlock = getattr(lock, "_semlock", lock)
        while True:
            if not wait_readable(reader, deadline):
                raise queue.Empty
            with semlock:
                if wait_readable(reader, time.monotonic()):  # not taken by another consumer first
                    return _sharing.recv_packet(reader)
            if deadline is not None and time.monotonic() >= deadline:
                raise queue.Empty
    while True:
        try:  # a packet already there is taken without a select first (one system call, not two)
            return _sharing.recv_packet(reader, nowait=True)
        except BlockingIOError:  # none yet, or another consumer took it
            pass
        if not wait_readable(reader, deadline):
            raise queue.Empty


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair for messages (``_os.message_socketpair``: Unix ``SOCK_SEQPACKET``, one
    packet one message, on Linux)."""
    return _os.message_socketpair()


def socket_handle(sock: socket.socket) -> Any:
    """What pickles ``sock`` for another process, spawning or not (:func:`socket_from` rebuilds
    it): ``multiprocessing``'s own means, a ``reduction.DupFd`` of its fd on POSIX (passed to a
    child being spawned, else served once by the resource sharer), a
    ``resource_sharer.DupSocket`` on Windows, which has no ``DupFd`` (the socket shared with
    ``socket.share``)."""
    from multiprocessing import reduction

    if hasattr(reduction, "DupFd"):
        return reduction.DupFd(sock.fileno())
    from multiprocessing.resource_sharer import DupSocket  # type: ignore[attr-defined]

    return DupSocket(sock)


def socket_from(handle: Any) -> socket.socket:
    """The socket :func:`socket_handle` pickled (``detach()`` gives an fd on POSIX, a socket on
    Windows)."""
    got = handle.detach()
    return got if isinstance(got, socket.socket) else socket.socket(fileno=got)
