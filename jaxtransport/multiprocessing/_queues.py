"""``Queue``, ``JoinableQueue`` and ``SimpleQueue`` with arrays through shared memory.

The same API and semantics as ``multiprocessing``'s queues, with these differences (each for
the better or documented):

- ``put()`` pickles the object and copies its large arrays into shared memory *in the caller*:
  a Tracer or an unpicklable object raises there, with its key path, and nothing is queued; the
  caller may modify its numpy arrays as soon as ``put()`` returns. Only a small packet is left
  for the feeder thread.
- Messages are single packets on a Unix ``SOCK_SEQPACKET`` socket (Note [queue messages] in
  ``_sharing``): no reader or writer lock exists, so a process killed in ``get()`` or ``put()``
  blocks nobody. (Where SEQPACKET is missing, as on macOS, a stream with a reader and a writer
  lock stands in, as in ``multiprocessing.Queue``: Note [message framing] in ``_os``.)
- A producer that outpaces its consumers waits in ``put()`` for them to release shared memory
  (bounded by its ``timeout``, or while releases keep coming), then raises ShmCapacityError.
"""

from __future__ import annotations

import collections
import os
import queue as _queue
import threading
import time
import weakref
from multiprocessing import context as _mpcontext
from multiprocessing import util as _util
from typing import Any

from .. import _lockorder, _os
from .._shm import DEFAULT_SHM_THRESHOLD
from . import _sharing
from ._methods import std_context
from ._sockets import check_options, socket_from, socket_handle, socketpair, take_packet, wait_readable

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]


class Queue:
    """``multiprocessing.Queue`` whose jax/numpy arrays of at least ``shm_threshold`` bytes
    travel through shared memory (smaller ones are pickled into the pipe, as in
    ``multiprocessing``).

    Args:
      maxsize: as multiprocessing (0: unbounded).
      shm_threshold: arrays of at least this many bytes go through shared memory; smaller ones
        travel inline in the message.
      placement: how received jax arrays materialize: "device" (default), "host" (numpy) or
        "preserve" (the sender's sharding when available).

    A received CPU jax array (or numpy array) aliases the sender's shared memory; that memory
    returns to the sender when the last reference to it is gone. Costs: one memcpy per array in
    ``put()``; none in ``get()`` on CPU (a device copy on an accelerator).
    """

    def __init__(
        self,
        maxsize: int = 0,
        *,
        ctx: Any = None,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        placement: str = "device",
    ) -> None:
        from multiprocessing.synchronize import SEM_VALUE_MAX  # type: ignore[attr-defined]

        check_options(shm_threshold, placement)
        if ctx is None:
            ctx = std_context()
        if maxsize <= 0:
            maxsize = SEM_VALUE_MAX
        self._maxsize = maxsize
        self._threshold = shm_threshold
        self._placement = placement
        self._writer, self._reader = socketpair()
        self._rlock, self._wlock = _os.stream_locks(ctx, self._reader)
        self._sem = ctx.BoundedSemaphore(maxsize)
        self._opid = os.getpid()
        self._reset()

    # -- pickling (only while spawning a process, as multiprocessing's queues)
    def __getstate__(self) -> tuple:
        _mpcontext.assert_spawning(self)
        return (
            self._maxsize,
            self._threshold,
            self._placement,
            socket_handle(self._writer),
            socket_handle(self._reader),
            self._sem,
            self._opid,
            self._rlock,
            self._wlock,
        )

    def __setstate__(self, state: tuple) -> None:
        (self._maxsize, self._threshold, self._placement, w, r, self._sem, self._opid, self._rlock, self._wlock) = state
        self._writer, self._reader = socket_from(w), socket_from(r)
        self._reset()

    def _reset(self) -> None:
        # The feeder parks on it; put() takes it in the caller's thread: no Ctrl-C can leave it
        # held (Note [waits a Ctrl-C cannot break] in jaxtransport._lockorder).
        self._notempty = _lockorder.condition("Queue._notempty")
        self._buffer: collections.deque = collections.deque()
        self._busy = [False]  # the feeder is sending (outside the lock)
        self._thread: threading.Thread | None = None
        self._jointhread: Any = None
        self._joincancelled = False
        self._closed = False
        self._close: Any = None

    # -- putting
    def _encode(self, obj: Any, block: bool, timeout: float | None) -> Any:
        prep = _sharing.prepare(obj, self._threshold, "obj")  # tracers and pickling errors here
        if not self._sem.acquire(block, timeout):
            raise _queue.Full
        try:
            return _sharing.commit(prep, timeout if block else 0.0)
        except BaseException:
            self._sem.release()
            raise

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Queue ``obj``. Raises TracerTransportError (naming where the tracer sits in ``obj``),
        the pickling error, ``queue.Full`` (maxsize reached) or ShmCapacityError (the shared
        memory stayed full: consumers too slow, stopped or dead) here, before anything is queued.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        out = self._encode(obj, block, timeout)
        with self._notempty:
            self._enqueue(out)

    def _enqueue(self, out: Any) -> None:
        # Called with self._notempty held. When nothing is buffered or being sent, write the
        # packet from this thread if the socket takes it at once (no feeder hop, so no
        # thread switch on the way); order is kept because the feeder is idle.
        if not self._buffer and not self._busy[0]:
            try:
                _sharing.send_packet(self._writer, out, nowait=True, lock=self._wlock)
                return
            except BlockingIOError:
                pass
            except OSError:
                out.discard()
                return
        if self._thread is None:
            self._start_thread()
        self._buffer.append(out)
        self._notempty.wake_all()

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    # -- getting
    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next object; ``queue.Empty`` when none came in ``timeout`` (or at once with
        ``block=False``). Raises ShmHandleError/TransportError for a message that cannot be
        rebuilt (corrupt, or its memory is gone); that message is lost, later ones are not."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        packet, fds = take_packet(self._reader, block, timeout, self._rlock)
        self._sem.release()
        return _sharing.decode(packet, fds, self._placement)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return self._maxsize - self._sem.get_value()

    def empty(self) -> bool:
        return not wait_readable(self._reader, time.monotonic())

    def full(self) -> bool:
        return self._sem.get_value() == 0

    # -- closing
    def close(self) -> None:
        """No more puts or gets from this process; the feeder thread flushes what is buffered,
        then closes this process's end (as multiprocessing.Queue)."""
        if self._closed:
            return
        self._closed = True
        self._reader.close()
        close = self._close
        if close:
            self._close = None
            close()
        elif self._thread is None:
            self._writer.close()

    def join_thread(self) -> None:
        if not self._closed:
            raise ValueError("join_thread() needs close() first (as multiprocessing.Queue)")
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        """Do not wait for the feeder thread at exit (buffered messages may be lost)."""
        self._joincancelled = True
        try:
            self._jointhread.cancel()
        except AttributeError:
            pass

    def _start_thread(self) -> None:
        self._thread = threading.Thread(
            target=Queue._feed,
            args=(self._buffer, self._notempty, self._writer, self._busy, self._wlock),
            name="jaxtransport-queue-feeder",
            daemon=True,
        )
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = _util.Finalize(
                self._thread, Queue._finalize_join, [weakref.ref(self._thread)], exitpriority=-5
            )
        self._close = _util.Finalize(self, Queue._finalize_close, [self._buffer, self._notempty], exitpriority=10)

    @staticmethod
    def _finalize_join(twr: Any) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    @staticmethod
    def _finalize_close(buffer: Any, notempty: Any) -> None:
        with notempty:
            buffer.append(_SENTINEL)
            notempty.wake_all()

    @staticmethod
    def _feed(buffer: Any, notempty: Any, writer: Any, busy: Any, wlock: Any) -> None:
        while True:
            with notempty:
                busy[0] = False
                if buffer:
                    out = buffer.popleft()
                    busy[0] = True
                else:
                    out, ticket = None, notempty.park()
            if out is None:
                _lockorder.sleep(ticket)
                continue
            if out is _SENTINEL:
                with notempty:
                    busy[0] = False
                writer.close()
                return
            try:
                _sharing.send_packet(writer, out, lock=wlock)
            except OSError:
                out.discard()  # the queue's socket is gone: nobody can take it
            out = None

    def __repr__(self) -> str:
        return f"<jaxtransport.multiprocessing.Queue at {id(self):#x} maxsize={self._maxsize}>"


_SENTINEL = object()


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue`` over :class:`Queue` (``task_done``/``join``)."""

    def __init__(
        self,
        maxsize: int = 0,
        *,
        ctx: Any = None,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        placement: str = "device",
    ) -> None:
        if ctx is None:
            ctx = std_context()
        super().__init__(maxsize, ctx=ctx, shm_threshold=shm_threshold, placement=placement)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def __getstate__(self) -> tuple:
        return Queue.__getstate__(self) + (self._cond, self._unfinished_tasks)

    def __setstate__(self, state: tuple) -> None:
        Queue.__setstate__(self, state[:-2])
        self._cond, self._unfinished_tasks = state[-2:]

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        out = self._encode(obj, block, timeout)
        with self._notempty, self._cond:
            self._unfinished_tasks.release()
            self._enqueue(out)

    def task_done(self) -> None:
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if self._unfinished_tasks.get_value() == 0:
                self._cond.notify_all()

    def join(self) -> None:
        with self._cond:
            if self._unfinished_tasks.get_value() != 0:
                self._cond.wait()


class SimpleQueue:
    """``multiprocessing.SimpleQueue``: ``put`` sends from the caller (no feeder thread; it
    blocks while the socket buffer is full), ``get`` blocks. Arrays as in :class:`Queue`."""

    def __init__(
        self, *, ctx: Any = None, shm_threshold: int = DEFAULT_SHM_THRESHOLD, placement: str = "device"
    ) -> None:
        check_options(shm_threshold, placement)
        self._threshold = shm_threshold
        self._placement = placement
        self._writer, self._reader = socketpair()
        self._rlock, self._wlock = _os.stream_locks(ctx or std_context(), self._reader)
        self._closed = False

    def __getstate__(self) -> tuple:
        _mpcontext.assert_spawning(self)
        return (
            self._threshold,
            self._placement,
            socket_handle(self._writer),
            socket_handle(self._reader),
            self._rlock,
            self._wlock,
        )

    def __setstate__(self, state: tuple) -> None:
        self._threshold, self._placement, w, r, self._rlock, self._wlock = state
        self._writer, self._reader = socket_from(w), socket_from(r)
        self._closed = False

    def put(self, obj: Any) -> None:
        """Send ``obj`` now. Tracer, pickling and capacity errors raise here, nothing queued."""
        if self._closed:
            raise ValueError("SimpleQueue is closed")
        out = _sharing.commit(_sharing.prepare(obj, self._threshold, "obj"))
        try:
            _sharing.send_packet(self._writer, out, lock=self._wlock)
        except BaseException:
            out.discard()
            raise

    def get(self) -> Any:
        if self._closed:
            raise ValueError("SimpleQueue is closed")
        packet, fds = take_packet(self._reader, True, None, self._rlock)
        return _sharing.decode(packet, fds, self._placement)

    def empty(self) -> bool:
        return not wait_readable(self._reader, time.monotonic())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reader.close()
            self._writer.close()

    def __repr__(self) -> str:
        return f"<jaxtransport.multiprocessing.SimpleQueue at {id(self):#x}>"
