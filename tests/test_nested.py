"""jaxtransport's processes started from inside another library's worker process (issue #43).

A function that ``joblib.Parallel`` runs (loky, joblib's default backend; scikit-learn's
``n_jobs``), a ``concurrent.futures.ProcessPoolExecutor`` worker or a Ray task creates a
``jt.Pool``, a ``jt.Executor``, a ``joblib.Parallel`` on the jaxtransport backend, or
``jaxtransport.multiprocessing`` processes. In a loky worker ``multiprocessing``'s default start
method is ``"loky"``; spawn's preparation data used to carry it to jaxtransport's children, which
died at start-up (``ValueError: cannot find context for 'loky'``). Each child is now told the
start method jaxtransport chose (Note [the child's start method] in ``jaxtransport/_os``).

Every case runs in a fresh interpreter (``run_python``): real loky, real processes per start
method, and the interpreter's exit is checked too (the resource tracker reports no leaked
semaphore). Inside a daemonic worker the refusals stay; a pool that fails to start leaves
nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from .conftest import ROOT, run_python, shm_entries, shm_leaks

joblib = pytest.importorskip("joblib")

START_METHODS = ["spawn", "forkserver"]
ENV = {"JAX_PLATFORMS": "cpu"}


def _run(code: str, **env: str):
    proc = run_python(textwrap.dedent(code), env={**ENV, **env}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "leaked" not in proc.stderr, out[-6000:]  # the resource tracker, at the interpreter's exit
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN ")]
    return json.loads(line[5:]), out


def _check_every_face(seen: dict, method: str, out: str) -> None:
    for face in ("pool", "executor", "joblib", "multiprocessing"):
        assert seen[face] is True, f"{face}: {seen}\n{out[-6000:]}"
    # The Pool's own workers were told the start method they were started with.
    assert seen["pool_child_method"] == method, seen


LOKY = """
import json
import joblib
from joblib.externals.loky import get_reusable_executor
from tests import nested_tasks

if __name__ == "__main__":
    (seen,) = joblib.Parallel(n_jobs=2)(joblib.delayed(nested_tasks.every_face)({method!r}) for _ in range(1))
    get_reusable_executor().shutdown(wait=True)
    print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("start_method", START_METHODS)
def test_every_face_starts_inside_a_loky_worker(start_method):
    # joblib's test_nested_loop[loky-<backend>] case, and scikit-learn's n_jobs calling into
    # code that uses jaxtransport: the host worker's default start method is loky's own.
    seen, out = _run(LOKY.format(method=start_method))
    assert seen["host_method"] == "loky", seen  # it did run inside a loky worker
    _check_every_face(seen, start_method, out)


PROCESS_POOL = """
import concurrent.futures as cf
import json
import multiprocessing
from tests import nested_tasks

if __name__ == "__main__":
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as host:
        seen = host.submit(nested_tasks.every_face, {method!r}).result(timeout=200)
    print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("start_method", START_METHODS)
def test_every_face_starts_inside_a_process_pool_executor_worker(start_method):
    seen, out = _run(PROCESS_POOL.format(method=start_method))
    _check_every_face(seen, start_method, out)


RAY = """
import json
import ray
from tests import nested_tasks

if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={{"env_vars": {{"JAX_PLATFORMS": "cpu", "PYTHONPATH": {root!r}}}}})
    try:
        task = ray.remote(num_cpus=1)(nested_tasks.every_face)
        seen = dict(zip({methods!r}, ray.get([task.remote(m) for m in {methods!r}], timeout=400)))
    finally:
        ray.shutdown()
    print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.slow
@pytest.mark.ray
def test_every_face_starts_inside_a_ray_task():
    pytest.importorskip("ray")
    seen, out = _run(RAY.format(root=ROOT, methods=START_METHODS))
    for method in START_METHODS:
        _check_every_face(seen[method], method, out)


REFUSALS = """
import json
import multiprocessing
import jaxtransport as jt
from tests import nested_tasks

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as stock:
        seen = {{"multiprocessing.Pool": stock.apply(nested_tasks.refusals, ({method!r},))}}
    with jt.Pool(1, start_method={method!r}) as ours:
        seen["jaxtransport.Pool"] = ours.apply(nested_tasks.refusals, ({method!r},))
    print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("start_method", START_METHODS)
def test_inside_a_daemonic_worker_the_refusals_stay(start_method):
    seen, out = _run(REFUSALS.format(method=start_method))
    for host, got in seen.items():
        assert got["daemon"] is True, (host, got)
        for face in ("pool", "executor"):
            assert "cannot be created inside a daemonic process" in got[face], (host, face, got)
        ran_here, warned = got["joblib"]
        assert ran_here and any("daemonic process" in w for w in warned), (host, got)
        assert "daemonic processes are not allowed to have children" in got["multiprocessing"], (host, got)


# Two ways a pool fails to start: a main script that stops every child at start-up (each re-runs
# it as __mp_main__; only while the file STOP exists), and an initializer argument that pickles
# once (the second worker fails to start in the parent, after the first one started).
# Afterwards nothing may be left: no child process, no /dev/shm entry (checked by the test), no
# semaphore for the resource tracker to report at exit, even when the process then ends without
# running any finalizer (os._exit, as a loky worker that joblib kills after an error).
FAILS_TO_START = """
import os, sys
STOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "STOP")
if __name__ == "__mp_main__" and os.path.exists(STOP):
    raise SystemExit("this script stops every child at start-up, on purpose")
import multiprocessing
import jaxtransport as jt
import jaxtransport.multiprocessing as jmp
from tests.nested_tasks import PicklesOnce, noop

def children():
    from multiprocessing import forkserver, resource_tracker
    keep = {getattr(resource_tracker._resource_tracker, "_pid", None), forkserver._forkserver._forkserver_pid}
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(entry) not in keep:
                out.add(int(entry))
    return out

if __name__ == "__main__":
    method = sys.argv[1]
    for face, make in (("pool", jt.Pool), ("executor", jt.Executor)):
        open(STOP, "w").close()
        try:
            with make(2, start_method=method) as p:
                p.submit(abs, -1).result() if face == "executor" else p.apply(abs, (-1,))
        except Exception as e:
            print("FAILED", face, type(e).__name__, flush=True)
        os.remove(STOP)
        PicklesOnce.pickled = 0
        try:
            make(2, initializer=noop, initargs=(PicklesOnce(),), start_method=method)
        except Exception as e:
            print("FAILED", face, "second start", type(e).__name__, flush=True)
    open(STOP, "w").close()
    proc = jmp.get_context(method).Process(target=print)
    proc.start()
    proc.join(60)
    print("FAILED multiprocessing exit code", proc.exitcode, flush=True)
    print("CHILDREN", sorted(children()), flush=True)
    if sys.argv[2] == "killed":  # as joblib's abort kills a loky worker: no finalizer runs
        os._exit(0)
"""


@pytest.mark.parametrize("end", ["exit", "killed"])
@pytest.mark.parametrize("platform", ["auto", "portable"])  # portable: named semaphores, as on macOS
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_pool_that_fails_to_start_leaves_nothing_behind(tmp_path, start_method, platform, end):
    import subprocess

    script = tmp_path / "fails_to_start.py"
    script.write_text(textwrap.dedent(FAILS_TO_START))
    before = shm_entries()
    env = dict(os.environ, **ENV, JAXTRANSPORT_PLATFORM=platform)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script), start_method, end], env=env, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    assert failed == [
        "FAILED pool WorkerLostError",
        "FAILED pool second start TypeError",
        "FAILED executor WorkerLostError",
        "FAILED executor second start TypeError",
        "FAILED multiprocessing exit code 1",
    ], out[-6000:]
    assert "CHILDREN []" in proc.stdout, out[-6000:]
    assert "leaked" not in proc.stderr, out[-6000:]  # the resource tracker, at the interpreter's exit
    assert not shm_leaks(before, shm_entries()), out[-6000:]
