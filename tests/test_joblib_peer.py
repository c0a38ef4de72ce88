"""Peer suites: joblib's own Parallel tests on the jaxtransport backend, joblib's own Memory tests
on ``jaxtransport.joblib.Memory``, and Ray's joblib backend with ``jaxtransport.ray`` registered.

``joblib/test/test_parallel.py`` ships inside the installed joblib; it is run from there (never
copied) in a pytest subprocess with ``tests/joblib_peer_plugin.py``, which registers the
jaxtransport backend under joblib's two process-backend names, ``"loky"`` (joblib's default) and
``"multiprocessing"``, before the module is imported. Every test must pass except the deliberate
differences below, each with its reason (also listed in docs/guides/joblib.md).

``joblib/test/test_memory.py`` runs the same way with ``tests/joblib_memory_peer_plugin.py``,
which puts ``jaxtransport.joblib.Memory`` in place of ``joblib.Memory`` (and imports JAX, so that
its JAX paths run). Every test passes: the Memory has no deliberate difference that joblib's
tests see (MEMORY_DELIBERATE; the ones they do not see are in docs/guides/joblib.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from .conftest import ROOT

pytest.importorskip("joblib")

# test id (as pytest names it inside joblib.test.test_parallel) -> why it differs on purpose.
_TYPE = "asserts the backend's class is joblib's LokyBackend/MultiprocessingBackend"
_MEMMAP = "asserts that numpy arguments arrive as np.memmap (loky's memory-mapping); ours arrive through shared memory as ndarrays"
DELIBERATE = {
    **{f"test_backend_context_manager[{c}-{b}]": _TYPE
       for c in ("parallel_backend", "parallel_config") for b in ("loky", "multiprocessing")},
    **{f"test_backend_hinting_and_constraints[{c}]": _TYPE for c in ("parallel_backend", "parallel_config")},
    **{f"test_nested_parallelism_limit[{c}-loky]": _TYPE + " at nesting level 0"
       for c in ("parallel_backend", "parallel_config")},
    **{f"test_auto_memmap_on_arrays_from_generator[{b}]": _MEMMAP for b in ("loky", "multiprocessing")},
    **{f"test_memmapping_leaks[{b}]": _MEMMAP for b in ("loky", "multiprocessing")},
    **{f"test_error_capture[{b}]": (
        "expects the workers to be replaced after every error; the jaxtransport backend keeps its warm "
        "workers when none of the failed call's tasks is still pending or running (it terminates them "
        "otherwise, as loky does)") for b in ("loky", "multiprocessing")},
    "test_nested_parallel_warnings[loky-loky-False]": (
        "a nested Parallel(backend='loky') inside a task: the jaxtransport Pool's workers are daemonic "
        "(as multiprocessing.Pool's), so loky runs the nested loop with n_jobs=1 and warns; loky's own "
        "workers are not daemonic"),
}


# test id inside joblib.test.test_memory -> why it differs on purpose. None does: the Memory's
# differences (keys of jax.Array arguments, the TracerTransportError, stores other than joblib's
# local one refused by name) are in what joblib's tests do not exercise.
MEMORY_DELIBERATE: dict[str, str] = {}


def _failures(xml_path: str) -> tuple[set[str], int]:
    failed, total = set(), 0
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(case.get("name"))
    return failed, total


def _run_joblib_tests(
    tmp_path, plugin: str, module: str, timeout: int, shard: str | None = None
) -> tuple[subprocess.CompletedProcess, str]:
    """pytest on the installed ``joblib.test.<module>`` with ``plugin`` (from tests/), in a fresh
    interpreter, under none of this repository's pytest settings; returns the run and its JUnit
    XML's path. ``shard`` ("i/n"): only that shard of the module's tests (the plugin selects)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of this repository's settings
    xml = tmp_path / "out.xml"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAXTRANSPORT_PEER_SHARD", None)
    if shard is not None:
        env["JAXTRANSPORT_PEER_SHARD"] = shard
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", plugin, "--pyargs", f"joblib.test.{module}",
         "-q", "-p", "no:cacheprovider", "--timeout", "120", f"--junitxml={xml}", "-rf"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, str(xml)


# joblib's test_parallel.py (over 1,000 tests, about 140 s in one run here) goes as SHARDS
# runs of every SHARDS-th test, which the suite's test processes share out.
SHARDS = 4


@pytest.mark.slow
# Each shard is a fresh interpreter sharing nothing with the others: a test process of its own
# (Note [parallel test processes]), so that the shards run side by side.
@pytest.mark.parametrize(
    "shard", [pytest.param(i, marks=pytest.mark.xdist_group(f"joblib-peer-{i}")) for i in range(SHARDS)],
    ids=lambda i: f"shard{i}of{SHARDS}",
)
def test_joblib_test_parallel_on_the_jaxtransport_backend(tmp_path, shard):
    proc, xml = _run_joblib_tests(
        tmp_path, "joblib_peer_plugin", "test_parallel", timeout=1500, shard=f"{shard}/{SHARDS}"
    )
    failed, total = _failures(xml)
    assert total > 500 // SHARDS, f"only {total} tests collected:\n{proc.stdout[-3000:]}"
    unexpected = sorted(failed - set(DELIBERATE))
    assert not unexpected, f"joblib tests failing on the jaxtransport backend: {unexpected}\n{proc.stdout[-6000:]}"


def test_joblib_test_memory_on_jaxtransport_memory(tmp_path):
    proc, xml = _run_joblib_tests(tmp_path, "joblib_memory_peer_plugin", "test_memory", timeout=600)
    failed, total = _failures(xml)
    assert total > 60, f"only {total} tests collected:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    unexpected = sorted(failed - set(MEMORY_DELIBERATE))
    assert not unexpected, f"joblib's Memory tests failing on jaxtransport.joblib.Memory: {unexpected}\n{proc.stdout[-6000:]}"


RAY_CODE = """
import jax, jax.numpy as jnp, numpy as np, joblib
import jaxtransport.ray as jr
from ray.util.joblib import register_ray

def describe(x, key):
    return type(x).__name__, x * 2, key

jr.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
register_ray()
xs = [jnp.arange(1 << 18, dtype=jnp.float32) + i for i in range(4)]
with joblib.parallel_config(backend="ray", n_jobs=2):
    out = joblib.Parallel()(joblib.delayed(describe)(x, jax.random.key(i)) for i, x in enumerate(xs))
for i, (seen, y, key) in enumerate(out):
    assert seen == "ArrayImpl", seen  # a jax.Array in the worker
    assert isinstance(y, jax.Array) and (np.asarray(y) == np.asarray(xs[i]) * 2).all()
    assert (jax.random.key_data(key) == jax.random.key_data(jax.random.key(i))).all()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.ray
def test_ray_joblib_backend_carries_jax_arrays():
    pytest.importorskip("ray")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", RAY_CODE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
