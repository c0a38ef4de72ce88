"""The Executor's futures: ``concurrent.futures.Future`` whose waits no Ctrl-C can break.

A stock ``Future`` guards its state with a ``threading.Condition``: ``result()`` enters it
with ``with self._condition:`` (a Python ``__enter__``) and waits with ``Condition.wait``, so a
Ctrl-C in ``result()`` can leave the future's lock held, and the pool's manager thread, setting
the future, then waits for ever (Note [waits a Ctrl-C cannot break] in ``jaxtransport._lockorder``).

This future keeps the stock one's attributes (``_condition``, ``_state``, ``_waiters``, ...)
so that ``concurrent.futures.wait``, ``as_completed`` and ``asyncio.wrap_future`` work as with
any future, and it is a ``concurrent.futures.Future``. Its ``_condition`` is a
``_lockorder.Condition``, a C ``RLock`` (``with`` cannot leave it held), and its waits park on
it (``result``, ``exception``). The methods it inherits unchanged use only ``with
self._condition:`` (``done``, ``running``, ``cancelled``, ``add_done_callback``,
``set_running_or_notify_cancel``, ``__repr__``); those that notify are its own.
``concurrent.futures.wait`` and ``as_completed`` are the standard library's: they take each
future's lock in a Python loop and wait on a ``threading.Event`` of their own, so a Ctrl-C
inside them can still, rarely, leave a lock held (as with any executor's futures).
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import _base
from typing import Any

from .. import _lockorder

__all__ = ["Future"]

_DONE = (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED, _base.FINISHED)
_CANCELLED = (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED)


class Future(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` whose ``result()`` and ``exception()`` a KeyboardInterrupt
    cannot leave locked (the module docstring)."""

    def __init__(self) -> None:
        # The stock __init__'s attributes (not called: its threading.Condition is what this
        # future replaces). Held many at a time by concurrent.futures.wait, in id() order: so
        # not checked by name.
        self._condition = _lockorder.condition("Future._condition", checked=False)  # type: ignore[assignment]
        self._state = _base.PENDING
        self._result = None
        self._exception: BaseException | None = None
        self._waiters: list = []
        self._done_callbacks: list = []

    def _wait(self, timeout: float | None) -> None:
        """Until the future is done (finished or cancelled) or ``timeout`` seconds passed."""
        cond: Any = self._condition
        cond.wait_for(lambda: self._state in _DONE, timeout)

    def result(self, timeout: float | None = None) -> Any:
        try:
            self._wait(timeout)
            state = self._state
            if state in _CANCELLED:
                raise concurrent.futures.CancelledError()
            if state != _base.FINISHED:
                raise concurrent.futures.TimeoutError()
            if self._exception is not None:
                raise self._exception
            return self._result
        finally:
            # Break a reference cycle with the exception's traceback (as the stock future).
            self = None  # type: ignore[assignment]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        state = self._state
        if state in _CANCELLED:
            raise concurrent.futures.CancelledError()
        if state != _base.FINISHED:
            raise concurrent.futures.TimeoutError()
        return self._exception

    def cancel(self) -> bool:
        cond: Any = self._condition
        with cond:
            if self._state in (_base.RUNNING, _base.FINISHED):
                return False
            if self._state in _CANCELLED:
                return True
            self._state = _base.CANCELLED
            cond.wake_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]
        return True

    def set_result(self, result: Any) -> None:
        cond: Any = self._condition
        with cond:
            if self._state in _DONE:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            self._result = result
            self._state = _base.FINISHED
            for waiter in self._waiters:
                waiter.add_result(self)
            cond.wake_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]

    def set_exception(self, exception: BaseException | None) -> None:
        cond: Any = self._condition
        with cond:
            if self._state in _DONE:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            self._exception = exception
            self._state = _base.FINISHED
            for waiter in self._waiters:
                waiter.add_exception(self)
            cond.wake_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]
