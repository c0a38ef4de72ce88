"""jaxtransport.Pool behaves as multiprocessing.Pool where a user can tell: the remote
traceback's class, MaybeEncodingError for results that do not pickle (where the stock pool
raises it for a returned lambda or local function, jaxtransport returns it by value, as loky and
Ray do), worker tracebacks with file names and lines; and the smaller defects of the first
engine (a task right after an idle worker died, an initializer's error class from __main__, a
Pool created inside a worker)."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.pool
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import jaxtransport as jt

from .conftest import ROOT

pytestmark = pytest.mark.timeout(180)


def fail(x):
    raise ValueError(f"bad {x}")


def make_lambda(_=None):
    return lambda: 1


def make_lock(_=None):
    import threading

    return threading.Lock()


def nested_pool(_=None):
    import jaxtransport as jt

    with jt.Pool(1):
        return "created"


@pytest.fixture(scope="module")
def pools():
    ctx = multiprocessing.get_context("spawn")
    with jt.Pool(1) as ours, ctx.Pool(1) as stock:
        yield ours, stock


def outcome(pool, fn, arg):
    try:
        return ("ok", pool.apply(fn, (arg,)))
    except BaseException as e:  # noqa: BLE001
        return ("raised", e)


def test_remote_traceback_is_multiprocessings_class(pools):
    for pool in pools:
        kind, e = outcome(pool, fail, 3)
        assert kind == "raised" and isinstance(e, ValueError) and str(e) == "bad 3"
        assert isinstance(e.__cause__, multiprocessing.pool.RemoteTraceback)
        assert 'raise ValueError(f"bad {x}")' in str(e.__cause__)


def test_unpicklable_result_is_maybe_encoding_error_like_the_stock_pool(pools):
    ours, stock = (outcome(p, make_lock, 0) for p in pools)
    assert stock[0] == "raised" and type(stock[1]) is multiprocessing.pool.MaybeEncodingError
    assert ours[0] == "raised" and type(ours[1]) is multiprocessing.pool.MaybeEncodingError
    assert "Error sending result" in str(ours[1]) and "lock" in str(ours[1])
    assert pools[0].apply(abs, (-2,)) == 2  # the worker is fine


def make_partial_of_local(n):
    def add(a, b):
        return a + b + n

    return functools.partial(add, 1)


@pytest.mark.parametrize("fn, check", [
    (make_lambda, lambda f: f() == 1),
    (make_partial_of_local, lambda f: f(2) == 3 + 7),
], ids=["lambda", "partial-of-local-function"])
def test_results_the_stock_pool_cannot_send_come_back_by_value(pools, fn, check):
    ours, stock = (outcome(p, fn, 7) for p in pools)
    assert stock[0] == "raised" and type(stock[1]) is multiprocessing.pool.MaybeEncodingError
    assert ours[0] == "ok" and check(ours[1])


def test_a_task_right_after_an_idle_worker_died_runs_on_its_replacement():
    with jt.Pool(1) as p:
        pid = p.apply(os.getpid)
        os.kill(pid, signal.SIGKILL)
        assert p.apply(abs, (-7,)) == 7  # never "lost while running": it never ran there
        assert p.apply(os.getpid) != pid


def test_a_pool_inside_a_worker_says_what_to_do():
    with jt.Pool(1) as p:
        with pytest.raises(jt.PoolStateError, match="inside a daemonic process"):
            p.apply(nested_pool)


SCRIPT = textwrap.dedent('''
    import sys
    import jaxtransport as jt


    class InitFailed(Exception):
        pass


    def bad_init():
        raise InitFailed("no device for this worker")


    def task(x):
        return 1 / x


    if __name__ == "__main__":
        with jt.Pool(1) as p:
            try:
                p.apply(task, (0,))
            except ZeroDivisionError as e:
                print("TRACEBACK", repr(str(e.__cause__)))
        p = jt.Pool(1, bad_init)
        try:
            p.apply(task, (1,))
        except jt.PoolStateError as e:
            print("INIT", repr(str(e)))
        finally:
            p.terminate()
''')


def test_main_module_tracebacks_and_initializer_errors(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    tb = next(line for line in out.stdout.splitlines() if line.startswith("TRACEBACK"))
    assert "user_script.py" in tb and "line 15" in tb and "return 1 / x" in tb  # file, line, source
    init = next(line for line in out.stdout.splitlines() if line.startswith("INIT"))
    assert "InitFailed" in init and "no device for this worker" in init  # the worker's own error
