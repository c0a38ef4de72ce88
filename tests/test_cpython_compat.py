"""CPython's own tests, read from this interpreter's standard ``test`` package, against
jaxtransport's drop-ins:

- ``_TestConnection`` (``Lib/test/_test_multiprocessing.py``) with ``jaxtransport.multiprocessing``'s
  ``Pipe`` and ``Process``, per start method (``test_connection`` echoes ``send()`` through a
  child's ``recv_bytes``/``send_bytes`` and ``recv()``s it);
- ``FailingInitializerResourcesTest`` (``Lib/test/test_concurrent_futures/test_init.py``,
  Python 3.13+, gh-104090) with ``jaxtransport.Executor`` as the process pool, in a fresh
  interpreter (it stops that interpreter's resource tracker).

Nothing of CPython's is copied here: a Python whose ``test`` package lacks a module skips those
tests with the reason (some distributions leave the package out; ``test_concurrent_futures``
is a package from Python 3.12 on, with this test from 3.13).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
import unittest

import pytest

import jaxtransport.multiprocessing as jmp

from .conftest import run_python

METHODS = [m for m in ("spawn", "forkserver") if m in jmp.get_all_start_methods()]
pytestmark = pytest.mark.timeout(300)


def _cpython_test_module(name: str):
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        found = None
    if found is None:
        pytest.skip(f"this Python ({sys.version.split()[0]}) has no {name} in its standard test package")
    return importlib.import_module(name)


def _connection_case(method: str) -> type:
    """``_TestConnection`` with jaxtransport.multiprocessing's Pipe and Process (the stock test's
    ProcessesMixin, these two names replaced), as a class of this module: a spawned child finds
    the echo function (a classmethod) through it."""
    tm = _cpython_test_module("test._test_multiprocessing")
    name = f"JaxtransportConnection_{method}"
    cls = globals().get(name)
    if cls is None:
        ctx = jmp.get_context(method)
        cls = type(
            name,
            (tm._TestConnection, tm.ProcessesMixin, unittest.TestCase),
            {"Process": ctx.Process, "Pipe": staticmethod(ctx.Pipe), "__module__": __name__, "__test__": False},
        )
        globals()[name] = cls
    return cls


def _run(case: unittest.TestCase) -> None:
    result = unittest.TestResult()
    case.run(result)
    problems = result.errors + result.failures
    assert not problems, "\n".join(f"{test}:\n{trace}" for test, trace in problems)
    assert not result.skipped, result.skipped
    assert result.testsRun == 1


# Every test of CPython's _TestConnection (Python 3.10-3.13), fd passing through
# multiprocessing.reduction.send_handle included.
CONNECTION_TESTS = [
    "test_connection",
    "test_duplex_false",
    "test_spawn_close",
    "test_sendbytes",
    "test_fd_transfer",
    "test_large_fd_transfer",
    "test_missing_fd_transfer",
    "test_context",
]


@pytest.mark.parametrize("test", CONNECTION_TESTS)
@pytest.mark.parametrize("method", METHODS)
def test_cpython_test_connection(method, test):
    cls = _connection_case(method)  # made again under this name by a spawned child (below)
    if not hasattr(cls, test):
        pytest.skip(f"this Python's _TestConnection has no {test}")
    _run(cls(test))


RESOURCES_CHILD = textwrap.dedent("""
    import sys, unittest
    import jaxtransport as jt
    from test.test_concurrent_futures import test_init


    def jt_executor(max_workers=None, mp_context=None, **kwargs):
        return jt.Executor(max_workers, start_method=mp_context.get_start_method(), **kwargs)


    # The test classes the resources test runs, with jaxtransport.Executor as the executor.
    for name in ("ProcessPoolSpawnFailingInitializerTest", "ProcessPoolForkserverFailingInitializerTest"):
        base = getattr(test_init, name)
        setattr(test_init, name, type(name, (base,), {{"executor_type": staticmethod(jt_executor)}}))

    if __name__ == "__main__":
        case = test_init.FailingInitializerResourcesTest("test_{method}")
        result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(case)
        sys.exit(0 if result.wasSuccessful() and result.testsRun == 1 and not result.skipped else 1)
""")


@pytest.mark.parametrize("method", METHODS)
def test_cpython_failing_initializer_resources_test(method):
    test_init = _cpython_test_module("test.test_concurrent_futures.test_init")
    if not hasattr(test_init, "FailingInitializerResourcesTest"):
        pytest.skip("this Python's test_concurrent_futures has no FailingInitializerResourcesTest (3.13+)")
    proc = run_python(RESOURCES_CHILD.format(method=method), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr


# Spawned children import this module: give them the classes the parent made.
if importlib.util.find_spec("test") is not None and importlib.util.find_spec("test._test_multiprocessing"):
    for _m in METHODS:
        try:
            _connection_case(_m)
        except BaseException:  # noqa: BLE001 - a skip at import is no error here
            pass
