"""jaxtransport.Executor: the concurrent.futures face of the Pool's engine, through the public API."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport.pool import shutdown_reusable_executor


def square(x):
    return x * x


def add(a, b=0):
    return a + b


def fail(msg):
    raise ValueError(msg)


def nap(s):
    time.sleep(s)
    return s


def pid(_=None):
    return os.getpid()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def double(x):
    return x * 2


@pytest.fixture(params=["spawn", "forkserver"])
def executor(request):
    with jt.Executor(2, start_method=request.param) as ex:
        yield ex


def test_submit_map_and_futures_helpers(executor):
    assert executor.submit(add, 2, b=3).result(timeout=60) == 5
    assert list(executor.map(square, range(7))) == [i * i for i in range(7)]
    assert list(executor.map(add, range(10), range(10), chunksize=3)) == [2 * i for i in range(10)]
    fs = [executor.submit(square, i) for i in range(12)]
    assert sorted(f.result() for f in cf.as_completed(fs, timeout=60)) == [i * i for i in range(12)]
    done, not_done = cf.wait(fs, timeout=60)
    assert len(done) == 12 and not not_done

    async def main():
        return await asyncio.gather(*(asyncio.wrap_future(executor.submit(square, i)) for i in range(5)))

    assert asyncio.run(main()) == [0, 1, 4, 9, 16]


def test_done_callbacks_run_on_the_callback_thread_never_the_manager(executor):
    # A future without done-callbacks is completed by the pool's manager thread directly (no
    # hop); one with a callback must still be completed where user code may run and block.
    import threading

    seen, ready = [], threading.Event()

    def slow_callback(f):
        seen.append((threading.current_thread().name, f.result()))
        time.sleep(0.5)  # blocking here must not stall other futures' completion
        ready.set()

    f1 = executor.submit(nap, 0.3)
    f1.add_done_callback(slow_callback)
    others = [executor.submit(square, i) for i in range(20)]
    assert [f.result(timeout=60) for f in others] == [i * i for i in range(20)]
    assert ready.wait(60)
    assert seen == [("jaxtransport-pool-callbacks", 0.3)]
    late = executor.submit(square, 3)
    assert late.result(timeout=60) == 9
    names = []
    late.add_done_callback(lambda f: names.append(threading.current_thread().name))
    assert names == [threading.current_thread().name]  # done already: runs in the adder's thread


def test_exception_carries_the_remote_traceback(executor):
    f = executor.submit(fail, "boom")
    with pytest.raises(ValueError, match="boom") as info:
        f.result(timeout=60)
    assert "fail" in str(info.value.__cause__)  # the worker's traceback names the function
    assert isinstance(f.exception(), ValueError)


def test_jax_arrays_through_shared_memory(executor):
    x = jnp.arange(1 << 20, dtype=jnp.float32)  # 4 MiB: above the shared-memory threshold
    y = executor.submit(double, x).result(timeout=60)
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    w = jnp.asarray(1.5) * 1  # weak-typed scalar stays weak
    assert w.weak_type
    assert executor.submit(double, w).result(timeout=60).weak_type


def test_map_timeout_and_early_close_cancel():
    with jt.Executor(1) as ex:
        ex.submit(square, 1).result(timeout=60)  # started
        it = ex.map(nap, [2.0, 0.0, 0.0])
        with pytest.raises(cf.TimeoutError):
            list(ex.map(nap, [3.0], timeout=0.2))
        assert next(it) == 2.0
        it.close()


def test_shutdown_cancel_futures_cancels_only_pending():
    ex = jt.Executor(1)
    first = ex.submit(nap, 1.0)
    queued = [ex.submit(nap, 0.0) for _ in range(10)]  # beyond 2 in flight they wait here
    ex.shutdown(wait=True, cancel_futures=True)
    assert first.result() == 1.0
    cancelled = [f for f in queued if f.cancelled()]
    assert len(cancelled) >= 8
    assert all(f.result() == 0.0 for f in queued if not f.cancelled())
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(square, 2)


def test_future_cancel_while_pending():
    with jt.Executor(1) as ex:
        ex.submit(nap, 0.5)
        ex.submit(nap, 0.5)
        last = ex.submit(nap, 0.5)  # third: pending in the executor
        assert last.cancel()
        assert last.cancelled()


def test_tracer_fails_at_submit_with_its_path():
    with jt.Executor(1) as ex:
        for _ in range(2):
            ex.submit(nap, 0.3)  # fill the in-flight slots: the next call would be queued

        @jax.jit
        def f(x):
            with pytest.raises(jt.TracerTransportError, match=r"args\[0\]\['w'\]"):
                ex.submit(square, {"w": x})
            return x

        f(jnp.ones(3))
        with pytest.raises(jt.TracerTransportError):
            jax.jit(lambda x: ex.submit(square, x) and x)(jnp.ones(2))


def test_worker_death_fails_only_its_future():
    with jt.Executor(2) as ex:
        dead = ex.submit(die)
        with pytest.raises(cf.process.BrokenProcessPool):
            dead.result(timeout=60)
        assert isinstance(dead.exception(), jt.WorkerLostError)
        assert ex.submit(square, 4).result(timeout=60) == 16  # replaced, still running


def boom_init():
    raise RuntimeError("no model")


def test_broken_pool_raises_broken_executor():
    ex = jt.Executor(1, boom_init)
    f = ex.submit(square, 2)
    with pytest.raises(cf.BrokenExecutor):
        f.result(timeout=60)
    with pytest.raises(cf.BrokenExecutor):
        for _ in range(50):  # the pool notices its initializer failed
            ex.submit(square, 2).result(timeout=60)
            time.sleep(0.1)
    ex.shutdown(wait=True)


def test_reusable_executor_keeps_warm_workers_across_with_blocks():
    try:
        with jt.get_reusable_executor(1) as ex:
            first = ex.submit(pid).result(timeout=60)
        with jt.get_reusable_executor(1) as ex2:
            assert ex2 is ex
            assert ex2.submit(pid).result(timeout=60) == first  # same warm worker
        other = jt.get_reusable_executor(1, placement="host")  # other arguments: a new one
        assert other is not ex
        assert other.submit(pid).result(timeout=60) != first
    finally:
        shutdown_reusable_executor()


def test_executor_cannot_be_pickled():
    import pickle

    with jt.Executor(1) as ex:
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(ex)
