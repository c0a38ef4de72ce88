"""``Pipe`` and its ``Connection`` objects with arrays through shared memory.

A pipe is a pair of Unix ``SOCK_SEQPACKET`` sockets; each message is one packet carrying the
fds of the segments it names (Note [queue messages] in ``_sharing``). ``send()`` pickles and
copies large arrays into shared memory in the caller, then writes the packet (blocking while the
peer's buffer is full, as a multiprocessing pipe does).
"""

from __future__ import annotations

import io
import pickle
import socket
import time
from typing import Any

from .. import _wire
from .._shm import DEFAULT_SHM_THRESHOLD
from . import _sharing
from ._sockets import check_options, socket_from, socket_handle, socketpair, take_packet, wait_readable

__all__ = ["Connection", "Pipe"]


class Connection:
    """One end of a :func:`Pipe`: ``multiprocessing.connection.Connection``'s API.

    ``send(obj)`` raises TracerTransportError (with the tracer's key path in ``obj``), the
    pickling error or ShmCapacityError before anything is sent. ``recv()`` raises EOFError when
    the other end is closed (every process holding it closed it or died) and nothing is left.
    Connections pickle (inherited by a Process, or sent through a queue or another pipe).
    """

    def __init__(
        self,
        sock: socket.socket,
        readable: bool = True,
        writable: bool = True,
        *,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        placement: str = "device",
    ):
        check_options(shm_threshold, placement)
        if not (readable or writable):
            raise ValueError("at least one of readable and writable must be True")
        self._sock: socket.socket | None = sock
        self._readable, self._writable = readable, writable
        self._threshold, self._placement = shm_threshold, placement

    def __reduce__(self) -> tuple:
        sock = self._check_closed()
        return (
            _rebuild_connection,
            (socket_handle(sock), self._readable, self._writable, self._threshold, self._placement),
        )

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def _check_closed(self) -> socket.socket:
        if self._sock is None:
            raise OSError("handle is closed")
        return self._sock

    def fileno(self) -> int:
        return self._check_closed().fileno()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    # -- sending
    def send(self, obj: Any) -> None:
        """Send ``obj``: large arrays are copied once into shared memory, the rest is pickled."""
        self._check_closed()
        if not self._writable:
            raise OSError("connection is read-only")
        out = _sharing.commit(_sharing.prepare(obj, self._threshold, "obj"))
        self._send(out)

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send a bytes-like object's bytes (read back with ``recv_bytes``)."""
        self._check_closed()
        if not self._writable:
            raise OSError("connection is read-only")
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("offset is out of range")
        if size is None:
            size = len(m) - offset
        if size < 0 or offset + size > len(m):
            raise ValueError("size is out of range" if size >= 0 else "size is negative")
        self._send(_sharing.commit(_sharing.prepare(_Bytes(bytes(m[offset : offset + size])), 1 << 62, "buf")))

    def _send(self, out: Any) -> None:
        try:
            _sharing.send_packet(self._sock, out)  # type: ignore[arg-type]
        except BaseException:
            out.discard()
            raise

    # -- receiving
    def _recv(self, raw: bool = False) -> Any:
        sock = self._check_closed()
        if not self._readable:
            raise OSError("connection is write-only")
        packet, fds = take_packet(sock, True, None)
        return _sharing.decode(packet, fds, self._placement, raw=raw)

    def recv(self) -> Any:
        """The next object sent from the other end (blocks). EOFError once the other end is
        closed and nothing is left. A message sent with ``send_bytes`` is unpickled, as the
        stock module's ``recv`` does (so an echo peer's ``send_bytes(recv_bytes())`` gives back
        the object); bytes that are no pickle raise what ``pickle.loads`` raises for them
        (``pickle.UnpicklingError``, ``EOFError``, ...), as there."""
        obj = self._recv()
        if isinstance(obj, _Bytes):
            return _wire.loads(obj.data, self._placement)
        return obj

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """The next message's bytes: what ``send_bytes`` sent, or, for a message sent with
        ``send()``, a pickle of it (as the stock module: ``pickle.loads`` rebuilds the object,
        and an echo peer may answer with ``send_bytes``, which ``recv()`` unpickles). The arrays
        a ``send()`` put in shared memory are copied into those bytes (one copy) and their
        memory given back at once. Nothing is unpickled here, and JAX is not imported."""
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        data = _bytes_of(self._recv(raw=True))
        if maxlength is not None and len(data) > maxlength:
            self.close()
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        data = self.recv_bytes()
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("offset out of bounds")
        if offset + len(data) > len(m):
            from multiprocessing import BufferTooShort

            raise BufferTooShort(data)
        m[offset : offset + len(data)] = data
        return len(data)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message is waiting (waits up to ``timeout`` seconds; None: forever)."""
        sock = self._check_closed()
        if not self._readable:
            raise OSError("connection is write-only")
        return wait_readable(sock, None if timeout is None else time.monotonic() + max(timeout, 0))

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else f"fd={self._sock.fileno()}"
        return f"<jaxtransport.multiprocessing.Connection {state}>"


def _bytes_of(data: bytes) -> bytes:
    """What ``recv_bytes`` returns for a message's pickle: the payload of ``send_bytes`` (a
    pickled ``_Bytes``), else the pickle itself. Only ``_Bytes`` is ever unpickled here."""
    if b"_Bytes" not in data[:160]:  # the class is named at the start of its pickle
        return data
    try:
        obj = _OnlyBytes(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any other class: a send() message
        return data
    return obj.data if type(obj) is _Bytes else data


class _NotBytes(Exception):
    pass


class _OnlyBytes(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _Bytes.__module__ and name == "_Bytes":
            return _Bytes
        raise _NotBytes


class _Bytes:
    """What ``send_bytes`` sends, so that ``recv_bytes`` can tell it from ``send``'s objects."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self) -> tuple:
        return (_Bytes, (self.data,))


def _rebuild_connection(df: Any, readable: bool, writable: bool, threshold: int, placement: str) -> Connection:
    return Connection(socket_from(df), readable, writable, shm_threshold=threshold, placement=placement)


def Pipe(
    duplex: bool = True, *, shm_threshold: int = DEFAULT_SHM_THRESHOLD, placement: str = "device"
) -> tuple[Connection, Connection]:
    """``(conn1, conn2)`` as ``multiprocessing.Pipe``: both ends send and receive when ``duplex``,
    else ``conn1`` only receives and ``conn2`` only sends. Arrays as in :class:`Queue`."""
    check_options(shm_threshold, placement)
    a, b = socketpair()
    if duplex:
        return (
            Connection(a, shm_threshold=shm_threshold, placement=placement),
            Connection(b, shm_threshold=shm_threshold, placement=placement),
        )
    a.shutdown(socket.SHUT_WR)
    b.shutdown(socket.SHUT_RD)
    return (
        Connection(a, True, False, shm_threshold=shm_threshold, placement=placement),
        Connection(b, False, True, shm_threshold=shm_threshold, placement=placement),
    )
