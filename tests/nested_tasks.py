"""Tasks that tests/test_nested.py runs inside another library's worker process (a loky worker,
a ``concurrent.futures.ProcessPoolExecutor`` worker, a Ray task): each starts jaxtransport's
processes from there. An importable module, so that every host finds them by name."""

from __future__ import annotations

import multiprocessing
import os

BIG = 1 << 18  # float32 elements: 1 MiB, over the Pool's shared-memory threshold


def double(x):
    return x * 2


def start_method_here(_=None):
    """This process's default start method (what its parent told it at spawn)."""
    return multiprocessing.get_start_method(allow_none=True)


def put_start_method(q):
    q.put(start_method_here())


def put_double(q, x):
    q.put(x * 2)


def _same(got, want) -> bool:
    import jax
    import numpy as np

    return isinstance(got, jax.Array) and np.array_equal(np.asarray(got), np.asarray(want))


def every_face(method: str) -> dict:
    """In the calling (foreign) worker: a jt.Pool, a jt.Executor, the joblib backend and
    jaxtransport.multiprocessing (Process, Queue, Manager) with ``method`` each start and give
    correct results, jax.Arrays through shared memory. Returns what it saw, for the test."""
    import jax.numpy as jnp
    import joblib

    import jaxtransport as jt
    import jaxtransport.joblib as jtj
    import jaxtransport.multiprocessing as jmp

    seen: dict = {"pid": os.getpid(), "host_method": multiprocessing.get_start_method(allow_none=True)}
    x = jnp.arange(BIG, dtype=jnp.float32)
    with jt.Pool(1, start_method=method) as p:
        seen["pool"] = _same(p.apply(double, (x,)), x * 2) and p.map(abs, [-1, -2, -3]) == [1, 2, 3]
        seen["pool_child_method"] = p.apply(start_method_here)
    with jt.Executor(1, start_method=method) as ex:
        seen["executor"] = _same(ex.submit(double, x).result(timeout=120), x * 2) and list(
            ex.map(abs, [-4, -5])
        ) == [4, 5]
    jtj.register()
    try:
        with joblib.parallel_config(backend="jaxtransport", n_jobs=2, start_method=method):
            out = joblib.Parallel()(joblib.delayed(double)(x + i) for i in range(3))
        seen["joblib"] = all(_same(y, (x + i) * 2) for i, y in enumerate(out))
    finally:
        jtj.shutdown()
    ctx = jmp.get_context(method)
    q = ctx.Queue()
    proc = ctx.Process(target=put_double, args=(q, x))
    proc.start()
    got = q.get(timeout=120)
    proc.join(60)
    q.close()
    q.join_thread()
    with ctx.Manager() as manager:
        shared = manager.dict(a=1)
        shared["b"] = 2
        manager_ok = dict(shared) == {"a": 1, "b": 2}
    seen["multiprocessing"] = _same(got, x * 2) and proc.exitcode == 0 and manager_ok
    return seen


def refusals(method: str) -> dict:
    """In a daemonic worker (multiprocessing.Pool's, jaxtransport's own): what each face does.
    A Pool and an Executor refuse with jaxtransport's message, the joblib backend runs the loop
    in this process (joblib's rule, with its warning), and a jaxtransport.multiprocessing
    Process is refused by the standard library (daemonic processes may not have children)."""
    import warnings

    import joblib

    import jaxtransport as jt
    import jaxtransport.joblib as jtj
    import jaxtransport.multiprocessing as jmp

    seen: dict = {"daemon": multiprocessing.current_process().daemon}
    for face, make in (("pool", jt.Pool), ("executor", jt.Executor)):
        try:
            make(1, start_method=method)
        except jt.PoolStateError as e:
            seen[face] = str(e)
        else:
            seen[face] = "started"
    jtj.register()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with joblib.parallel_config(backend="jaxtransport", n_jobs=2, start_method=method):
                out = joblib.Parallel()(joblib.delayed(os.getpid)() for _ in range(3))
        seen["joblib"] = (out == [os.getpid()] * 3, [str(w.message) for w in caught])
    finally:
        jtj.shutdown()
    proc = jmp.get_context(method).Process(target=os.getpid)
    try:
        proc.start()
    except AssertionError as e:
        seen["multiprocessing"] = str(e)
    else:
        proc.join(60)
        seen["multiprocessing"] = "started"
    return seen
