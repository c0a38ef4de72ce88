"""``jaxtransport.Executor``: the ``concurrent.futures.Executor`` face of the Pool's engine.

Same workers, shared memory, placements, tracer errors and crash handling as
:class:`~jaxtransport.Pool` (it owns one); futures are ``concurrent.futures.Future`` (``_future.Future``,
whose waits no Ctrl-C can break), so ``as_completed``, ``wait`` and ``asyncio.wrap_future`` work.

Flow: ``submit`` hands a call to the pool at once (pickling and copying large arrays in the
caller's thread, so a Tracer or an unpicklable argument raises there) while fewer than
``2 * max_workers`` calls are in flight (8 times as many for calls without shared memory: Note
[executor window]); beyond that the call waits in the executor's queue as a *pending* future,
which ``cancel()`` and ``shutdown(cancel_futures=True)`` can still cancel. A *dispatcher* thread
(started on first need) moves pending calls to the pool in batches once half the room is free. A
future that succeeded and has no done-callbacks is completed by the pool's manager thread
itself (setting it only wakes its waiters: no user code, no hop); any other is completed by the
pool's callback thread, which also runs the done-callbacks. Neither pickles or waits.
Lock order: the executor's ``_lock`` is a leaf (nothing else is taken while holding it).

Note [executor at exit]
~~~~~~~~~~~~~~~~~~~~~~~
``concurrent.futures.ProcessPoolExecutor`` runs what was submitted before the interpreter
exits, waited for or not (``shutdown(wait=False)`` included; ``cancel_futures=True`` cancels
only what had not started): its ``_python_exit`` is registered with
``threading._register_atexit``, which runs before non-daemon threads are joined and before
``atexit`` hooks, and joins each executor's manager thread once its work items are done. An
Executor does the same: the first one registers :func:`_python_exit`, which marks the
interpreter as shutting down (``submit`` raises ``RuntimeError('cannot schedule new futures
after interpreter shutdown')`` from then on, an ``atexit`` hook's call included) and, for every
live executor, waits until its pending and running calls are done, then closes and joins its
pool. The ``atexit`` hook that terminates live Pools runs after it (a ``Pool`` keeps
``multiprocessing.Pool``'s exit behaviour: terminated, unfinished tasks dropped).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .. import _lockorder
from .._errors import BrokenExecutorError, PoolStateError, PoolTerminatedError
from .._nojax import find_tracer_in
from ._facade import Pool
from ._future import Future
from ._results import AsyncResult, FuturesResult

__all__ = ["Executor", "get_reusable_executor", "shutdown_reusable_executor"]


_live: weakref.WeakSet[Executor] = weakref.WeakSet()
_global_shutdown = False
_exit_lock = threading.Lock()
_exit_registered = False


def _python_exit() -> None:
    """At interpreter exit: no more calls; wait for every live executor's calls, then end its
    workers (Note [executor at exit])."""
    global _global_shutdown
    _global_shutdown = True
    for ex in list(_live):
        ex._finish_at_exit()


def _register_exit() -> None:
    # At the first Executor (importing jaxtransport has no side effects). threading's hook
    # (Python >= 3.9) runs before non-daemon threads are joined, as concurrent.futures' does.
    global _exit_registered, _global_shutdown
    with _exit_lock:
        if _exit_registered:
            return
        register = getattr(threading, "_register_atexit", None) or atexit.register
        try:
            register(_python_exit)
        except RuntimeError:  # the interpreter is already shutting down
            _global_shutdown = True
            return
        _exit_registered = True


def _run_chunk(fn: Callable, chunk: list) -> list:
    """``map(chunksize>1)``: one task runs a chunk of calls (in the worker)."""
    return [fn(*args) for args in chunk]


class _Call:
    __slots__ = ("args", "counted", "fn", "future", "kwargs")

    def __init__(self, future: concurrent.futures.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        self.future, self.fn, self.args, self.kwargs = future, fn, args, kwargs
        self.counted = False  # in the executor's _in_flight (Executor._finished takes it out once)


class Executor(concurrent.futures.Executor):
    """A ``concurrent.futures.Executor`` running calls in jaxtransport.Pool workers.

    Args:
      max_workers: number of worker processes (default: the CPUs this process may use).
      initializer, initargs: run once in each worker at start (see ``Pool``).
      max_tasks_per_child: a worker is replaced after this many calls.
      **pool_kwargs: ``start_method``, ``shm_threshold``, ``placement``, ``worker_env``,
        ``shm_capacity``, ``devices_per_worker``: as for ``jaxtransport.Pool``.

    A worker that dies while running a call fails that call's future with ``WorkerLostError``
    (a ``BrokenProcessPool``); the worker is replaced and the executor keeps running, as the
    Pool does. When the pool itself breaks, every pending future and every later ``submit``
    raise :class:`BrokenExecutorError` (also a ``BrokenProcessPool``). Done-callbacks of the
    futures run in the pool's callback thread: keep them short (``submit`` from one is fine;
    ``shutdown(wait=True)`` from one is refused, as ``Pool.join`` from a callback is).
    As in ``concurrent.futures``, calls submitted before the interpreter exits run to the end,
    waited for or not (Note [executor at exit]); a result that does not pickle fails its future
    with the pickling error itself; an initializer's exception is logged on the
    ``concurrent.futures`` logger in the worker before the executor breaks.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        initializer: Callable | None = None,
        initargs: Iterable = (),
        *,
        max_tasks_per_child: int | None = None,
        **pool_kwargs: Any,
    ):
        # concurrent.futures' checks and messages.
        if isinstance(max_workers, int) and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
        _register_exit()
        self._pool = _FuturesPool(max_workers, initializer, initargs, max_tasks_per_child, **pool_kwargs)
        # Calls handed to the pool at once: 2 per worker, EXECUTOR_WIDE times that while the
        # calls and results need no shared memory (Note [executor window]).
        self._narrow = 2 * self._pool.processes
        self._max_in_flight = self._narrow
        self._light = 0  # results in a row that needed no shared memory
        # Its waiters (the dispatcher, shutdown's wait for idleness) park on it: no Ctrl-C can
        # leave it held (Note [waits a Ctrl-C cannot break] in _lockorder).
        self._lock = _lockorder.condition("Executor._lock")
        self._pending: collections.deque[_Call] = collections.deque()
        self._in_flight = 0
        self._shutdown = False
        self._broken: BaseException | None = None
        self._dispatcher: threading.Thread | None = None
        self._reusable = False
        _live.add(self)

    # -- submitting
    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Schedule ``fn(*args, **kwargs)``; returns its Future at once. Raises here (not on the
        future) for a Tracer anywhere in the call (TracerTransportError naming its path), and,
        when the call goes to the pool at once, for an argument that cannot be pickled."""
        future: concurrent.futures.Future = Future()
        call = _Call(future, fn, args, kwargs)
        direct = False
        try:
            # A Ctrl-C anywhere from here on leaves the books right: ``call.counted`` is set
            # with no call in between that a KeyboardInterrupt could land after, and
            # ``_finished`` takes a counted call out once, whoever asks first (this handler, or
            # the result if the pool had the call already): else ``shutdown(wait=True)`` would
            # wait for ever for a call that never went.
            with self._lock:
                self._check_open()
                direct = not self._pending and self._in_flight < self._max_in_flight
                if direct:
                    self._in_flight += 1
                    call.counted = True
            if direct:
                future.set_running_or_notify_cancel()
                self._send(call)
        except BaseException:
            if direct:
                self._finished(call)
            raise
        if not direct:
            # It waits in the queue: find a Tracer now (the pool's pickling finds it for direct
            # calls), so that the error is raised here, not later on the future.
            found = find_tracer_in((args, "args"), (kwargs, "kwargs"), (fn, "fn"))
            if found is not None:
                from .._tracers import tracer_error

                raise tracer_error(found[1], path=found[0], where="in Executor.submit")
            with self._lock:
                self._check_open()
                self._pending.append(call)
                self._ensure_dispatcher()
        return future

    def map(self, fn: Callable, *iterables: Iterable, timeout: float | None = None, chunksize: int = 1) -> Iterator:
        """``map(fn, *iterables)`` as ``concurrent.futures``: results in order; ``timeout``
        (seconds, from this call) raises ``TimeoutError`` from the iterator; ``chunksize`` > 1
        sends that many calls per task. Unfinished calls are cancelled if the iterator is closed
        early."""
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        end = None if timeout is None else time.monotonic() + timeout
        calls = zip(*iterables)
        if chunksize == 1:
            futures = [self.submit(fn, *args) for args in calls]
        else:
            futures, chunk = [], []
            for args in calls:
                chunk.append(args)
                if len(chunk) == chunksize:
                    futures.append(self.submit(_run_chunk, fn, chunk))
                    chunk = []
            if chunk:
                futures.append(self.submit(_run_chunk, fn, chunk))

        def results() -> Iterator[Any]:
            # Holds no reference to what it yielded (as concurrent.futures): each future is
            # popped and dropped before its value is yielded, a chunk's list popped item by
            # item, so a large result's shared memory goes back once the caller drops it.
            try:
                futures.reverse()
                while True:  # not `while futures:` (Note [loops that end in a test])
                    if not futures:
                        break
                    left = None if end is None else end - time.monotonic()
                    if chunksize == 1:
                        yield _pop_result(futures, left)
                    else:
                        chunk = _pop_result(futures, left)
                        chunk.reverse()
                        while True:
                            if not chunk:
                                break
                            yield chunk.pop()
                        del chunk
            finally:
                for f in futures:
                    f.cancel()

        return results()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; ``cancel_futures`` cancels the pending (not yet started) ones. With
        ``wait`` return once every started call finished and the workers exited; without, the
        workers exit in the background when the calls are done. A reusable executor
        (:func:`get_reusable_executor`) waits for its calls but keeps its warm workers."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:  # not `while self._pending:` (Note [loops that end in a test])
                    if not self._pending:
                        break
                    self._pending.popleft().future.cancel()
            self._lock.wake_all()
        if self._reusable:
            if wait:
                self._wait_idle()
        elif wait:
            self._wait_idle()
            self._pool.close()
            self._pool.join()
        else:
            threading.Thread(
                target=_close_when_idle, args=(self,), daemon=True, name="jaxtransport-executor-close"
            ).start()

    # -- internals
    def _check_open(self) -> None:
        if self._broken is not None:
            raise BrokenExecutorError(f"This jaxtransport.Executor is broken: {self._broken}") from self._broken
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if _global_shutdown:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    def _finish_at_exit(self) -> None:
        """Interpreter exit (Note [executor at exit]): run what was submitted, then end the
        workers (a ``shutdown(wait=False)`` thread may be doing the same: both are idempotent)."""
        self._wait_idle()
        try:
            self._pool.close()
            self._pool.join()
        except (PoolStateError, PoolTerminatedError):
            pass

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(
                target=_dispatch, args=(weakref.ref(self),), daemon=True, name="jaxtransport-executor-dispatch"
            )
            self._dispatcher.start()

    def _result_for(self, call: _Call) -> FuturesResult:
        """The pool result that completes ``call``'s future."""
        fut = call.future

        def done(value: Any) -> None:
            fut.set_result(value)
            self._finished(call)

        def failed(exc: BaseException) -> None:
            if isinstance(exc, PoolStateError):  # the pool broke under this call
                self._mark_broken(exc)
                broken = BrokenExecutorError(f"This jaxtransport.Executor is broken: {exc}")
                broken.__cause__ = exc
                exc = broken
            fut.set_exception(exc)
            self._finished(call)

        def fast(ok: bool, value: Any) -> bool:
            # On the pool's manager thread: complete a future that has no done-callbacks here
            # (setting it wakes its waiters, runs no user code); else the callback thread does.
            # Holding the future's (reentrant) condition, no callback can be added in between.
            cond = getattr(fut, "_condition", None)
            if not ok or cond is None:
                return False
            with cond:
                if getattr(fut, "_done_callbacks", True):
                    return False
                fut.set_result(value)
            self._finished(call)
            return True

        result = FuturesResult(self._pool, done, failed, fast)
        result.note_result = self._note_result
        return result

    # Note [executor window]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # Calls beyond the window wait in the executor, cancellable, and their arguments are not
    # yet copied into shared memory: 2 calls per worker bound that memory and keep most calls
    # cancellable, as concurrent.futures keeps about one per worker in its call queue. For
    # small calls the same window starves the workers: each runs a call and waits for the
    # round trip of the next (tiny tasks ran 3-4x slower in the parent's CPU time). So once
    # as many results in a row as the window holds came back without shared memory, the
    # window widens EXECUTOR_WIDE times; a call or result with an array in shared memory
    # narrows it again at once (calls already handed over stay there).
    def _note_result(self, shared: bool) -> None:
        """The manager thread: a call's result arrived, through shared memory or not."""
        if shared:
            self._narrow_window()
        else:
            self._light += 1
            if self._light >= self._narrow:
                self._max_in_flight = self._narrow * EXECUTOR_WIDE

    def _narrow_window(self) -> None:
        self._light = 0
        self._max_in_flight = self._narrow

    def _pool_stopped(self, e: PoolStateError) -> BrokenExecutorError:
        if not self._shutdown or self._reusable:
            self._mark_broken(e)
        broken = BrokenExecutorError(f"This jaxtransport.Executor is broken: {e}")
        broken.__cause__ = e
        return broken

    def _send(self, call: _Call) -> None:
        try:
            heavy = self._pool.submit_call(call.fn, call.args, call.kwargs, self._result_for(call))
        except PoolStateError as e:
            raise self._pool_stopped(e) from e
        if heavy:
            self._narrow_window()

    def _send_many(self, calls: list[_Call]) -> None:
        """The dispatcher: send ``calls`` (running, counted in flight) to the pool at once; a
        call that cannot be sent fails its own future."""
        results = {}
        batch = []
        for call in calls:
            result = self._result_for(call)
            results[id(result)] = call
            batch.append((call.fn, call.args, call.kwargs, result))
        try:
            failed, heavy = self._pool.submit_calls(batch)
        except PoolStateError as e:
            broken = self._pool_stopped(e)
            failed, heavy = [(r, broken) for *_, r in batch], False
        if heavy:
            self._narrow_window()
        for result, exc in failed:
            call = results[id(result)]
            self._finished(call)
            call.future.set_exception(exc)

    def _finished(self, call: _Call) -> None:
        """``call`` is done with (finished, failed, cancelled or never sent): out of the calls
        in flight, once however often this is asked."""
        with self._lock:
            if not call.counted:
                return
            call.counted = False
            self._in_flight -= 1
            n = self._in_flight
            # Wake the dispatcher once half the room is free (it then sends a batch), and
            # whoever waits for idleness at zero: not at every call.
            if n == 0 or (n <= self._max_in_flight // 2 and self._pending):
                self._lock.wake_all()

    def _mark_broken(self, cause: BaseException) -> None:
        with self._lock:
            self._broken = cause
            pending, self._pending = list(self._pending), collections.deque()
            self._lock.wake_all()
        for call in pending:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(BrokenExecutorError(f"This jaxtransport.Executor is broken: {cause}"))

    def _next_calls(self) -> list[_Call]:
        """Dispatcher: the pending calls there is room for, once there is room; empty (the
        thread ends) when nothing is pending or the pool broke. ``submit`` starts a new one
        when needed."""
        while True:
            with self._lock:
                if self._broken is not None or not self._pending:
                    self._dispatcher = None
                    return []
                room = self._max_in_flight - self._in_flight
                if room > 0:
                    calls = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
                    self._in_flight += len(calls)
                    for call in calls:
                        call.counted = True
                    return calls
                ticket = self._lock.park()
            _lockorder.sleep(ticket)

    def _wait_idle(self) -> None:
        while True:
            with self._lock:
                if not (self._pending or self._in_flight):
                    return
                ticket = self._lock.park()
            _lockorder.sleep(ticket)

    def __repr__(self) -> str:
        state = "broken" if self._broken else ("shut down" if self._shutdown else "running")
        return f"<jaxtransport.Executor {state} max_workers={self._pool.processes}>"

    def __reduce__(self) -> tuple:
        raise TypeError("a jaxtransport.Executor cannot be pickled or sent to another process")


class _FuturesPool(Pool):
    """The Executor's pool: its workers follow concurrent.futures' contract where it differs
    from multiprocessing's (a result that does not pickle fails with its own error, not
    MaybeEncodingError; an initializer's error is logged on the ``concurrent.futures`` logger)."""

    _futures = True

    @property
    def processes(self) -> int:
        """The number of worker processes (``max_workers``)."""
        return self._processes

    def submit_call(self, fn: Callable, args: tuple, kwargs: dict, result: AsyncResult) -> bool:
        """Send one call completing ``result`` (``Pool.apply_async``'s path, with the result
        the Executor made: raises here, as ``apply_async`` does, for a Tracer, an argument that
        does not pickle or a pool that has stopped)."""
        return self._submit_apply(fn, args, kwargs, result)

    def submit_calls(self, calls: Sequence[tuple[Callable, tuple, dict, AsyncResult]]) -> tuple[list, bool]:
        """Send many calls ``(fn, args, kwargs, result)`` at once (``Pool._submit_applies``):
        returns ``(result, exception)`` for each that could not be sent, and whether any call
        sent used shared memory; raises PoolStateError when the pool has stopped."""
        return self._submit_applies(calls)


def _pop_result(futures: list, timeout: float | None) -> Any:
    """The last future's result, the future popped first so no frame keeps it (its value)."""
    fut = futures.pop()
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        futures.append(fut)  # still unfinished: cancelled with the rest
        raise
    finally:
        del fut


def _dispatch(ref: weakref.ref) -> None:
    ex = ref()
    while ex is not None:
        calls = ex._next_calls()
        if not calls:
            return
        running = []
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                running.append(call)
            else:
                ex._finished(call)
        if running:
            try:
                ex._send_many(running)
            except BaseException as e:  # noqa: BLE001 - never leave the calls' futures waiting
                for call in running:
                    if not call.future.done():
                        ex._finished(call)
                        call.future.set_exception(e)
        del calls, running


def _close_when_idle(ex: Executor) -> None:
    ex._wait_idle()
    try:
        ex._pool.close()
        ex._pool.join()
    except (PoolStateError, PoolTerminatedError):
        pass


EXECUTOR_WIDE = 8  # how much wider the window gets for calls without shared memory
_reusable_lock = threading.Lock()
_reusable: tuple[Executor, tuple] | None = None


def get_reusable_executor(max_workers: int | None = None, **kwargs: Any) -> Executor:
    """An executor whose warm workers outlive ``with`` blocks (loky's ``get_reusable_executor``).

    JAX workers take seconds to start; this hands back the same executor, workers warm, for as
    long as it is asked for with the same arguments and is not broken. Leaving a ``with`` block
    or ``shutdown()`` waits for its calls but keeps the workers. Asking with other arguments
    shuts the previous one down (waiting for its calls) and starts a new one. Its workers end
    at interpreter exit, or with ``shutdown(wait)`` of :func:`shutdown_reusable_executor`.
    """
    global _reusable
    key = (max_workers, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
    with _reusable_lock:
        old = None
        if _reusable is not None:
            ex, old_key = _reusable
            if old_key == key and ex._broken is None:
                with ex._lock:
                    ex._shutdown = False
                return ex
            old = ex
        ex = Executor(max_workers, **kwargs)
        ex._reusable = True
        _reusable = (ex, key)
    if old is not None:
        _retire(old)
    return ex


def shutdown_reusable_executor(wait: bool = True) -> None:
    """End the reusable executor's workers (``wait``: after its calls finish)."""
    global _reusable
    with _reusable_lock:
        old, _reusable = (_reusable[0] if _reusable else None), None
    if old is not None:
        _retire(old, wait)


def _retire(ex: Executor, wait: bool = True) -> None:
    ex._reusable = False
    ex.shutdown(wait=wait)
