"""Functions from the user's ``__main__`` behave as in ``multiprocessing.Pool``: one module
namespace per worker, shared by the initializer and every task, for the worker's life
(Note [user code] in ``jaxtransport/_usercode.py``).

Each case runs a real script in a fresh interpreter (``python script.py`` and ``python -c``), the
shape users write, once per start method, and compares with the stock pool where the stock pool
can run the same code.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import ROOT

START_METHODS = ["spawn", "forkserver"]

# The user's module: state set by an initializer, a counter, a cache, a jitted function whose
# traces are counted (a trace is a compilation: a jit cache miss), a class, an alias of a jitted
# function. Used as a script (by reference) and through `python -c` (by value).
MODULE = textwrap.dedent(
    """
    import os, sys, json, multiprocessing
    import numpy as np
    import jax, jax.numpy as jnp
    import jaxtransport as jt

    MODEL = None
    COUNT = 0
    CACHE = {}
    TRACES = 0
    BUILT = 0

    def init(v):
        global MODEL
        MODEL = v

    def read_model(_):
        return MODEL

    def counter(_):
        global COUNT
        COUNT += 1
        return COUNT

    def cached(n):
        global BUILT
        if n not in CACHE:
            BUILT += 1
            CACHE[n] = np.arange(n)
        return BUILT

    @jax.jit
    def step(x):
        global TRACES
        TRACES += 1
        return x * 2 + 1

    def _scale(x):
        global TRACES
        TRACES += 1
        return x * 3

    scale = jax.jit(_scale)

    def jit_task(i):
        a = step(jnp.arange(4.0) + i)
        b = scale(jnp.arange(4.0) - i)
        return float((a + b).sum()), TRACES

    class Point:
        def __init__(self, x):
            self.x = x

    def move(p):
        return Point(p.x + 1)

    def pid_and_model(_):
        return os.getpid(), MODEL

    def cases(make_pool, stock):
        out = {}
        with make_pool(1, init, ("weights",)) as p:
            out["initializer"] = p.map(read_model, range(3))
            out["counter"] = p.map(counter, range(4), chunksize=1)
            out["cache"] = p.map(cached, [5, 5, 5], chunksize=1)
            out["jit"] = [p.apply(jit_task, (i,)) for i in range(4)]
            r = p.apply(move, (Point(1),))
            out["class"] = [type(r) is Point, r.x]
            out["class_arg"] = p.apply(isinstance, (Point(0), Point)) if not stock else True
        with make_pool(1, init, ("again",), maxtasksperchild=1) as p:
            got = p.map(pid_and_model, range(3), chunksize=1)
            out["maxtasks_models"] = [m for _, m in got]
            out["maxtasks_workers"] = len({pid for pid, _ in got})
        return out
    """
)

SCRIPT_MAIN = textwrap.dedent(
    """
    if __name__ == "__main__":
        method = sys.argv[1]
        stock = lambda *a, **k: multiprocessing.get_context(method).Pool(*a, **k)
        ours = lambda *a, **k: jt.Pool(*a, start_method=method, **k)
        result = {"stock": cases(stock, True), "jaxtransport": cases(ours, False)}
        # Code only jaxtransport can run (the stock pool cannot pickle these): defined under the
        # main guard, so it travels by value into the worker's module namespace.
        with jt.Pool(1, init, ("guarded",), start_method=method) as p:
            result["guard_lambda"] = p.map(lambda v: (v, MODEL), range(2))
            seen = []
            for lr in (0.1, 0.2, 0.3):  # a global the parent rebinds is sent again
                seen.append(p.apply(lambda: lr))
            result["rebound_global"] = seen
            result["guard_counter"] = [p.apply(lambda: counter(0)) for _ in range(3)]
        print("RESULT " + json.dumps(result))
    """
)

EXPECTED = {
    "initializer": ["weights"] * 3,
    "counter": [1, 2, 3, 4],
    "cache": [1, 1, 1],
    "class": [True, 2],
    "class_arg": True,
    "maxtasks_models": ["again"] * 3,
    "maxtasks_workers": 3,
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def _check_jit(jit: list) -> None:
    # Two jitted functions, traced once each per worker: 2 traces however many tasks ran.
    assert [v for v, _ in jit] == [34.0 - 4 * i for i in range(4)], jit
    assert [t for _, t in jit] == [2, 2, 2, 2], jit


@pytest.mark.slow
@pytest.mark.parametrize("method", START_METHODS)
def test_script_main_state_matches_stock_pool(tmp_path, method):
    script = tmp_path / "user_script.py"
    script.write_text(MODULE + SCRIPT_MAIN)
    proc = subprocess.run([sys.executable, str(script), method], env=_env(), capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    result = _result(proc)
    stock, ours = result["stock"], result["jaxtransport"]
    for key, want in EXPECTED.items():
        assert stock[key] == want, (key, stock[key])
        assert ours[key] == want, (key, ours[key])
    assert ours["jit"] == stock["jit"]  # same values, and compiled once per worker as stock
    _check_jit(ours["jit"])
    assert result["guard_lambda"] == [[0, "guarded"], [1, "guarded"]]
    assert result["rebound_global"] == [0.1, 0.2, 0.3]
    assert result["guard_counter"] == [1, 2, 3]


C_MAIN = textwrap.dedent(
    """
    method = os.environ["START_METHOD"]
    result = cases(lambda *a, **k: jt.Pool(*a, start_method=method, **k), False)
    src = "def from_exec(_):\\n    global COUNT\\n    COUNT += 10\\n    return COUNT, MODEL\\n"
    exec(src)
    with jt.Pool(1, init, ("exec",), start_method=method) as p:
        result["exec"] = p.map(from_exec, range(3), chunksize=1)
    print("RESULT " + json.dumps(result))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("method", START_METHODS)
def test_code_the_worker_cannot_import_shares_one_namespace(method):
    """``python -c`` (and ``exec``): functions travel by value, into one namespace per worker."""
    env = _env()
    env["START_METHOD"] = method
    proc = subprocess.run([sys.executable, "-c", MODULE + C_MAIN], env=env, capture_output=True,
                          text=True, timeout=240)
    result = _result(proc)
    for key, want in EXPECTED.items():
        assert result[key] == want, (key, result[key])
    _check_jit(result["jit"])
    assert result["exec"] == [[10, "exec"], [20, "exec"], [30, "exec"]]


MISSING = textwrap.dedent(
    """
    import os, sys
    import jaxtransport as jt

    if os.environ.get("IN_PARENT") == "1":  # bound at top level, but not in the worker's run
        def only_in_parent(x):
            return x

    if __name__ == "__main__":
        with jt.Pool(1, start_method=sys.argv[1]) as p:
            try:
                p.apply(only_in_parent, (1,))
            except Exception as e:
                print("ERROR", type(e).__name__, e)
            print("STILL", p.apply(abs, (-3,)))
    """
)


@pytest.mark.slow
def test_reference_missing_in_the_worker_is_a_clear_error(tmp_path):
    script = tmp_path / "conditional.py"
    script.write_text(MISSING)
    env = _env()
    env["IN_PARENT"] = "1"
    # The worker runs the script too and inherits IN_PARENT: unset it there through worker_env.
    script.write_text(MISSING.replace("jt.Pool(1, start_method=sys.argv[1])",
                                      "jt.Pool(1, start_method=sys.argv[1], worker_env={'IN_PARENT': None})"))
    proc = subprocess.run([sys.executable, str(script), "spawn"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR AttributeError" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "__main__.only_in_parent is not defined" in proc.stdout
    assert "move it into an importable module" in proc.stdout
    assert "STILL 3" in proc.stdout  # the pool keeps working


def test_top_level_names_exclude_the_main_guard():
    from jaxtransport import _usercode

    tree = ast.parse(textwrap.dedent(
        """
        import numpy as np, os.path
        from json import dumps as d
        A = B = 1
        C: int = 2
        (E, [F, *G]) = 1, [2, 3]
        def f(): pass
        class K: pass
        if True:
            H = 1
        else:
            I = 2
        for J in range(2):
            L = J
        try:
            M = 1
        except Exception as N:
            O = 1
        with open(__file__) as P:
            pass
        if __name__ == "__main__":
            Q = 1
            def g(): pass
        elif True:
            R = 1
        if "__main__" == __name__:
            S = 1
        """
    ))
    names: set[str] = set()
    _usercode._bound_names(tree.body, names)
    assert names == set("ABCEFGHIJLMNOPR") | {"np", "os", "d", "f", "K"}


RESULT_CODE = textwrap.dedent(
    """
    import sys, threading
    import jaxtransport as jt

    def make_adder(n):
        threading.Event().wait(0.3)  # both workers take one task each
        return lambda x: x + n

    def make_local(n):
        def scaled(x):
            return x * n
        return scaled

    if __name__ == "__main__":
        with jt.Pool(2, start_method=sys.argv[1]) as p:
            adders = p.map(make_adder, [1, 2, 3, 4], chunksize=1)
            print("ADDERS", [f(10) for f in adders])
            local = p.apply(make_local, (3,))
            print("LOCAL", local(2), local.__name__)
            again = p.apply(make_local, (5,))
            print("AGAIN", again(2), local(2))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("method", START_METHODS)
def test_functions_returned_from_main_by_value_stay_distinct(tmp_path, method):
    """Lambdas and local functions come back by value (Note [results travel as arguments do]);
    closures with the same code returned by different workers are different functions (each
    worker's identity tokens are its own)."""
    script = tmp_path / "returns_code.py"
    script.write_text(RESULT_CODE)
    proc = subprocess.run([sys.executable, str(script), method], env=_env(), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ADDERS [11, 12, 13, 14]" in proc.stdout, proc.stdout
    assert "LOCAL 6 scaled" in proc.stdout, proc.stdout
    assert "AGAIN 10 6" in proc.stdout, proc.stdout


NAMED = textwrap.dedent(
    """
    import functools, json, sys
    import jaxtransport as jt
    from jaxtransport import _wire

    def task(x):
        return x + 1

    def _inner(x):
        return x * 2

    @functools.wraps(_inner)
    def alias(x):  # carries _inner's name, as `step = jax.jit(_step)` does
        return _inner(x)

    def other(x):
        return x - 1

    def carried(fn):
        prep = _wire.prepare((_wire.task_function(fn), "apply", [((1,), {})]), threshold=None)
        return {"fast": b"cloudpickle" not in prep.data, "by_name": b"main_attr" in prep.data}

    if __name__ == "__main__":
        out = {"task": carried(task), "alias": carried(alias), "lambda": carried(lambda x: x)}
        old = task
        task = other  # rebound: the old function no longer goes by that name
        out["rebound"] = carried(old)
        out["rebound_name"] = carried(task)
        with jt.Pool(1, start_method=sys.argv[1]) as p:
            out["results"] = [p.apply(old, (1,)), p.apply(task, (1,)), p.apply(alias, (3,)),
                              p.apply_async(other, (5,)).get(), p.map(alias, [1, 2], chunksize=1)]
        print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.parametrize("method", START_METHODS)
def test_a_main_script_function_travels_by_name_on_the_fast_path(tmp_path, method):
    # A function the script binds at top level travels as its name (the C pickler's path, no
    # cloudpickle per task), as an importable function does; a rebound name or a lambda keeps
    # the by-value path; the answers are the stock pool's.
    script = tmp_path / "named.py"
    script.write_text(NAMED)
    proc = subprocess.run([sys.executable, str(script), method], env=_env(), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    out = _result(proc)
    assert out["task"] == {"fast": True, "by_name": True}, out
    assert out["alias"] == {"fast": True, "by_name": True}, out
    assert out["rebound_name"] == {"fast": True, "by_name": True}, out
    assert out["lambda"]["by_name"] is False and out["rebound"]["by_name"] is False, out
    assert out["results"] == [2, 0, 6, 4, [2, 4]], out
