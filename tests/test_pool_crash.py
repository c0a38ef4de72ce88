"""A crash-case table (loky's ``crash_cases`` is the model): failures injected while pickling
and unpickling the function, the arguments and the result, in the worker and in the parent, and
worker exits and segfaults. Every case ends within its bound, fails only its own task (the pool
goes on), and leaves no process, fd or shared-memory segment behind (conftest checks processes
and /dev/shm; this file checks fds)."""

from __future__ import annotations

import ctypes
import multiprocessing.pool
import os
import time

import pytest

import jaxtransport as jt
from jaxtransport import WorkerLostError

from .conftest import wait_until

pytestmark = pytest.mark.timeout(180)


class Boom(Exception):
    pass


def _raise():
    raise Boom("injected")


def _segfault():
    ctypes.string_at(0)


def _exit():
    os._exit(3)


def _in_worker() -> bool:
    import multiprocessing

    return multiprocessing.current_process().daemon


class Fails:
    """Pickles fine in the parent; its unpickling runs ``action`` (in whichever process)."""

    def __init__(self, action):
        self.action = action

    def __reduce__(self):
        return (_unpickle, (self.action.__name__,))


def _unpickle(name):
    globals()[name]()


class FailsToPickle:
    """Raises (or exits, or segfaults) while being pickled, wherever that happens."""

    def __init__(self, action):
        self.action = action

    def __reduce__(self):
        self.action()
        return (int, ())


def echo(x):
    return x


def call(fn):
    return fn()


def return_failing_to_unpickle(name):
    return Fails(globals()[name])  # pickles in the worker; unpickling in the parent fails


def return_failing_to_pickle(name):
    return FailsToPickle(globals()[name])


def identity_fn(*_):
    return 1


# (id, how to submit, expected: an exception class raised by the call itself ("caller") or by
# the result ("task"))
CASES = [
    ("pickle-function-in-parent", lambda p: p.apply_async(FailsToPickle(_raise)), ("caller", Boom)),
    ("unpickle-function-in-worker-raises", lambda p: p.apply_async(Fails(_raise)), ("task", Boom)),
    ("unpickle-function-in-worker-exits", lambda p: p.apply_async(Fails(_exit)), ("task", WorkerLostError)),
    ("unpickle-function-in-worker-segfaults", lambda p: p.apply_async(Fails(_segfault)), ("task", WorkerLostError)),
    ("pickle-args-in-parent", lambda p: p.apply_async(echo, (FailsToPickle(_raise),)), ("caller", Boom)),
    ("unpickle-args-in-worker-raises", lambda p: p.apply_async(echo, (Fails(_raise),)), ("task", Boom)),
    ("unpickle-args-in-worker-exits", lambda p: p.apply_async(echo, (Fails(_exit),)), ("task", WorkerLostError)),
    ("task-raises", lambda p: p.apply_async(call, (_raise,)), ("task", Boom)),
    ("task-exits", lambda p: p.apply_async(call, (_exit,)), ("task", WorkerLostError)),
    ("task-segfaults", lambda p: p.apply_async(call, (_segfault,)), ("task", WorkerLostError)),
    ("pickle-result-in-worker-raises", lambda p: p.apply_async(return_failing_to_pickle, ("_raise",)),
     ("task", multiprocessing.pool.MaybeEncodingError)),
    ("pickle-result-in-worker-exits", lambda p: p.apply_async(return_failing_to_pickle, ("_exit",)),
     ("task", WorkerLostError)),
    ("unpickle-result-in-parent-raises", lambda p: p.apply_async(return_failing_to_unpickle, ("_raise",)),
     ("task", Boom)),
    ("map-chunk-in-worker-exits", lambda p: p.map_async(call, [identity_fn, _exit, identity_fn], chunksize=1),
     ("task", WorkerLostError)),
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module", autouse=True)
def services_started():
    """multiprocessing opens a process-wide pipe (its resource tracker) at the first spawn:
    start it before any fd is counted."""
    with jt.Pool(1) as p:
        p.apply(abs, (-1,))


@pytest.mark.parametrize("submit, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_crash_case(submit, expected):
    where, exc_type = expected
    fds = open_fds()
    start = time.monotonic()
    with jt.Pool(2) as p:
        if where == "caller":
            with pytest.raises(exc_type):
                submit(p)
        else:
            r = submit(p)
            with pytest.raises(exc_type):
                r.get(60)
        assert p.map(abs, range(-3, 0)) == [3, 2, 1]  # only that task failed
    assert time.monotonic() - start < 90
    assert wait_until(lambda: open_fds() <= fds, 10), f"fds: {open_fds()} now, {fds} before"
