"""``jaxtransport.joblib``: the ``"jaxtransport"`` joblib backend, through joblib's public API,
with real spawned workers (the Pool's), real shared memory."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

joblib = pytest.importorskip("joblib")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxtransport  # noqa: E402
import jaxtransport.joblib as jtj  # noqa: E402

from .conftest import ROOT, run_python  # noqa: E402

BIG = 1 << 18  # elements: 1 MiB of float32, over the Pool's shared-memory threshold


@pytest.fixture(autouse=True)
def backend():
    jtj.register()
    yield
    jtj.shutdown()  # the warm pool ends with each test (the suite checks that no child survives)


def _pid(_=None):
    return os.getpid()


def _twice(x):
    return jax.tree_util.tree_map(lambda a: a * 2, x)


def _describe(x):
    return type(x).__name__, np.asarray(x).dtype.str, float(np.asarray(x).sum())


def _sleep_then(i, seconds, folder=None):
    if folder is not None:
        open(os.path.join(folder, f"{i}"), "w").close()
    if i == 2:
        raise ValueError(f"task {i} failed on purpose")
    time.sleep(seconds)
    return i


def _nested(i):
    inner = joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(-j) for j in range(3))
    return i, inner, type(joblib.parallel.get_active_backend()[0]).__name__


def test_arrays_both_ways_and_warm_workers():
    xs = [jnp.arange(BIG, dtype=jnp.float32) + i for i in range(4)]
    nps = [np.arange(BIG, dtype=np.int64) * i for i in range(4)]
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
        out = joblib.Parallel()(joblib.delayed(_twice)({"x": x, "n": n}) for x, n in zip(xs, nps))
        seen = joblib.Parallel()(joblib.delayed(_describe)(x) for x in xs[:2])
        pids1 = set(joblib.Parallel()(joblib.delayed(_pid)(i) for i in range(8)))
        pids2 = set(joblib.Parallel()(joblib.delayed(_pid)(i) for i in range(8)))
        weak, key = jnp.asarray(3.0), jax.random.key(7)  # a weak type, a typed PRNG key: both ways
        ((w, k),) = joblib.Parallel()(joblib.delayed(lambda a, b: (a, b))(weak, key) for _ in range(1))
    assert w.weak_type and w.dtype == weak.dtype
    assert jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(key))
    for i, o in enumerate(out):
        assert isinstance(o["x"], jax.Array) and isinstance(o["n"], np.ndarray)
        np.testing.assert_array_equal(np.asarray(o["x"]), np.asarray(xs[i]) * 2)
        np.testing.assert_array_equal(o["n"], nps[i] * 2)
    assert seen[0][0] == "ArrayImpl" and seen[0][1] == "<f4"  # a jax.Array in the worker, too
    # The same warm workers: both calls ran on the one pool of 2 (a new pool would bring new
    # pids). Which of the 2 took the 8 tiny tasks is the scheduler's business: under load one
    # worker can take them all in one call and not in the other.
    assert len(pids1 | pids2) <= 2 and os.getpid() not in pids1 | pids2
    with joblib.parallel_config(backend="jaxtransport", n_jobs=-1):  # negative: cpu_count() + 1 + n
        n_all = joblib.Parallel()._effective_n_jobs()
    assert n_all == max(joblib.cpu_count(), 1)
    with joblib.parallel_config(backend="jaxtransport", n_jobs=3):  # another size: a new pool
        pids3 = set(joblib.Parallel()(joblib.delayed(_pid)(i) for i in range(9)))
    assert pids3.isdisjoint(pids1) and len(pids3) <= 3


def test_auto_batching_generators_pre_dispatch_verbose(capfd):
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
        out = joblib.Parallel(batch_size="auto", pre_dispatch="2*n_jobs", verbose=10)(
            joblib.delayed(abs)(-i) for i in range(2000)
        )
        assert out == list(range(2000))
        gen = joblib.Parallel(return_as="generator")(joblib.delayed(abs)(-i) for i in range(20))
        assert next(gen) == 0 and list(gen) == list(range(1, 20))
        unordered = joblib.Parallel(return_as="generator_unordered", batch_size=3)(
            joblib.delayed(abs)(-i) for i in range(20)
        )
        assert sorted(unordered) == list(range(20))
    err = capfd.readouterr().err
    assert "Using backend JaxTransportBackend with 2 concurrent workers." in err
    assert "Done 2000 out of 2000" in err


def test_backend_auto_batch_size_grows_for_tiny_tasks():
    backend = jtj.JaxTransportBackend()
    backend.parallel = type("P", (), {"verbose": 0})()
    assert backend.compute_batch_size() == 1
    backend.batch_completed(1, 0.001)
    assert backend.compute_batch_size() > 1


def test_first_error_aborts_pending_with_remote_traceback(tmp_path):
    # A managed Parallel (joblib aborts with ensure_ready=True): the pool with running tasks is
    # terminated and a new one serves the next call of the same Parallel. (pre_dispatch="all":
    # with fewer, joblib itself hands the next call a batch left over from the aborted one, with
    # loky too; see the guide.)
    with joblib.Parallel(n_jobs=2, backend="jaxtransport", batch_size=1, pre_dispatch="all") as parallel:
        with pytest.raises(ValueError, match="task 2 failed on purpose") as info:
            parallel(joblib.delayed(_sleep_then)(i, 0.3, str(tmp_path)) for i in range(40))
        assert parallel(joblib.delayed(abs)(-i) for i in range(4)) == [0, 1, 2, 3]
    cause = info.value.__cause__
    assert cause is not None and "_sleep_then" in str(cause)  # the worker's traceback
    assert len(os.listdir(tmp_path)) < 40  # the rest never ran


def _nap_then(i, seconds):
    time.sleep(seconds)
    return i


def _input_that_fails(n):
    yield from range(n)
    raise KeyError("the input generator failed on purpose")


def test_ordered_results_wait_on_the_batch_not_on_joblibs_poll(monkeypatch):
    # Note [no polling]: for a callback backend joblib's result loop sleeps 10 ms per look at a
    # pending batch; for ordered results this backend has joblib wait on the batch itself.
    sleeps = []

    class _Time:
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            sleeps.append(seconds)
            time.sleep(seconds)

    monkeypatch.setattr(joblib.parallel, "time", _Time())
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
        assert joblib.Parallel(batch_size=1)(joblib.delayed(_nap_then)(i, 0.05) for i in range(8)) == list(range(8))
        gen = joblib.Parallel(return_as="generator", pre_dispatch=2)(joblib.delayed(_nap_then)(i, 0.02) for i in range(8))
        assert list(gen) == list(range(8))
        assert sleeps == []
        unordered = joblib.Parallel(return_as="generator_unordered")(joblib.delayed(_nap_then)(i, 0.05) for i in range(4))
        assert sorted(unordered) == list(range(4))  # joblib's callback path (and its poll) for these


def test_a_later_batch_failing_ends_the_wait_for_an_earlier_one():
    # joblib waits for batch 0 (120 s); batch 2 fails at once: its error is raised then, and
    # the call is aborted (the pool with batch 0 running is terminated), as loky does.
    start = time.monotonic()
    with pytest.raises(ValueError, match="task 2 failed on purpose"):
        joblib.Parallel(n_jobs=2, backend="jaxtransport", batch_size=1)(
            joblib.delayed(_sleep_then)(i, 120.0 if i == 0 else 0.0) for i in range(6)
        )
    assert time.monotonic() - start < 60.0  # not after batch 0's 120 s
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2):  # the next call: a fresh pool
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(4)) == [0, 1, 2, 3]


def test_an_input_generator_that_raises_fails_the_call():
    # The input raises in the dispatch that a finished batch's callback runs (the Pool's
    # callback thread): joblib registers that error as a batch of its own.
    for return_as in ("list", "generator", "generator_unordered"):
        with pytest.raises(KeyError, match="failed on purpose"):
            out = joblib.Parallel(n_jobs=2, backend="jaxtransport", batch_size=1, pre_dispatch=2, return_as=return_as)(
                joblib.delayed(_nap_then)(i, 0.01) for i in _input_that_fails(6)
            )
            list(out)


def test_ctrl_c_while_waiting_on_a_batch_ends_the_call_and_the_next_one_works():
    # joblib's thread waits on the batch (Note [no polling]): a SIGINT there raises
    # KeyboardInterrupt at once and the call is aborted (its running tasks' pool terminated).
    # The child puts SIGINT back to Python's default (a test run started in the background has
    # it ignored, inherited across exec) and runs without the debug lock checker (not safe
    # against an exception raised inside its acquire; see test_pool_lifecycle's Ctrl-C test).
    code = textwrap.dedent(
        """
        import faulthandler, os, signal, threading, time, joblib
        import jaxtransport.joblib as jtj
        signal.signal(signal.SIGINT, signal.default_int_handler)
        faulthandler.dump_traceback_later(100, exit=True)
        jtj.register()
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            joblib.Parallel(n_jobs=2, backend="jaxtransport")(joblib.delayed(time.sleep)(100) for _ in range(4))
        except KeyboardInterrupt:
            print("interrupted", time.monotonic() - t0 < 60, flush=True)
        with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
            print(joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(3)), flush=True)
        """
    )
    out = run_python(code, env={"JAXTRANSPORT_CHECK_LOCKS": "0"}, timeout=200)
    assert out.returncode == 0, out.stderr
    assert "interrupted True" in out.stdout and "[0, 1, 2]" in out.stdout, out.stdout + out.stderr


def test_timeout_terminates_the_call():
    with pytest.raises(multiprocessing.TimeoutError):  # what joblib raises for every backend
        with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
            joblib.Parallel(timeout=1.0)(joblib.delayed(time.sleep)(s) for s in (0.0, 60.0, 60.0))


def test_nested_parallel_follows_joblib_rules():
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
        out = joblib.Parallel()(joblib.delayed(_nested)(i) for i in range(2))
    assert out == [(0, [0, 1, 2], "ThreadingBackend"), (1, [0, 1, 2], "ThreadingBackend")]


def test_tracer_fails_at_dispatch_with_key_path():
    @jax.jit
    def traced(x):
        joblib.Parallel(backend="jaxtransport", n_jobs=2)(joblib.delayed(_twice)({"p": [x]}) for _ in range(2))
        return x

    with pytest.raises(jaxtransport.TracerTransportError) as info:
        traced(jnp.ones(3))
    assert info.value.path == "args[0]['p'][0]"
    assert "joblib.Parallel" in str(info.value) and "_twice" in str(info.value)


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="unknown option"):
        jtj.JaxTransportBackend(shm_treshold=1)


def test_main_functions_work(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import joblib, jax.numpy as jnp, numpy as np
            import jaxtransport.joblib as jtj

            def square(x):
                return x * x

            if __name__ == "__main__":
                jtj.register()
                with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
                    out = joblib.Parallel()(joblib.delayed(square)(jnp.full(300000, i, jnp.float32)) for i in range(3))
                    lam = joblib.Parallel()(joblib.delayed(lambda v: v + 1)(i) for i in range(3))
                print("RESULT", [float(o[0]) for o in out], type(out[0]).__name__, lam)
                jtj.shutdown()
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [0.0, 1.0, 4.0] ArrayImpl [1, 2, 3]" in proc.stdout


def test_importing_jaxtransport_never_imports_joblib():
    proc = run_python("import sys, jaxtransport; jaxtransport.Pool; print('joblib' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


_INIT = {}


def _set_init(value):
    _INIT["value"] = value


def _get_init(_):
    return _INIT.get("value")


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("no pickling for this one")


def test_initializer_and_unpicklable_arguments():
    with joblib.parallel_config(backend="jaxtransport", n_jobs=2, initializer=_set_init, initargs=("ready",)):
        assert joblib.Parallel()(joblib.delayed(_get_init)(i) for i in range(4)) == ["ready"] * 4
        with pytest.raises(pickle.PicklingError, match="Could not pickle the task") as info:
            joblib.Parallel()(joblib.delayed(id)(_Unpicklable()) for _ in range(3))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_warm_workers_end_at_interpreter_exit_without_shutdown(tmp_path):
    script = tmp_path / "no_shutdown.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, joblib
            import jaxtransport.joblib as jtj

            if __name__ == "__main__":
                jtj.register()
                with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
                    pids = set(joblib.Parallel()(joblib.delayed(os.getpid)() for _ in range(6)))
                print("PIDS", " ".join(map(str, sorted(pids))))
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = [int(p) for p in proc.stdout.split("PIDS", 1)[1].split()]
    assert pids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), "workers outlived the interpreter"


def _failing_init():
    raise RuntimeError("initializer failed on purpose")


def test_a_broken_pool_is_not_reused():
    for _ in range(2):  # the second call starts a new pool, which fails the same way
        with pytest.raises(jaxtransport.PoolStateError, match="initializer raised RuntimeError"):
            with joblib.parallel_config(backend="jaxtransport", n_jobs=2, initializer=_failing_init):
                joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(4))


def _nap(x):
    time.sleep(0.05)
    return 1


def test_errors_of_batches_dispatched_late_fail_the_call_without_hanging():
    # pre_dispatch=2: the last batch is dispatched from the pool's callback thread, after an
    # earlier batch completed; its failure must reach the caller, not hang joblib.
    @jax.jit
    def traced(t):
        joblib.Parallel(n_jobs=2, backend="jaxtransport", pre_dispatch=2, batch_size=1)(
            joblib.delayed(_nap)(v) for v in [1, 2, 3, 4, {"late": t}]
        )
        return t

    with pytest.raises(jaxtransport.TracerTransportError) as info:
        traced(jnp.ones(2))
    assert info.value.path == "args[0]['late']"
    with pytest.raises(pickle.PicklingError, match="Could not pickle the task"):
        joblib.Parallel(n_jobs=2, backend="jaxtransport", pre_dispatch=2, batch_size=1)(
            joblib.delayed(_nap)(v) for v in [1, 2, 3, 4, _Unpicklable()]
        )
