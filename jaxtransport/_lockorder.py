"""A debug lock-order checker for the package's own locks (off, and free, unless switched on),
and the condition variable every wait of the package uses (Note [waits a Ctrl-C cannot break]).

Every lock of the pool machinery is made here, by name: :func:`lock`, :func:`rlock` and
:func:`condition`. Normally they return ``threading``'s own locks and a :class:`Condition`,
itself a C ``RLock`` (no wrapper, no cost).
With the checker on (``JAXTRANSPORT_CHECK_LOCKS=1`` in the environment when the lock is made,
or :func:`enable`; the test suite turns it on in ``tests/conftest.py``) they return wrappers
that record, per thread, which locks it holds; taking a lock while holding one that the
written order puts after it (``ORDER``, the one order of Note [pool engine] in
``jaxtransport/pool/__init__.py``), or closing a cycle in the graph of orders actually seen
(for locks the written order does not rank), is an inversion. The first inversion is kept
with both stacks; ``violations()`` returns them (the suite fails the test that made one), and
with ``JAXTRANSPORT_CHECK_LOCKS=raise`` the acquiring thread raises LockOrderError at once.

Try-acquires (``blocking=False``) and re-entry of an RLock the thread holds cannot deadlock
and are not checked; a condition's ``wait`` releases and takes its lock again through the
wrapper, so a wait under another lock is checked like any acquire.

A debug tool, not safe against asynchronous exceptions: a KeyboardInterrupt raised between
the wrapped lock's acquire and its bookkeeping leaves the lock held (the next thread to want
it waits for ever). Tests that interrupt a process (Ctrl-C) run it with the checker off.
"""

from __future__ import annotations

import _thread
import collections
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from ._errors import LockOrderError

# Note [loops that end in a test]
# CPython checks for signals on a loop's back edge. From 3.12 its compiler can leave that jump
# (and the test before it) out of the frame's exception table even inside a ``with`` or ``try``:
# a loop whose body ends in an ``if``, a ``while <test>:`` loop, a filtered list comprehension
# (python/cpython#108214, #130279). A KeyboardInterrupt raised there leaves the frame without
# running the ``with`` exit or the ``finally``: ``with lock:`` leaves the lock held for ever.
# On 3.13.0 a Ctrl-C did that to a Pool's engine lock (``Engine._enqueue``), hanging the
# pool's next result. So inside a ``with`` or ``try`` the package writes such loops in shapes
# the compiler covers: ``if not <test>: continue`` before an unconditional end,
# ``while True: if <done>: break``, ``list(<generator>)`` (a frame of its own), or a call.
# tests/test_async_exceptions.py compiles every module with the running interpreter and fails on
# any loop that could skip a ``with`` exit, a ``finally`` or an ``except BaseException``.

# Note [waits a Ctrl-C cannot break]
# A KeyboardInterrupt is raised in the main thread at the next "eval breaker" check after the
# SIGINT: at a function's start (RESUME), after a call returns (the CALL instructions), at a
# loop's back edge; not between a C function taking a lock and returning. So only these are
# safe against it:
# - ``with lock:`` on a C lock (``_thread.lock``, ``_thread.RLock``): BEFORE_WITH calls the
#   C ``__enter__`` and the block's exception handler covers the very next instruction; the
#   exit calls the C ``__exit__``, which releases before any check. No Python frame runs
#   between taking the lock and the handler that gives it back.
# - a blocking ``acquire()`` of a lock nobody else depends on: interrupted while it waits, it
#   returns without the lock; interrupted just after it took it, the lock is simply dropped.
# ``threading.Condition``, and ``threading.Event`` and ``concurrent.futures.Future`` built on
# it, are not: ``Condition.__enter__``/``__exit__`` are Python functions around the lock's (an
# interrupt after the inner acquire, or at ``__exit__``'s start, leaves the lock held:
# CPython gh-148874; Lib/threading.py 3.11.7 lines 271-275, 3.13.0 lines 303-307), and
# ``Condition.wait`` releases the lock in Python (``_release_save``) before its ``try`` (3.11.7
# lines 321-324): interrupted there, the caller's ``with`` releases a lock it no longer holds.
# The Pool once hung so: a Ctrl-C in ``AsyncResult.get()`` left the result's Event locked, and
# the manager thread, setting it, waited for ever (about once in 90,000 Ctrl-Cs).
#
# So every wait of the package is built on :class:`Condition`: a C ``RLock`` (``with cond:`` is
# the safe form above) with a list of parked waiters. A waiter never releases the lock by
# hand: under ``with cond:`` it checks its state and, if it must wait, parks a ticket of its
# own (a fresh ``_thread.lock``, taken once); it leaves the ``with`` and sleeps on the ticket
# (:func:`sleep`, holding no lock), then looks again under ``with cond:``. A waker, under
# ``with cond:``, changes the state and calls ``wake_all()``, which releases every parked
# ticket in one C call (a ``deque(maxlen=0).extend`` of a ``map``): interrupted, it woke all of
# them or none, and the tickets it woke are no longer listed. A KeyboardInterrupt anywhere
# leaves at most a ticket nobody will take (released at the next ``wake_all()``, or dropped
# with its object) and never a lock held. A woken waiter always looks at the state again, so
# a wakeup too many is harmless. Waiters that time out unpark their ticket.
# What is left: a second Ctrl-C while the first one's handler runs (a ``finally`` or ``except``)
# can still stop that handler half-way, as anywhere in Python.

# The one order, outermost first: a thread holding a lock may take only locks further down.
# Names of the same rank are never held together. Keep in step with Note [pool engine].
ORDER: tuple[tuple[str, ...], ...] = (
    ("Executor._lock",),
    ("Engine.space",),
    ("Engine.lock",),
    ("Sender.cond", "CallbackRunner.lock", "MapResult._lock", "IMapIterator._cond"),
    ("Lifecycle.lock", "Pins.lock"),
    ("Arena.cond",),
    ("results._EVENTS_LOCK",),
)
_RANK = {name: i for i, names in enumerate(ORDER) for name in names}

_enabled = os.environ.get("JAXTRANSPORT_CHECK_LOCKS", "") not in ("", "0")
_raise = os.environ.get("JAXTRANSPORT_CHECK_LOCKS", "") == "raise"
_state = threading.local()  # .held: list of checked locks this thread holds, in order taken
_graph_lock = threading.Lock()  # guards _edges and _violations (a raw lock: never checked)
_edges: dict[str, dict[str, str]] = {}  # outer name -> {inner name: stack where first seen}
_violations: list[str] = []


def enable(raise_at_once: bool = False) -> None:
    """Check every lock made from now on (locks made earlier stay as they are)."""
    global _enabled, _raise
    _enabled, _raise = True, raise_at_once


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


def violations() -> list[str]:
    """The inversions seen so far (each: both orders, with the stacks that took them)."""
    with _graph_lock:
        return list(_violations)


def clear() -> None:
    with _graph_lock:
        _violations.clear()


def lock(name: str):
    """A ``threading.Lock`` named ``name`` (checked when the checker is on)."""
    return _Checked(name, threading.Lock(), reentrant=False) if _enabled else threading.Lock()


def rlock(name: str):
    return _Checked(name, threading.RLock(), reentrant=True) if _enabled else threading.RLock()


def condition(name: str, *, checked: bool = True) -> Condition:
    """A :class:`Condition` named ``name`` (checked when the checker is on, unless ``checked``
    is False: a lock held many at a time in an order of its own, as ``concurrent.futures.wait``
    holds every future's)."""
    return _CheckedCondition(name) if _enabled and checked else Condition(name)


_allocate = _thread.allocate_lock
_RELEASE = _thread.LockType.release
_DRAIN: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # runs an iterator to its end in C
TIMEOUT_MAX = threading.TIMEOUT_MAX


def sleep(ticket: Any, timeout: float | None = None) -> bool:
    """Sleep on a ticket from :meth:`Condition.park` until it is woken (True) or ``timeout``
    seconds passed (False). Holding no lock; a KeyboardInterrupt here leaves nothing held."""
    if timeout is None or timeout >= TIMEOUT_MAX:
        return bool(ticket.acquire())
    return bool(ticket.acquire(True, timeout if timeout > 0 else 0.0))


class Condition(_thread.RLock):  # type: ignore[misc]
    """A lock (a C ``RLock``: ``with cond:`` cannot be left held by a KeyboardInterrupt) with a
    condition variable that no KeyboardInterrupt can break: waiters park a ticket under the
    lock and sleep on it outside (Note [waits a Ctrl-C cannot break])::

        while True:
            with cond:
                if ready():
                    break
                ticket = cond.park()
            sleep(ticket)          # or: if not sleep(ticket, left): with cond: cond.unpark(ticket)

        with cond:                 # the waker
            make_ready()
            cond.wake_all()
    """

    __slots__ = ("_parked", "name")

    def __new__(cls, name: str = "") -> Condition:
        return super().__new__(cls)

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._parked: list = []

    # The waiting half: every method is called with the lock held.
    def park(self) -> Any:
        """A ticket for :func:`sleep`, woken by the next :meth:`wake_all`."""
        ticket = _allocate()
        ticket.acquire()
        self._parked.append(ticket)
        return ticket

    def unpark(self, ticket: Any) -> None:
        """Forget a ticket whose sleep timed out (already woken: nothing to do)."""
        try:
            self._parked.remove(ticket)
        except ValueError:
            pass

    def wake_all(self) -> None:
        """Wake every parked waiter: all of them or, interrupted before, none."""
        if not self._parked:
            return
        wakers = map(_RELEASE, self._parked)
        self._parked = []
        _DRAIN(wakers)  # one C call: no KeyboardInterrupt between two releases

    def wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Until ``ready()`` (called with this lock held) is true (True) or ``timeout`` seconds
        passed (False: ``ready()`` was still false, checked once more after the timeout). The
        park-and-sleep loop of the class docstring, for waiters that need nothing else."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self:
                if ready():
                    return True
                ticket = self.park()
            if not sleep(ticket, None if deadline is None else deadline - time.monotonic()):
                with self:
                    self.unpark(ticket)
                    return bool(ready())

    def waiting(self) -> int:
        """How many tickets are parked (a waiter interrupted in its sleep counts until the next
        ``wake_all``)."""
        return len(self._parked)

    def __repr__(self) -> str:
        return f"<jaxtransport condition {self.name!r}>"


class _CheckedCondition(Condition):  # type: ignore[misc]
    """A :class:`Condition` whose locking goes through the checker (a debug tool: not safe
    against a KeyboardInterrupt, as the module docstring says). Its own RLock is unused."""

    __slots__ = ("_lock",)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lock = _Checked(name, threading.Lock(), reentrant=False)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()

    def locked(self) -> bool:
        return self._lock.locked()

    def __repr__(self) -> str:
        return f"<checked condition {self.name!r}>"


def _held() -> list:
    held = getattr(_state, "held", None)
    if held is None:
        held = _state.held = []
    return held


def _reaches(src: str, dst: str) -> bool:
    """Graph lock held: is there a path ``src`` -> ... -> ``dst`` in the orders seen?"""
    seen, todo = set(), [src]
    while todo:
        n = todo.pop()
        if n == dst:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(_edges.get(n, ()))
    return False


def _check(new: _Checked, held: list) -> None:
    problem = None
    for h in held:
        if h is new:
            continue
        outer, inner = h.name, new.name
        ro, ri = _RANK.get(outer), _RANK.get(inner)
        here = None
        if ro is not None and ri is not None and ri <= ro:
            here = "".join(traceback.format_stack(limit=16)[:-2])
            problem = (
                f"lock-order inversion: {inner!r} taken while holding {outer!r}, but the written "
                f"order (Note [pool engine], _lockorder.ORDER) puts {inner!r} "
                f"{'at the same rank as' if ri == ro else 'before'} {outer!r}.\n"
                f"Thread {threading.current_thread().name!r} holds {[x.name for x in held]}; stack:\n{here}"
            )
            break
        with _graph_lock:
            known = _edges.setdefault(outer, {})
            if inner in known:
                continue
            here = here or "".join(traceback.format_stack(limit=16)[:-2])
            if _reaches(inner, outer):
                problem = (
                    f"lock-order cycle: {inner!r} taken while holding {outer!r}, and the opposite "
                    f"order was seen before.\nThread {threading.current_thread().name!r} holds "
                    f"{[x.name for x in held]}; stack:\n{here}"
                )
                back = _edges.get(inner, {}).get(outer)
                if back:
                    problem += f"\nThe opposite order ({outer!r} under {inner!r}) was first taken at:\n{back}"
                break
            known[inner] = here
    if problem is not None:
        with _graph_lock:
            first = not _violations
            _violations.append(problem)
        if first:  # seen even where nobody asks (a pool worker, a child interpreter)
            try:
                sys.stderr.write(f"jaxtransport: {problem}\n")
            except Exception:  # noqa: BLE001
                pass
        if _raise:
            raise LockOrderError(problem)


class _Checked:
    """A Lock/RLock that checks the order it is taken in (see the module docstring)."""

    __slots__ = ("_count", "_inner", "_owner", "_reentrant", "name")

    def __init__(self, name: str, inner, reentrant: bool):
        self.name, self._inner, self._reentrant = name, inner, reentrant
        self._owner: int | None = None
        self._count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        held = _held()
        if blocking and not (self._reentrant and self._owner == me):
            _check(self, held)
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            self._owner = me
            self._count += 1
            held.append(self)
        return ok

    def release(self) -> None:
        held = _held()
        self._count -= 1
        if self._count == 0:
            self._owner = None
        for i in range(len(held) - 1, -1, -1):
            if held[i] is self:
                del held[i]
                break
        self._inner.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._inner.locked() if hasattr(self._inner, "locked") else self._owner is not None

    # threading.Condition uses these when its lock has them.
    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def _release_save(self):
        count = self._count
        for _ in range(count):
            self.release()
        return count

    def _acquire_restore(self, count) -> None:
        for _ in range(count):
            self.acquire()

    def __repr__(self) -> str:
        return f"<checked lock {self.name!r} owner={self._owner}>"
