"""Result objects of jaxtransport.Pool, with multiprocessing.pool's semantics.

``AsyncResult`` (``apply_async``), ``MapResult`` (``map_async``/``starmap_async``) and
``IMapIterator`` (``imap``/``imap_unordered``). Each is completed through
``chunk_done(chunk_index, ok, value)`` (for the pool's engine and facade, not part of the user
API) where ``value`` is the list of a chunk's results or an exception: by the manager thread for
a result without callbacks, by the pool's callback thread (:class:`CallbackRunner`) for one with
callbacks, so a callback may submit tasks and wait for them (``pool.apply`` works) without
stalling result reading. Waiting in a callback for a result that itself needs the callback
thread raises PoolStateError at once instead of deadlocking. A
callback that raises is reported on stderr and does not disturb the pool.
"""

from __future__ import annotations

import collections
import multiprocessing
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .. import _lockorder
from .._errors import PoolStateError

__all__ = ["AsyncResult", "CallbackRunner", "IMapIterator", "MapResult"]

_in_callback = threading.local()  # .active: this thread is a pool's callback thread
# Results make their condition only when someone waits before they are done (most tiny tasks
# are done by then): this lock orders "done" against "a condition was made". Every wait here
# parks on a _lockorder.Condition, which no KeyboardInterrupt can leave locked (Note [waits a
# Ctrl-C cannot break] in _lockorder): a Ctrl-C in get() once left a threading.Event locked,
# and the manager thread setting it waited for ever.
_EVENTS_LOCK = _lockorder.lock("results._EVENTS_LOCK")


class CallbackRunner:
    """One thread per pool that completes results with callbacks, in completion order. Started
    at the first such result."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = _lockorder.lock("CallbackRunner.lock")

    def deliver(self, result: Any, index: int, ok: bool, value: Any) -> None:
        if not result._has_callbacks():
            result.chunk_done(index, ok, value)
            return
        fast = getattr(result, "_fast", None)  # only on AsyncResult: one call, value[0]
        if fast is not None:
            one = value[0] if ok else value
            if fast(ok, one):
                # Completed by its owner's own code, which runs no user code (the Executor's
                # future without done-callbacks): no hop through the callback thread.
                result._set(ok, one, run_callbacks=False)
                return
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="jaxtransport-pool-callbacks", daemon=True)
                self.thread.start()
        self.queue.put((result, index, ok, value))

    def deliver_many(self, result: Any, done: list) -> None:
        """``deliver`` of each ``(index, ok, value)`` of ``result``: in one call to it when it
        has no callbacks (``chunks_done``)."""
        if not result._has_callbacks():
            result.chunks_done(done)
            return
        for index, ok, value in done:
            self.deliver(result, index, ok, value)

    def _run(self) -> None:
        _in_callback.active = True
        while True:
            item = self.queue.get()
            if item is None:
                return
            result, index, ok, value = item
            del item
            result.chunk_done(index, ok, value)
            del result, value

    def close(self) -> None:
        """Run what is queued, then end the thread (not waited for from the thread itself)."""
        with self.lock:
            t = self.thread
        if t is not None:
            self.queue.put(None)
            if t is not threading.current_thread():
                t.join(5)


_NOTHING = object()  # no item (IMapIterator.next)


def _refuse_wait_in_callback(result: Any) -> None:
    if getattr(_in_callback, "active", False) and result._has_callbacks():
        raise PoolStateError(
            "A jaxtransport.Pool callback waited for a result that has a callback itself: "
            "callbacks run one at a time on the pool's callback thread, so that result could "
            "never complete. Wait for it outside the callback, or submit it without callback= / "
            "error_callback= (pool.apply and results without callbacks may be waited for here)."
        )


def _call_quietly(fn: Callable, arg: Any) -> None:
    try:
        fn(arg)
    except BaseException:  # noqa: BLE001
        print("jaxtransport.Pool: exception in a result callback:", file=sys.stderr)
        traceback.print_exc()


class AsyncResult:
    """The result of ``apply_async`` (multiprocessing.pool.AsyncResult's API)."""

    def __init__(
        self, keepalive: Any, callback: Callable | None = None, error_callback: Callable | None = None
    ) -> None:
        self._done = False
        self._cond: _lockorder.Condition | None = None  # made by the first wait() before it is done
        self._callback = callback
        self._error_callback = error_callback
        self._keepalive = keepalive  # the Pool, until the result is in (as multiprocessing)
        # FuturesResult (the Executor): fast(ok, value) -> True when it completed the result's
        # consumer itself without running user code, so the delivering thread may call it.
        self._fast: Callable | None = None
        self._ok: bool | None = None
        self._value: Any = None

    def ready(self) -> bool:
        return self._done

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return bool(self._ok)

    def _has_callbacks(self) -> bool:
        return self._callback is not None or self._error_callback is not None

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        _refuse_wait_in_callback(self)
        with _EVENTS_LOCK:
            if self._done:
                return
            cond = self._cond
            if cond is None:
                cond = self._cond = _lockorder.condition("AsyncResult.cond")
        cond.wait_for(lambda: self._done, timeout)

    def get(self, timeout: float | None = None) -> Any:
        """The value, or raise the task's exception (its ``__cause__`` is the remote traceback).
        Raises multiprocessing.TimeoutError when ``timeout`` passes first."""
        self.wait(timeout)
        if not self.ready():
            raise multiprocessing.TimeoutError
        if self._ok:
            return self._value
        try:
            raise self._value
        finally:
            # Raising adds this frame to the exception's traceback: without ``self`` in it, the
            # exception and this result are no reference cycle (as concurrent.futures does).
            self = None  # type: ignore[assignment]

    def _set(self, ok: bool, value: Any, run_callbacks: bool = True) -> None:
        if self._done:
            return
        self._ok, self._value = ok, value
        if run_callbacks and ok and self._callback is not None:
            _call_quietly(self._callback, value)
        if run_callbacks and not ok and self._error_callback is not None:
            _call_quietly(self._error_callback, value)
        with _EVENTS_LOCK:
            self._done = True
            cond = self._cond
        if cond is not None:
            with cond:
                cond.wake_all()
        self._keepalive = None

    def chunk_done(self, index: int, ok: bool, value: Any) -> None:
        self._set(ok, value[0] if ok else value)

    def chunks_done(self, done: list) -> None:
        """``chunk_done`` of each ``(index, ok, value)``."""
        for index, ok, value in done:
            self.chunk_done(index, ok, value)

    def __repr__(self) -> str:
        state = "pending" if not self.ready() else ("done" if self._ok else "failed")
        return f"<jaxtransport.pool.AsyncResult {state}>"


class FuturesResult(AsyncResult):
    """An Executor call's result: like :class:`AsyncResult`, plus ``fast(ok, value)``, which the
    manager thread calls first: True when it completed the call's future itself (one without
    done-callbacks: setting it runs no user code), so the callback thread is not needed."""

    def __init__(
        self,
        keepalive: Any,
        callback: Callable | None,
        error_callback: Callable | None,
        fast: Callable[[bool, Any], bool],
    ) -> None:
        super().__init__(keepalive, callback, error_callback)
        self._fast = fast
        # note_result(shared): told by the manager whether the result came through shared
        # memory (the Executor's window, Note [executor window] in _executor).
        self.note_result: Callable[[bool], None] | None = None


class MapResult(AsyncResult):
    """The result of ``map_async``/``starmap_async``: a list in input order; the first failing
    chunk fails the whole result (as multiprocessing)."""

    def __init__(
        self,
        keepalive: Any,
        length: int,
        chunksize: int,
        callback: Callable | None = None,
        error_callback: Callable | None = None,
    ) -> None:
        super().__init__(keepalive, callback, error_callback)
        self._values: list | None = [None] * length
        self._chunksize = chunksize
        self._left = -(-length // chunksize) if length else 0
        self._lock = _lockorder.lock("MapResult._lock")
        if not self._left:
            self._set(True, [])

    def chunk_done(self, index: int, ok: bool, value: Any) -> None:
        with self._lock:
            if self._done:
                return
            if not ok:
                self._values = None
                done, result = True, value
            else:
                start = index * self._chunksize
                self._values[start : start + len(value)] = value  # type: ignore[index]
                self._left -= 1
                done, result = self._left == 0, self._values
        if done:
            self._set(ok, result)

    def chunks_done(self, done: list) -> None:
        """``chunk_done`` of each ``(index, ok, value)``, under one acquisition of the lock."""
        with self._lock:
            if self._done or self._values is None:  # (None: failed, being completed)
                return
            values, size = self._values, self._chunksize
            ok, result = True, values
            for index, ok, value in done:
                if not ok:
                    self._values = None
                    result = value
                    break
                start = index * size
                values[start : start + len(value)] = value
                self._left -= 1
            finished = not ok or self._left == 0
        if finished:
            self._set(ok, result)


class IMapIterator:
    """The iterator of ``imap`` (ordered) / ``imap_unordered``; ``next(timeout)`` as in
    multiprocessing (raises multiprocessing.TimeoutError)."""

    def __init__(self, keepalive: Any, ordered: bool, on_consumed: Callable[[], None] | None = None) -> None:
        self._cond = _lockorder.condition("IMapIterator._cond")
        self._on_consumed = on_consumed  # told (no lock held) when a chunk's results are all taken
        # Results in a row that came back without shared memory (-1: one did): imap's window
        # widens once they show that piling them up costs no shared memory.
        self.light_results = 0
        self._ordered = ordered
        self._ready: dict[int, tuple[bool, object]] = {}
        self._queue: collections.deque = collections.deque()
        self._next_chunk = 0
        self._total_chunks: int | None = None
        self._yielded_chunks = 0
        self._done_chunks = 0
        self._keepalive = keepalive

    def _has_callbacks(self) -> bool:
        return False

    def note_result(self, shared: bool) -> None:
        """A chunk's results arrived, in shared memory or not (the manager thread)."""
        if shared:
            self.light_results = -1  # for good: this imap's results may be large
        elif self.light_results >= 0:
            self.light_results += 1

    def unconsumed(self) -> int:
        """Chunks finished whose results were not all taken yet (imap's backpressure)."""
        return self._done_chunks - self._yielded_chunks

    def __iter__(self) -> IMapIterator:
        return self

    def set_length(self, chunks: int) -> None:
        with self._cond:
            self._total_chunks = chunks
            self._cond.wake_all()

    def chunk_done(self, index: int, ok: bool, value: Any) -> None:
        self.chunks_done([(index, ok, value)])

    def chunks_done(self, done: list) -> None:
        """Chunks' results ``(index, ok, value)`` each, in one acquisition of the lock and one
        wakeup of the consumer."""
        with self._cond:
            self._done_chunks += len(done)
            queue = self._queue
            if self._ordered:
                ready = self._ready
                for index, ok, value in done:
                    ready[index] = (ok, collections.deque(value) if ok else value)
                nxt = self._next_chunk
                while True:  # not `while nxt in ready:` (Note [loops that end in a test])
                    if nxt not in ready:
                        break
                    queue.append(ready.pop(nxt))
                    nxt += 1
                self._next_chunk = nxt
            else:
                for _index, ok, value in done:
                    queue.append((ok, collections.deque(value) if ok else value))
            self._cond.wake_all()

    def next(self, timeout: float | None = None) -> Any:
        with self._cond:  # the common case, an item ready: no wait
            queue = self._queue
            item: Any = _NOTHING
            if queue:
                ok, value = queue[0]
                if ok and value:
                    item = value.popleft()
                    if value:
                        return item
                    queue.popleft()
                    self._yielded_chunks += 1
        if item is not _NOTHING:
            if self._on_consumed is not None:
                self._on_consumed()  # the feeder may have room again (imap's backpressure)
            return item
        before = self._yielded_chunks
        try:
            return self._next(timeout)
        finally:
            if self._yielded_chunks != before and self._on_consumed is not None:
                self._on_consumed()  # the feeder may have room again (imap's backpressure)

    def _next(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._cond
        while True:
            with cond:
                item = self._take()
                if item is not _NOTHING:
                    return item
                ticket = cond.park()
            if not _lockorder.sleep(ticket, None if deadline is None else deadline - time.monotonic()):
                with cond:
                    cond.unpark(ticket)
                    item = self._take()
                if item is not _NOTHING:
                    return item
                raise multiprocessing.TimeoutError

    def _take(self) -> Any:
        """Lock held: the next item, or _NOTHING; raises a failed chunk's exception, or
        StopIteration after the last item."""
        while True:
            if self._queue:
                ok, value = self._queue[0]
                if not ok:
                    self._queue.popleft()
                    self._yielded_chunks += 1
                    raise value
                if value:
                    item = value.popleft()
                    if not value:
                        self._queue.popleft()
                        self._yielded_chunks += 1
                    return item
                self._queue.popleft()
                self._yielded_chunks += 1
                continue
            if self._total_chunks is not None and self._yielded_chunks >= self._total_chunks:
                self._keepalive = None
                raise StopIteration
            return _NOTHING

    __next__ = next
