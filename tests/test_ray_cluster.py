"""jaxtransport.ray across object stores: a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``), tasks pinned to the second node by a custom resource, 8 CPU
devices in the driver and in every worker (XLA_FLAGS through the runtime_env), 64-bit types,
``placement="preserve"`` and a chained user setup hook.

The cluster runs in a fresh interpreter (a driver holds one Ray connection, and XLA_FLAGS must
be set before JAX starts); the script prints one JSON report that the tests below read. The
tests then check that every Ray process of that cluster is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

pytest.importorskip("ray")

from .conftest import run_python, wait_until  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = r'''
import json, os, sys, traceback, warnings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_ENABLE_X64"] = "1"
import numpy as np
import ray
from ray.cluster_utils import Cluster

report = {"checks": {}, "pids": []}

def check(name, fn):
    try:
        report["checks"][name] = {"ok": True, "value": fn()}
    except Exception:
        report["checks"][name] = {"ok": False, "error": traceback.format_exc()}

# Start the cluster before JAX initialises in this process (Ray's daemons are spawned).
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 1, "object_store_memory": 300 << 20, "include_dashboard": False})
cluster.add_node(num_cpus=1, resources={"far": 1}, object_store_memory=300 << 20)
try:
    for node in cluster.list_all_nodes():
        for procs in node.all_processes.values():
            report["pids"] += [p.process.pid for p in procs]
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxtransport.ray as jr

    def user_hook():
        os.environ["USER_HOOK_RAN"] = "yes"

    jr.init(address=cluster.address, placement="preserve", runtime_env={
        "worker_process_setup_hook": user_hook,
        "env_vars": {"XLA_FLAGS": os.environ["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}})
    cluster.wait_for_nodes()
    here = ray.get_runtime_context().get_node_id()

    @ray.remote(resources={"far": 1})
    def far(x):
        import jaxtransport.ray as jr_w
        leaves = jax.tree_util.tree_leaves(x)
        info = {
            "node": ray.get_runtime_context().get_node_id(),
            "registered": jr_w.is_registered(),
            "placement": jr_w._placement,
            "user_hook": os.environ.get("USER_HOOK_RAN"),
            "devices": jax.device_count(),
            "shardings": [repr(getattr(v, "sharding", None)) for v in leaves],
            "dtypes": [str(v.dtype) for v in leaves],
        }
        return info, x

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    sharded = jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32).reshape(256, 256),
                             NamedSharding(mesh, P("a", "b")))
    replicated_rows = jax.device_put(jnp.arange(8 * 6, dtype=jnp.int32).reshape(8, 6),
                                     NamedSharding(mesh, P("b", None)))

    def sharded_roundtrip():
        info, back = ray.get(far.remote({"s": sharded, "r": replicated_rows}))
        assert info["node"] != here, "task did not run on the second node"
        assert info["registered"] and info["user_hook"] == "yes" and info["placement"] == "preserve"
        assert info["devices"] == 8
        for name, orig in (("s", sharded), ("r", replicated_rows)):
            got = back[name]
            assert got.sharding == orig.sharding, (got.sharding, orig.sharding)
            assert np.array_equal(np.asarray(got), np.asarray(orig))
        return info["shardings"]

    check("sharded_preserve_across_nodes", sharded_roundtrip)

    def x64():
        xs = {
            "f64": jnp.asarray(np.random.default_rng(0).standard_normal(1000)),
            "i64": jnp.asarray(np.arange(-5, 5, dtype=np.int64) * (1 << 40)),
            "u64": jnp.asarray(np.array([0, 1, (1 << 64) - 1], dtype=np.uint64)),
            "c128": jnp.asarray(np.array([1 + 2j, -0.0 - 1e-300j], dtype=np.complex128)),
        }
        info, back = ray.get(far.remote(xs))
        assert info["node"] != here
        for k, v in xs.items():
            assert back[k].dtype == v.dtype, (k, back[k].dtype)
            assert np.asarray(back[k]).tobytes() == np.asarray(v).tobytes(), k
        return info["dtypes"]

    check("x64_dtypes_across_nodes", x64)

    def big_crosses_stores():
        x = jnp.asarray(np.random.default_rng(1).integers(0, 255, 48 << 20, dtype=np.uint8))
        ref = ray.put(x)  # in this node's store

        @ray.remote(resources={"far": 1})
        def fetch(refs):
            y = ray.get(refs[0])  # pulled into the far node's store, decoded there
            return (ray.get_runtime_context().get_node_id(), type(y).__name__,
                    int(np.asarray(y, dtype=np.uint64).sum()))

        node, kind, total = ray.get(fetch.remote([ref]))
        assert node != here and kind == "ArrayImpl"
        assert total == int(np.asarray(x, dtype=np.uint64).sum())

        @ray.remote(resources={"far": 1})
        def make(n):
            return jnp.full((n,), 7, jnp.uint8)

        y = ray.get(make.remote(32 << 20))  # made on the far node, fetched into ours
        assert isinstance(y, jax.Array) and int(y[123]) == 7 and y.nbytes == 32 << 20
        assert np.asarray(y).min() == 7
        return True

    check("large_objects_cross_object_stores", big_crosses_stores)

    def tracer_on_cluster():
        errs = []
        @jax.jit
        def f(x):
            try:
                far.remote({"x": x})
            except Exception as e:
                errs.append(type(e).__name__ + ": " + str(e).splitlines()[0])
            return x
        f(jnp.ones(2))
        assert errs and errs[0].startswith("TracerTransportError"), errs
        return errs[0]

    check("tracer_error", tracer_on_cluster)
finally:
    try:
        ray.shutdown()
    finally:
        cluster.shutdown()
print("REPORT" + json.dumps(report))
'''


@pytest.fixture(scope="module")
def cluster_report():
    # Cluster() records its address in $RAY_TMPDIR/ray/ray_current_cluster, where any plain
    # ray.init() on this machine would find and join it: keep it (and the session logs) in a
    # private, short (unix socket paths) directory that is removed afterwards.
    tmp = tempfile.mkdtemp(prefix="jtray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        r = run_python(SCRIPT, env={"RAY_TMPDIR": tmp}, timeout=240)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT")]
    assert r.returncode == 0 and lines, f"cluster script failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][len("REPORT"):])


def _check(report, name):
    c = report["checks"][name]
    assert c["ok"], c["error"]
    return c["value"]


def test_sharded_array_keeps_its_sharding_across_nodes(cluster_report):
    shardings = _check(cluster_report, "sharded_preserve_across_nodes")
    assert sorted(s.split("spec=")[1].split(")")[0] + ")" for s in shardings) == [
        "P('a', 'b')",
        "P('b', None)",
    ], shardings
    assert all("Mesh('a': 2, 'b': 4" in s for s in shardings), shardings


def test_64_bit_dtypes_across_nodes(cluster_report):
    assert sorted(_check(cluster_report, "x64_dtypes_across_nodes")) == sorted(
        ["float64", "int64", "uint64", "complex128"]
    )


def test_large_objects_cross_object_stores(cluster_report):
    assert _check(cluster_report, "large_objects_cross_object_stores") is True


def test_tracer_error_on_a_cluster(cluster_report):
    assert "value['x']" in _check(cluster_report, "tracer_error")


def test_cluster_processes_are_gone(cluster_report):
    pids = cluster_report["pids"]
    assert pids, "the script did not report the cluster's processes"

    def gone():
        return not [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]

    assert wait_until(gone, 20), [p for p in pids if os.path.exists(f"/proc/{p}")]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
