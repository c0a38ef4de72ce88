"""The debug lock-order checker (jaxtransport/_lockorder.py), which the suite runs with on.

It must catch an inversion against the written order and a cycle among unranked locks, stay
quiet for what cannot deadlock (re-entry, try-acquire, a condition's wait), and cost nothing
when off. The last test drives a real Pool at its memory cap: the path of issue 21 item 1
(a caller waiting for memory) took ``Arena.cond -> Engine.lock`` and is now checked.
"""

from __future__ import annotations

import pickle
import textwrap
import threading

import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _lockorder
from jaxtransport._errors import LockOrderError

from .conftest import run_python


@pytest.fixture
def checker():
    if not _lockorder.enabled():
        pytest.skip("the lock-order checker is off (JAXTRANSPORT_CHECK_LOCKS=0)")
    _lockorder.clear()
    yield
    _lockorder.clear()


def test_inversion_against_written_order_is_caught(checker):
    engine_lock = _lockorder.rlock("Engine.lock")
    arena = _lockorder.condition("Arena.cond")
    with engine_lock:
        with arena:  # the written order: fine
            pass
    assert _lockorder.violations() == []
    with arena:
        with engine_lock:  # issue 21 item 1: a hook taking the engine's lock under Arena.cond
            pass
    (found,) = _lockorder.violations()
    assert "'Engine.lock' taken while holding 'Arena.cond'" in found
    assert "test_inversion_against_written_order_is_caught" in found  # the stack that did it


def test_cycle_among_unranked_locks_is_caught(checker):
    a, b = _lockorder.lock("test.a"), _lockorder.lock("test.b")

    def one():
        with a, b:
            pass

    t = threading.Thread(target=one)
    t.start()
    t.join(10)
    assert _lockorder.violations() == []
    with b, a:
        pass
    (found,) = _lockorder.violations()
    assert "cycle" in found and "'test.a' taken while holding 'test.b'" in found
    assert "The opposite order" in found and "in one" in found


def test_what_cannot_deadlock_is_not_reported(checker):
    r = _lockorder.rlock("Engine.lock")
    cond = _lockorder.condition("Arena.cond")
    with r:
        with r:  # re-entry
            with cond:
                ticket = cond.park()
            assert not _lockorder.sleep(ticket, 0.001)  # parked under the lock, slept outside it
            with cond:
                cond.unpark(ticket)
                cond.wake_all()
    with cond:
        assert r.acquire(blocking=False)  # a try-acquire cannot deadlock
        r.release()
    assert _lockorder.violations() == []
    # a condition over a checked lock works across threads
    box = []

    def waiter():
        while True:
            with cond:
                if box:
                    return
                ticket = cond.park()
            _lockorder.sleep(ticket, 5)

    t = threading.Thread(target=waiter)
    t.start()
    with cond:
        box.append(1)
        cond.wake_all()
    t.join(10)
    assert not t.is_alive() and _lockorder.violations() == []


def test_raise_mode_raises_before_taking_the_lock(checker):
    try:
        _lockorder.enable(raise_at_once=True)
        inner, outer = _lockorder.lock("Lifecycle.lock"), _lockorder.lock("Sender.cond")
        with inner:
            with pytest.raises(LockOrderError, match=r"'Sender\.cond' taken while holding 'Lifecycle\.lock'"):
                outer.acquire()
        assert not outer.locked()
    finally:
        _lockorder.enable(raise_at_once=False)


def test_lock_order_error_pickles():
    err = LockOrderError("x under y")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is LockOrderError and back.args == ("x under y",) and isinstance(back, RuntimeError)


def test_off_means_plain_threading_locks():
    code = textwrap.dedent("""
        import threading
        from jaxtransport import _lockorder
        assert not _lockorder.enabled()
        assert type(_lockorder.lock("Engine.lock")) is type(threading.Lock())
        assert type(_lockorder.rlock("Engine.lock")) is type(threading.RLock())
        cond = _lockorder.condition("Arena.cond")
        assert type(cond) is _lockorder.Condition and isinstance(cond, type(threading.RLock()))
        assert type(cond).__enter__ is type(threading.RLock()).__enter__  # C: see the Ctrl-C note
        print("ok")
    """)
    proc = run_python(code, env={"JAXTRANSPORT_CHECK_LOCKS": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _slow_sum(x):
    import time

    time.sleep(0.05)
    return float(x.sum())


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_pool_at_its_memory_cap_takes_locks_in_order(checker, start_method):
    # Each submit waits in Arena.alloc for memory (the cap fits three 8 MiB slots): the wait
    # hook runs and reads the engine's in-flight count while dispatch moves slots under the
    # engine's lock. Before the fix the hook ran under Arena.cond and took Engine.lock.
    arrays = [np.full(2 << 20, i, np.float32) for i in range(8)]
    with jt.Pool(2, start_method=start_method, shm_capacity=32 << 20) as pool:
        results = [pool.apply_async(_slow_sum, (a,)) for a in arrays]
        assert [r.get(timeout=60) for r in results] == [float(a.sum()) for a in arrays]
    assert _lockorder.violations() == []
