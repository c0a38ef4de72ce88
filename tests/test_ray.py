"""jaxtransport.ray against a real local Ray: registration, the worker setup hook, zero copy
through the object store, every dtype, keys, pytrees, actors, tracers, errors.

One Ray instance (2 CPUs, 1 GiB object store) serves the whole session; the two-node cluster
and the 8-device sharding checks run in a fresh interpreter (tests/test_ray_cluster.py).
"""

from __future__ import annotations

import collections
import copyreg
import gc
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ray = pytest.importorskip("ray")

import jaxtransport  # noqa: E402
import jaxtransport.ray as jr  # noqa: E402
from jaxtransport import _codec  # noqa: E402

from .conftest import huge_pages_kib, malloc_huge_pages_work, run_python, wait_until  # noqa: E402
from .test_codec import DTYPES, assert_same, bits, make  # noqa: E402

MiB = 1 << 20


# ------------------------------------------------------------------------------------------
# the shared local Ray


@pytest.fixture(scope="session")
def ray_local():
    """``jaxtransport.ray.init(num_cpus=2, include_dashboard=False)``, shut down at the end."""
    if ray.is_initialized():
        ray.shutdown()
    with warnings.catch_warnings():
        # Ray starts its daemons with subprocess.Popen: fork immediately followed by exec in
        # C, which cannot deadlock on JAX's threads; JAX's at-fork hook warns regardless.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        jr.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=1 << 30,
            runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
        )
    yield ray
    ray.shutdown()
    jr.unregister()


@pytest.fixture
def registered(ray_local):
    """Each test starts (and leaves) the driver registered with placement "device"."""
    jr.register("device")
    yield ray_local
    jr.register("device")


@ray.remote
def echo(x):
    return x


@ray.remote
def describe(x):
    """What the worker received, as plain data."""
    import jaxtransport.ray as jr_worker

    leaves = jax.tree_util.tree_leaves(x)
    return {
        "registered": jr_worker.is_registered(),
        "types": [type(v).__name__ for v in leaves],
        "dtypes": [str(getattr(v, "dtype", type(v).__name__)) for v in leaves],
        "weak": [bool(getattr(v, "weak_type", False)) for v in leaves],
        "treedef": str(jax.tree_util.tree_structure(x)),
    }


@ray.remote
class Holder:
    def __init__(self, x):
        self.x = x

    def get(self):
        return self.x

    def swap(self, y):
        old, self.x = self.x, y
        return old

    def registered(self):
        import jaxtransport.ray as jr_worker

        return jr_worker.is_registered()


class DecodeSpy:
    """Records, for each array this process decodes, the address of the buffer it was given."""

    def __init__(self, monkeypatch):
        self.calls: list[list[int]] = []
        original = _codec.decode

        def spy(meta, buffers, placement="device"):
            self.calls.append([np.frombuffer(b, np.uint8).ctypes.data for b in buffers])
            return original(meta, buffers, placement)

        monkeypatch.setattr(_codec, "decode", spy)


# ------------------------------------------------------------------------------------------
# import-time behaviour (fresh interpreters)


def test_import_jaxtransport_does_not_import_ray():
    r = run_python(
        "import sys, jaxtransport\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "assert 'jaxtransport.ray' not in sys.modules\n"
        "print('ok')"
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_import_jaxtransport_ray_registers_and_starts_nothing():
    r = run_python(
        "import ray, ray.cloudpickle, jaxtransport.ray as jr\n"
        "from jaxtransport import _codec\n"
        "assert not ray.is_initialized()\n"
        "assert not jr.is_registered()\n"
        "d = ray.cloudpickle.CloudPickler.dispatch\n"
        "assert not any(t in d.maps[0] for t in _codec.concrete_array_types())\n"
        "import threading\n"
        "assert not any(t.name.startswith('jaxtransport') for t in threading.enumerate())\n"
        "print('ok')"
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_setup_hook_chains_an_import_path_and_does_not_start_a_jax_backend():
    """The hook runs in every worker of the job: it registers with the job's placement, runs
    the user's chained hook, and does not initialise JAX's backend (on a GPU host that would
    grab device memory in workers that never use JAX)."""
    r = run_python(
        "import os\n"
        "os.environ['JAXTRANSPORT_RAY_PLACEMENT'] = 'preserve'\n"
        "os.environ['JAXTRANSPORT_RAY_USER_HOOK'] = 'faulthandler.enable'\n"  # a chained hook
        "import faulthandler, jaxtransport.ray as jr\n"
        "assert not faulthandler.is_enabled()\n"
        "jr._setup_worker()\n"
        "from jax._src import xla_bridge\n"
        "assert jr.is_registered() and jr._placement == 'preserve'\n"
        "assert faulthandler.is_enabled(), 'the chained user hook did not run'\n"
        "assert not xla_bridge._backends, 'backend started'\n"
        "print('ok')"
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_missing_ray_raises_import_error_naming_the_extra():
    r = run_python(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import jaxtransport\n"  # still fine without Ray
        "try:\n"
        "    import jaxtransport.ray\n"
        "except ImportError as e:\n"
        "    print('MSG', e)\n"
        "else:\n"
        "    raise SystemExit('imported without ray')\n"
    )
    assert r.returncode == 0, r.stderr
    assert "MSG" in r.stdout and "jaxtransport[ray]" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------
# registration (no cluster needed, but runs after Ray's import)


def _dispatch():
    return ray.cloudpickle.CloudPickler.dispatch.maps[0]


def test_register_is_idempotent_and_unregister_restores_exactly():
    from jaxtransport._tracers import tracer_types

    was = jr.is_registered()
    jr.unregister()
    try:
        types_ = list(_codec.concrete_array_types())
        key_type = types_[1]
        sentinel = lambda obj: (str, ("user reducer",))  # noqa: E731
        _dispatch()[key_type] = sentinel
        original_inspect = ray.util.inspect_serializability
        jr.register()
        jr.register("host")
        assert jr.is_registered()
        for t in types_ + tracer_types():
            assert t in _dispatch(), t
        assert _dispatch()[key_type] is not sentinel
        assert ray.util.inspect_serializability is not original_inspect
        assert ray.util.inspect_serializability.__wrapped__ is original_inspect
        jr.unregister()
        assert not jr.is_registered()
        assert _dispatch()[key_type] is sentinel
        assert types_[0] not in _dispatch()
        assert not any(t in _dispatch() for t in tracer_types())
        assert ray.util.inspect_serializability is original_inspect
        jr.unregister()  # idempotent too
    finally:
        _dispatch().pop(types_[1], None)
        if was:
            jr.register()


def test_register_rejects_unknown_placement():
    with pytest.raises(jaxtransport.PlacementError, match="Unknown placement 'gpu'"):
        jr.register("gpu")
    with pytest.raises(jaxtransport.PlacementError):
        jr.runtime_env(placement="everywhere")


def test_registration_does_not_touch_copyreg():
    before = dict(copyreg.dispatch_table)
    was = jr.is_registered()
    jr.register()
    assert dict(copyreg.dispatch_table) == before
    if not was:
        jr.unregister()


# ------------------------------------------------------------------------------------------
# runtime_env


def test_runtime_env_default():
    env = jr.runtime_env()
    assert env["worker_process_setup_hook"] == "jaxtransport.ray._setup_worker" == jr.SETUP_HOOK
    assert env["env_vars"]["JAXTRANSPORT_RAY_PLACEMENT"] == "device"


def test_runtime_env_merges_without_mutating_base():
    base = {"env_vars": {"A": "1"}, "pip": ["requests"], "working_dir": "."}
    snapshot = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v) for k, v in base.items()}
    env = jr.runtime_env(base, placement="preserve")
    assert base == snapshot
    assert env["pip"] == ["requests"] and env["working_dir"] == "."
    assert env["env_vars"]["A"] == "1"
    assert env["env_vars"]["JAXTRANSPORT_RAY_PLACEMENT"] == "preserve"
    # applying it again changes nothing, and keeps the placement unless told otherwise
    assert jr.runtime_env(env) == env
    assert jr.runtime_env(env, placement="host")["env_vars"]["JAXTRANSPORT_RAY_PLACEMENT"] == "host"


def test_runtime_env_accepts_a_RuntimeEnv():
    from ray.runtime_env import RuntimeEnv

    env = jr.runtime_env(RuntimeEnv(env_vars={"B": "2"}))
    assert env["env_vars"]["B"] == "2" and env["worker_process_setup_hook"] == jr.SETUP_HOOK


def test_runtime_env_chains_an_import_path_hook():
    env = jr.runtime_env({"worker_process_setup_hook": "mypkg.setup.configure"})
    assert env["worker_process_setup_hook"] == jr.SETUP_HOOK
    assert env["env_vars"]["JAXTRANSPORT_RAY_USER_HOOK"] == "mypkg.setup.configure"
    assert jr.runtime_env(env) == env


def test_runtime_env_chains_a_callable_hook(monkeypatch):
    calls = []

    def user_hook():
        calls.append("user")
        return "done"

    env = jr.runtime_env({"worker_process_setup_hook": user_hook})
    hook = env["worker_process_setup_hook"]
    assert callable(hook) and hook is not user_hook and hook.__name__
    assert jr.runtime_env(env)["worker_process_setup_hook"] is hook  # not chained twice
    # Run it here as a worker would: registers (with the env's placement), then the user hook.
    monkeypatch.setenv("JAXTRANSPORT_RAY_PLACEMENT", "host")
    was = jr.is_registered()
    try:
        assert hook() == "done" and calls == ["user"]
        assert jr.is_registered() and jr._placement == "host"
    finally:
        jr.register("device")
        if not was:
            jr.unregister()


def test_runtime_env_rejects_a_bad_hook():
    with pytest.raises(TypeError, match="worker_process_setup_hook must be a callable"):
        jr.runtime_env({"worker_process_setup_hook": 42})


def test_runtime_env_gives_workers_malloc_huge_pages(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert jr.runtime_env()["env_vars"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    base = {"env_vars": {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}}
    assert jr.runtime_env(base)["env_vars"]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the driver's, when base has none
    assert jr.runtime_env()["env_vars"]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in jr.runtime_env(huge_pages=False)["env_vars"]
    off = {"env_vars": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}}
    assert jr.runtime_env(off)["env_vars"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


@ray.remote
def _worker_buffer_huge_kib(nbytes):
    x = jnp.ones(nbytes // 4, jnp.float32).block_until_ready()
    return huge_pages_kib(x.unsafe_buffer_pointer())


@pytest.mark.ray
def test_ray_worker_jax_buffers_get_huge_pages(registered):
    """The runtime_env's tunable reaches the worker at exec: its large JAX buffers are backed by
    transparent huge pages, as numpy's are, so results copy into the object store as fast."""
    why = malloc_huge_pages_work()
    if why:
        pytest.skip(why)
    assert ray.get(_worker_buffer_huge_kib.remote(64 << 20)) > 0


def test_runtime_env_passes_x64_on():
    assert "JAX_ENABLE_X64" not in jr.runtime_env()["env_vars"] or jax.config.jax_enable_x64
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        assert jr.runtime_env()["env_vars"]["JAX_ENABLE_X64"] == "1"
        assert jr.runtime_env({"env_vars": {"JAX_ENABLE_X64": "0"}})["env_vars"]["JAX_ENABLE_X64"] == "0"
    finally:
        jax.config.update("jax_enable_x64", before)


# ------------------------------------------------------------------------------------------
# round trips through the local Ray


@pytest.mark.ray
@pytest.mark.parametrize("shape", [(), (0,), (3, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_as_argument_and_result(registered, dtype, shape):
    x = make(dtype, shape, seed=3)
    info = ray.get(describe.remote(x))
    assert info["registered"] and info["types"] == ["ArrayImpl"] and info["dtypes"] == [str(x.dtype)]
    y = ray.get(echo.remote(x))
    assert_same(x, y)


@pytest.mark.ray
def test_weak_type_survives_both_ways(registered):
    x = jnp.asarray(2.5) * 2  # a weakly typed f32 scalar
    assert x.weak_type
    assert ray.get(describe.remote(x))["weak"] == [True]
    y = ray.get(echo.remote(x))
    assert y.weak_type and float(y) == 5.0
    assert (y + jnp.bfloat16(1)).dtype == jnp.bfloat16  # it still promotes like a weak type


@pytest.mark.ray
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys(registered, impl):
    keys = jax.random.split(jax.random.key(7, impl=impl), 4)
    y = ray.get(echo.remote(keys))
    assert_same(keys, y)
    assert bits(jax.random.normal(y[1], (3,))) == bits(jax.random.normal(keys[1], (3,)))


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.ray
def test_nested_pytree_argument_and_result(registered):
    tree = {
        "params": {"w": make("float32", (4, 3)), "b": make("bfloat16", (3,))},
        "opt": [make("int8", (2,)), (jnp.asarray(1.0), None)],
        "pair": Pair(jax.random.key(1), np.arange(3)),
        "step": 3,
    }
    info = ray.get(describe.remote(tree))
    assert info["registered"]
    assert info["types"].count("ArrayImpl") == 4 and "PRNGKeyArray" in info["types"]
    out = ray.get(echo.remote(tree))
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(out)):
        if isinstance(a, jax.Array):
            assert_same(a, b)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.ray
def test_keyword_arguments_and_shared_references(registered):
    x = make("float32", (64, 64))
    out = ray.get(echo.remote({"same": [x, x], "other": x + 1}))
    assert_same(x, out["same"][0]) and assert_same(x, out["same"][1])
    info = ray.get(describe.remote(x=x))
    assert info["types"] == ["ArrayImpl"]


@pytest.mark.ray
def test_put_get_aliases_the_object_store_buffer(registered, monkeypatch):
    x = make("float32", (1 << 18,))  # 1 MiB: stored in shared memory, 64-byte aligned
    spy = DecodeSpy(monkeypatch)
    ref = ray.put(x)
    y = ray.get(ref)
    assert_same(x, y)
    (buffers,) = spy.calls
    assert y.unsafe_buffer_pointer() == buffers[0]  # no copy: the jax.Array is the plasma bytes
    assert buffers[0] % 64 == 0
    z = ray.get(ref)
    assert z.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()  # one object, shared


def _plasma_used_bytes() -> int:
    from ray._private.internal_api import memory_summary

    # Name our cluster: another Ray on the machine makes address autodetection ambiguous.
    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    assert m, text
    return int(m.group(1)) * MiB


@pytest.mark.ray
@pytest.mark.slow
def test_aliased_buffer_stays_pinned_until_the_array_dies(registered):
    x = make("float32", (32 * MiB // 4,))
    expected = bits(x)
    ref = ray.put(x)
    y = ray.get(ref)
    ptr = y.unsafe_buffer_pointer()
    derived = y[: 1 << 10]  # a view-derived array keeps using the same memory
    del ref
    gc.collect()
    # Churn the store: 12 x 128 MiB through a 1 GiB store reuses every free byte.
    for i in range(12):
        filler = ray.put(np.full(128 * MiB, i % 251, np.uint8))
        del filler
    assert y.unsafe_buffer_pointer() == ptr
    assert bits(y) == expected
    assert bits(derived) == expected[: 4 << 10]
    assert wait_until(lambda: _plasma_used_bytes() >= 32 * MiB, 10), "pinned object was freed"
    used_with = _plasma_used_bytes()
    del y, derived  # no gc.collect(), no further JAX call: see Note [prompt release]
    assert wait_until(lambda: _plasma_used_bytes() <= used_with - 32 * MiB, 15), (
        "the object-store buffer was not released when the array died"
    )


@ray.remote
def nbytes_of(x):
    return int(x.nbytes)  # no JAX call after the argument is decoded


@pytest.mark.ray
def test_an_idle_worker_releases_the_argument_buffer(registered):
    """jaxlib defers the decref of an aliased host buffer to the next JAX call; a worker that
    sits idle after the task must still unpin the object (Note [prompt release])."""
    assert wait_until(lambda: _plasma_used_bytes() < 48 * MiB, 15)
    base = _plasma_used_bytes()
    assert ray.get(nbytes_of.remote(make("uint8", (48 * MiB,)))) == 48 * MiB
    assert wait_until(lambda: _plasma_used_bytes() <= base, 15), (
        f"the worker still pins the argument: {_plasma_used_bytes() - base} bytes in use"
    )


@pytest.mark.ray
def test_worker_results_use_jaxtransport_through_the_setup_hook(registered, monkeypatch):
    """The worker registered through the hook (not only the driver): its result arrives as our
    payload (decoded by the codec here) and aliases the object-store buffer."""

    @ray.remote
    def produce(n):
        import jaxtransport.ray as jr_worker

        return jr_worker.is_registered(), jnp.arange(n, dtype=jnp.float32) * 2

    spy = DecodeSpy(monkeypatch)
    worker_registered, y = ray.get(produce.remote(1 << 18))
    assert worker_registered
    assert len(spy.calls) == 1, "the worker's result did not go through jaxtransport"
    assert y.unsafe_buffer_pointer() == spy.calls[0][0]
    np.testing.assert_array_equal(np.asarray(y), np.arange(1 << 18, dtype=np.float32) * 2)


@pytest.mark.ray
def test_actor_constructor_method_arguments_and_results(registered, monkeypatch):
    a, b = make("bfloat16", (5, 7), seed=1), jax.random.key(5)
    actor = Holder.remote({"a": a})
    try:
        assert ray.get(actor.registered.remote())
        spy = DecodeSpy(monkeypatch)
        got = ray.get(actor.get.remote())
        assert_same(a, got["a"])
        old = ray.get(actor.swap.remote(b))
        assert_same(a, old["a"])
        assert_same(b, ray.get(actor.get.remote()))
        assert len(spy.calls) == 3  # every result came back through jaxtransport
    finally:
        ray.kill(actor)


@pytest.mark.ray
def test_placement_host_on_the_driver(registered):
    x = make("float16", (3, 4))
    ref = ray.put(x)
    jr.register("host")
    y = ray.get(ref)
    assert isinstance(y, np.ndarray) and not y.flags.writeable
    assert bits(x) == bits(y)


@pytest.mark.ray
def test_unregistered_driver_falls_back_to_rays_default(registered, monkeypatch):
    x = make("float32", (1 << 16,))
    jr.unregister()
    spy = DecodeSpy(monkeypatch)
    y = ray.get(ray.put(x))  # JAX's own pickling, in-band
    assert_same(x, y) and spy.calls == []
    # Workers are still registered, and this driver can still decode their payloads.
    assert_same(x, ray.get(echo.remote(x)))
    assert len(spy.calls) == 1


@ray.remote
class Unregistered:
    """An actor whose process unregistered jaxtransport: what every worker of a job started
    with a plain ``ray.init()`` is (its results use Ray's default serialization)."""

    def __init__(self):
        import jaxtransport.ray as jr_worker

        jr_worker.unregister()

    def make(self, n, key=False):
        if key:
            return {"k": jax.random.split(jax.random.key(n), 2)}
        return jnp.arange(n, dtype=jnp.float32)


@pytest.fixture(scope="module")
def unregistered(ray_local):
    """One ``Unregistered`` actor for the module's tests: each new actor is a worker process
    to start (Ray, JAX and this module imported), the most of such a test's time."""
    actor = Unregistered.remote()
    yield actor
    ray.kill(actor)


def _default_path_warnings(record):
    return [w for w in record if issubclass(w.category, jr.RayDefaultSerializationWarning)]


@pytest.mark.ray
def test_a_result_through_rays_default_path_warns_once_naming_the_fix(registered, unregistered, monkeypatch):
    monkeypatch.setattr(jr, "_default_path_warned", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = ray.get(unregistered.make.remote(1000))
        np.testing.assert_array_equal(np.asarray(y), np.arange(1000, dtype=np.float32))
        (w,) = _default_path_warnings(record)
        msg = str(w.message)
        assert "Ray's default serialization" in msg and "jaxtransport.ray.init(" in msg
        assert "runtime_env=jaxtransport.ray.runtime_env(" in msg
        assert w.filename == __file__, "the warning should point at the caller's ray.get"
        # Once per process: neither another array nor a key array warns again.
        ray.get(unregistered.make.remote(10))
        ray.get(unregistered.make.remote(3, key=True))
        assert len(_default_path_warnings(record)) == 1


@pytest.mark.ray
def test_default_path_warning_covers_key_arrays(registered, unregistered, monkeypatch):
    monkeypatch.setattr(jr, "_default_path_warned", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = ray.get(unregistered.make.remote(3, key=True))
    assert jax.dtypes.issubdtype(got["k"].dtype, jax.dtypes.prng_key)
    assert len(_default_path_warnings(record)) == 1


@pytest.mark.ray
def test_no_default_path_warning_for_registered_workers_or_an_unregistered_driver(registered, monkeypatch):
    monkeypatch.setattr(jr, "_default_path_warned", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ray.get(echo.remote(jnp.ones(100)))  # the workers ran the setup hook
        # Not registered here: Ray's default path is what this driver asked for.
        x = make("float32", (100,))
        jr.unregister()
        ray.get(ray.put(x))
        # Plain pickling outside Ray while registered is not Ray's default path either.
        jr.register("device")
        import pickle

        pickle.loads(pickle.dumps(x))
    assert _default_path_warnings(record) == []
    assert not jr._default_path_warned


@pytest.mark.ray
@pytest.mark.slow
def test_plain_ray_init_and_a_driver_only_register_warns():
    """The issue's setup, in a fresh interpreter: ray.init(num_cpus=2), then register() on the
    driver only; a worker's jax.Array result warns once, naming the fix."""
    code = (
        "import warnings, json\n"
        "import ray\n"
        "ray.init(num_cpus=2, include_dashboard=False, runtime_env={'env_vars': {'JAX_PLATFORMS': 'cpu'}})\n"
        "import jax.numpy as jnp, numpy as np, jaxtransport.ray as jr\n"
        "jr.register()\n"
        "@ray.remote\n"
        "def f(n):\n"
        "    return jnp.arange(n, dtype=jnp.float32)\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
        "    ys = [ray.get(f.remote(1 << 16)) for _ in range(3)]\n"
        "ours = [str(w.message) for w in rec if w.category is jr.RayDefaultSerializationWarning]\n"
        "ok = all(np.array_equal(np.asarray(y), np.arange(1 << 16, dtype=np.float32)) for y in ys)\n"
        "ray.shutdown()\n"
        "print('REPORT', json.dumps({'warnings': ours, 'ok': ok}))\n"
    )
    r = run_python(code, env={"JAX_PLATFORMS": "cpu"}, timeout=240)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    import json

    report = json.loads(lines[-1][len("REPORT "):])
    assert report["ok"]
    assert len(report["warnings"]) == 1, report
    assert "jaxtransport.ray.init(" in report["warnings"][0]


@pytest.mark.ray
def test_init_on_a_running_job_with_the_hook_does_not_warn(registered):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jr.init(ignore_reinit_error=True)
    assert jr.is_registered()


# ------------------------------------------------------------------------------------------
# errors at the call site


def _tracer_cases():
    def put_nested(x):
        ray.put({"a": [1, x]})

    def remote_positional(x):
        echo.remote(x)

    def remote_nested_kw(x):
        describe.remote(x={"params": {"w": x}})

    def actor_ctor(x):
        Holder.remote({"w": (x,)})

    return [
        ("put", put_nested, r"value\['a'\]\[1\]"),
        ("remote", remote_positional, r"at value "),
        ("remote-kw", remote_nested_kw, r"value\['params'\]\['w'\]"),
        ("actor", actor_ctor, r"value\['w'\]\[0\]"),
    ]


@pytest.mark.ray
@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
@pytest.mark.parametrize("name,send,path", _tracer_cases(), ids=[c[0] for c in _tracer_cases()])
def test_tracer_raises_tracer_transport_error_at_the_call_site(registered, transform, name, send, path):
    errors = []

    def f(x):
        try:
            send(x)
        except Exception as e:  # noqa: BLE001 - inspected below
            errors.append(e)
        return jnp.sum(x)

    x = jnp.ones((3,))
    {"jit": jax.jit(f), "grad": jax.grad(f), "vmap": jax.vmap(f)}[transform](x if transform != "vmap" else jnp.ones((2, 3)))
    (err,) = errors
    assert type(err) is jaxtransport.TracerTransportError, repr(err)
    assert isinstance(err, jax.errors.ConcretizationTypeError)
    assert re.search(path, str(err)), str(err)
    assert "passed to Ray" in str(err) and "Fix:" in str(err)
    assert err.path and err.path.startswith("value")


@pytest.mark.ray
def test_tracer_in_an_actor_method_argument(registered):
    actor = Holder.remote(1)
    errors = []

    @jax.jit
    def f(x):
        try:
            actor.swap.remote([x])
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        return x

    try:
        f(jnp.ones(2))
        (err,) = errors
        assert type(err) is jaxtransport.TracerTransportError and err.path == "value[0]"
    finally:
        ray.kill(actor)


@pytest.mark.ray
def test_deleted_array_raises_at_the_call_site(registered):
    x = jnp.ones(4)
    x.delete()
    with pytest.raises(jaxtransport.ArrayDeletedError, match="deleted"):
        ray.put(x)
    with pytest.raises(jaxtransport.ArrayDeletedError):
        echo.remote([x])


@pytest.mark.ray
def test_other_serialization_errors_are_still_rays(registered):
    import threading

    with pytest.raises(TypeError, match="Could not serialize"):
        ray.put(threading.Lock())


@pytest.mark.ray
def test_tracer_of_an_unregistered_tracer_class_still_gets_our_error(registered):
    """A Tracer class defined after register() is not in Ray's table: JAX's own __reduce__
    refuses it, and the call site still gets TracerTransportError with the path."""
    from jaxtransport._tracers import tracer_types

    table = ray.cloudpickle.CloudPickler.dispatch.maps[0]
    removed = {t: table.pop(t) for t in tracer_types() if t in table}
    errors = []

    @jax.jit
    def f(x):
        try:
            ray.put({"k": x})
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        return x

    try:
        f(jnp.ones(2))
    finally:
        table.update(removed)
    (err,) = errors
    assert type(err) is jaxtransport.TracerTransportError and err.path == "value['k']"


@pytest.mark.ray
def test_donating_an_aliased_result_does_not_write_into_the_object_store(registered):
    x = make("float32", (1 << 16,))
    ref = ray.put(x)
    y = ray.get(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Some donated buffers were not usable" is fine
        out = jax.jit(lambda a: a * 0 + 1, donate_argnums=0)(y)
    assert float(out[0]) == 1.0
    assert bits(ray.get(ref)) == bits(x)  # the shared object is untouched


@pytest.mark.ray
def test_64_bit_array_to_a_worker_without_x64_fails_clearly(registered):
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        x = jnp.arange(4, dtype=jnp.float64)
        with pytest.raises(ray.exceptions.RayError, match="JAX_ENABLE_X64") as info:
            ray.get(echo.remote(x))
    finally:
        jax.config.update("jax_enable_x64", before)
    assert "64-bit types disabled" in str(info.value)
