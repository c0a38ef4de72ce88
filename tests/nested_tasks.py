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
    """In the calling (foreign) worker: a jt.Pool (a jax.Array both ways through shared memory),
    a jt.Executor, the joblib backend and jaxtransport.multiprocessing (Process and Queue with a
    numpy array through shared memory, Manager) with ``method`` each start and give correct
    results. Only the Pool's tasks need JAX, so that the other workers start without it. Returns
    what it saw, for the test."""
    import jax.numpy as jnp
    import joblib
    import numpy as np

    import jaxtransport as jt
    import jaxtransport.joblib as jtj
    import jaxtransport.multiprocessing as jmp

    seen: dict = {"pid": os.getpid(), "host_method": multiprocessing.get_start_method(allow_none=True)}
    x = jnp.arange(BIG, dtype=jnp.float32)
    with jt.Pool(1, start_method=method) as p:
        seen["pool"] = _same(p.apply(double, (x,)), x * 2) and p.map(abs, [-1, -2, -3]) == [1, 2, 3]
        seen["pool_child_method"] = p.apply(start_method_here)
    with jt.Executor(1, start_method=method) as ex:
        seen["executor"] = ex.submit(abs, -3).result(timeout=120) == 3 and list(ex.map(abs, [-4, -5])) == [4, 5]
    jtj.register()
    try:
        with joblib.parallel_config(backend="jaxtransport", n_jobs=2, start_method=method):
            seen["joblib"] = joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(4)) == [0, 1, 2, 3]
    finally:
        jtj.shutdown()
    ctx = jmp.get_context(method)
    q = ctx.Queue()
    a = np.arange(BIG, dtype=np.float32)
    proc = ctx.Process(target=put_double, args=(q, a))
    proc.start()
    got = q.get(timeout=120)
    proc.join(60)
    q.close()
    q.join_thread()
    with ctx.Manager() as manager:
        shared = manager.dict(a=1)
        shared["b"] = 2
        manager_ok = dict(shared) == {"a": 1, "b": 2}
    seen["multiprocessing"] = bool(np.array_equal(got, a * 2)) and proc.exitcode == 0 and manager_ok
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


class PicklesOnce:
    """An initializer argument that pickles once, then refuses: the second worker of a pool
    fails to start in the parent, after the first one started."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        if type(self).pickled > 1:
            raise TypeError("PicklesOnce pickles once, on purpose")
        return (PicklesOnce, ())


def noop(*_):
    pass
