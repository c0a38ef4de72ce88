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


# A script that starts its pool where every spawned worker would start one too (no main guard),
# reached three ways: at the top level (found before any worker starts), from a function
# called inside a `try` (found in the worker: its own error comes back), and a top level that
# fails only in the workers for another reason (the tail of its stderr comes back).
UNGUARDED = {
    "top-level": textwrap.dedent('''
        import sys
        import jaxtransport as jt

        def sq(x):
            return x * x

        with jt.Pool(2, start_method=sys.argv[1]) as p:
            print("RESULT", p.map(sq, range(4)))
    '''),
    "via-function-in-try": textwrap.dedent('''
        import sys
        import jaxtransport as jt

        def sq(x):
            return x * x

        def main():
            with jt.Pool(2, start_method=sys.argv[1]) as p:
                print("RESULT", p.map(sq, range(4)))

        try:
            main()
        except KeyboardInterrupt:
            pass
    '''),
    "worker-only-failure": textwrap.dedent('''
        import multiprocessing, sys
        import jaxtransport as jt

        if multiprocessing.parent_process() is not None or multiprocessing.current_process().name != "MainProcess":
            raise ImportError("settings.toml is only readable by the parent (worker-only failure)")

        def sq(x):
            return x * x

        if __name__ == "__main__":
            with jt.Pool(2, start_method=sys.argv[1]) as p:
                print("RESULT", p.map(sq, range(4)))
    '''),
}


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("case", sorted(UNGUARDED))
def test_a_worker_that_dies_while_starting_says_why(tmp_path, case, method):
    script = tmp_path / "no_guard.py"
    script.write_text(UNGUARDED[case])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script), method], env=env, capture_output=True, text=True,
                         timeout=170, cwd=tmp_path)
    assert out.returncode != 0 and "RESULT" not in out.stdout
    def raised(head: str) -> str:  # the parent's error (the workers' own tracebacks precede it)
        i = out.stderr.find("\n" + head)
        assert i >= 0, out.stderr[-3000:]
        return out.stderr[i:]

    if case == "top-level":  # refused in the parent, before any process starts
        last = raised("jaxtransport._errors.MainGuardError: a jaxtransport.Pool was started at the top level of")
        assert "no_guard.py, line 8" in last and 'if __name__ == "__main__":' in last
    else:
        last = raised("jaxtransport._errors.WorkerLostError: 3 jaxtransport.Pool workers in a row died")
        if case == "via-function-in-try":  # the worker's own MainGuardError, shown by the parent
            assert "guard the code that starts them" in last and "MainGuardError" in last
            assert 'no_guard.py", line 13' in last  # the worker's traceback points at `main()`
        else:
            assert "ImportError: settings.toml is only readable by the parent" in last
            assert "__name__" not in last  # not a main guard problem: no such advice


def test_main_guard_check_reads_the_script_statement_by_statement():
    import ast as _ast

    from jaxtransport._mainguard import runs_unconditionally

    src = textwrap.dedent('''
        import x                       # 2
        p = start()                    # 3
        with start() as p:             # 4
            p.map()                    # 5
        if __name__ == "__main__":     # 6
            start()                    # 7
        else:                          # 8
            start()                    # 9
        if flag:                       # 10
            start()                    # 11
        try:                           # 12
            start()                    # 13
        except E:                      # 14
            pass                       # 15
        for i in range(3):             # 16
            if i:                      # 17
                start()                # 18
            start()                    # 19
    ''')
    body = _ast.parse(src).body
    got = {line: runs_unconditionally(body, line) for line in (3, 4, 5, 7, 9, 11, 13, 18, 19)}
    assert got == {3: True, 4: True, 5: True, 7: False, 9: True, 11: False, 13: False, 18: False, 19: True}
