"""Caches with JAX arrays: ``jaxtransport.joblib.Memory`` (keys, values, Tracers) and diskcache
with ``jaxtransport.register()``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

joblib = pytest.importorskip("joblib")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxtransport as jt  # noqa: E402
import jaxtransport.joblib as jtj  # noqa: E402

from .conftest import dtype_params, run_python, weak_typed  # noqa: E402
from .test_codec import DTYPES, assert_same, make  # noqa: E402


@pytest.fixture
def registered():
    jt.register()
    yield
    jt.unregister()


def _tree():
    return {
        "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "key": jax.random.key(3),
        "weak": jnp.asarray(1.5),
        "np": np.arange(5),
        "meta": ("name", 3),
    }


# ------------------------------------------------------------------------------------------
# keys


def test_keys_do_not_change_with_register_and_match_in_a_fresh_process():
    before = jtj.hash(_tree())
    jt.register()
    try:
        during = jtj.hash(_tree())
        plain_during = joblib.hash(_tree()["w"])
    finally:
        jt.unregister()
    assert before == during
    assert plain_during != joblib.hash(_tree()["w"])  # why plain joblib.Memory misses (docs)
    code = (
        "import jax, jax.numpy as jnp, numpy as np, jaxtransport.joblib as jtj\n"
        "t = {'w': jnp.arange(12, dtype=jnp.float32).reshape(3, 4), 'key': jax.random.key(3),"
        " 'weak': jnp.asarray(1.5), 'np': np.arange(5), 'meta': ('name', 3)}\n"
        "print(jtj.hash(t))\n"
    )
    proc = run_python(code, env={"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == before


def test_keys_tell_apart_dtype_shape_weak_type_and_key_type():
    x = jnp.arange(6, dtype=jnp.float32)
    variants = [
        x,
        x.reshape(2, 3),
        x.astype(jnp.int32),
        weak_typed(x),
        x.at[0].set(7.0),
        jax.random.key(0),
        jax.random.key_data(jax.random.key(0)),
        jax.random.key(0, impl="rbg"),
    ]
    keys = [jtj.hash(v) for v in variants]
    assert len(set(keys)) == len(keys)
    assert jtj.hash(jnp.arange(6, dtype=jnp.float32)) == keys[0]
    # A numpy array and a jax.Array of the same bytes are different arguments.
    assert jtj.hash(np.asarray(x)) != keys[0] and jtj.hash(np.asarray(x)) == joblib.hash(np.asarray(x))


def test_memory_hits_across_register(tmp_path):
    mem = jtj.Memory(tmp_path, verbose=0)
    calls = []

    @mem.cache
    def f(x):
        calls.append(1)
        return x + 1

    f(jnp.arange(3.0))
    jt.register()
    try:
        f(jnp.arange(3.0))
    finally:
        jt.unregister()
    assert calls == [1]


def test_async_functions_are_cached(tmp_path):
    import asyncio

    mem = jtj.Memory(tmp_path, verbose=0)
    calls = []

    @mem.cache
    async def f(x):
        calls.append(1)
        return {"y": x * 2}

    out = [asyncio.run(f(jnp.arange(3.0))) for _ in range(2)]
    assert calls == [1] and isinstance(out[1]["y"], jax.Array)
    np.testing.assert_array_equal(out[1]["y"], np.arange(3.0) * 2)
    # Its repr is joblib's, "AsyncMemorizedFunc(func=..., location=...)" (joblib's own
    # test_memory.py checks the synchronous one: tests/test_joblib_peer.py).
    assert repr(f) == repr(joblib.Memory(tmp_path, verbose=0).cache(f.func))


# ------------------------------------------------------------------------------------------
# values


@pytest.mark.parametrize("dtype", dtype_params(DTYPES))
def test_values_round_trip_every_dtype(tmp_path, dtype):
    mem = jtj.Memory(tmp_path, verbose=0)
    x = make(dtype, (3, 5))
    calls = []

    @mem.cache
    def ident(n):
        calls.append(n)
        return {"x": x, "weak": weak_typed(x)}

    ident(1)
    out = ident(1)
    assert calls == [1]
    assert_same(x, out["x"])
    assert_same(weak_typed(x), out["weak"])


def test_values_prng_keys_numpy_shelving_and_mmap(tmp_path):
    mem = jtj.Memory(tmp_path, verbose=0)
    tree = _tree()

    @mem.cache
    def f(n):
        return tree

    f(1)
    out = f(1)
    for k in ("w", "key", "weak"):
        assert_same(tree[k], out[k])
    np.testing.assert_array_equal(out["np"], tree["np"])
    assert out["meta"] == ("name", 3)
    shelved = f.call_and_shelve(1).get()
    assert_same(tree["key"], shelved["key"])

    host = jtj.Memory(tmp_path / "h", verbose=0, mmap_mode="r", placement="host")

    @host.cache
    def g(n):
        return {"a": jnp.arange(1000, dtype=jnp.float32) * n, "n": np.arange(1000) * n}

    g(2)
    out = g(2)
    assert isinstance(out["a"], np.memmap) and isinstance(out["n"], np.memmap)
    np.testing.assert_array_equal(out["a"], np.arange(1000, dtype=np.float32) * 2)


def test_sharded_values_preserve_and_keys_ignore_layout(tmp_path):
    code = f"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxtransport.joblib as jtj
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x")))
y = jax.device_put(jnp.arange(16.0).reshape(8, 2), jax.devices()[0])
assert jtj.hash(x) == jtj.hash(y)
mem = jtj.Memory({str(tmp_path)!r}, verbose=0, placement="preserve")
f = mem.cache(lambda n: x)
f(1); out = f(1)
assert out.sharding == x.sharding, out.sharding
assert (np.asarray(out) == np.asarray(x)).all()
print("ok")
"""
    proc = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_other_stores_are_refused_by_name(tmp_path):
    from joblib._store_backends import FileSystemStoreBackend

    class Other(FileSystemStoreBackend):
        pass

    joblib.register_store_backend("jaxtransport-test-other", Other)
    with pytest.raises(ValueError, match="local store only"):
        jtj.Memory(tmp_path, backend="jaxtransport-test-other", verbose=0)


# ------------------------------------------------------------------------------------------
# Tracers: never a silent uncached call


@pytest.mark.parametrize(
    "wrap, path",
    [
        (lambda t: t, "p"),
        (lambda t: {"w": t}, "p['w']"),
        (lambda t: {"params": {"w": t}}, "p['params']['w']"),  # joblib's hasher loses this one
        (lambda t: [{"a": ({"b": t},)}], "p[0]['a'][0]['b']"),
    ],
    ids=["bare", "one-deep", "two-deep", "deeper"],
)
def test_tracer_at_any_depth_raises_with_its_path(tmp_path, wrap, path):
    mem = jtj.Memory(tmp_path, verbose=0)

    @mem.cache
    def f(p):
        return 1

    @jax.jit
    def traced(w):
        f(wrap(w))
        return w

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # joblib's CacheWarning would mean an uncached run
        with pytest.raises(jt.TracerTransportError) as info:
            traced(jnp.ones(3))
    assert info.value.path == path
    assert "jaxtransport.joblib.Memory" in str(info.value) and "outside the transformation" in str(info.value)
    with pytest.raises(jt.TracerTransportError):
        jax.jit(lambda w: jtj.hash({"a": {"b": w}}))(jnp.ones(2))


# ------------------------------------------------------------------------------------------
# diskcache with jaxtransport.register()


def test_diskcache_round_trips_values_and_keys(tmp_path, registered):
    diskcache = pytest.importorskip("diskcache")
    tree = _tree()
    with diskcache.Cache(str(tmp_path)) as cache:
        cache["t"] = tree
        cache[tree["w"]] = "by array"  # a jax.Array as a key
        out = cache["t"]
        for k in ("w", "key", "weak"):
            assert_same(tree[k], out[k])
        assert cache[jnp.arange(12, dtype=jnp.float32).reshape(3, 4)] == "by array"
        calls = []

        @cache.memoize()
        def f(x, key):
            calls.append(1)
            return {"y": x * 2, "key": key}

        a = f(tree["w"], tree["key"])
        b = f(jnp.arange(12, dtype=jnp.float32).reshape(3, 4), jax.random.key(3))
        assert calls == [1]
        assert_same(a["y"], b["y"]) and assert_same(tree["key"], b["key"])

        @jax.jit
        def traced(w):
            return f(w, tree["key"])["y"]

        with pytest.raises(jt.TracerTransportError):
            traced(jnp.ones(3))


@jax.tree_util.register_pytree_node_class
class Strict:
    """A pytree node whose constructor (called by unflatten) validates its leaf."""

    def __init__(self, w):
        if not isinstance(w, jax.Array):
            raise TypeError("Strict wants a jax.Array")
        self.w = w

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_a_pytree_that_validates_its_leaves_is_still_cached(tmp_path):
    mem = jtj.Memory(tmp_path, verbose=0)
    calls = []

    @mem.cache
    def f(n):
        calls.append(n)
        return {"s": Strict(jnp.arange(3.0) * n), "x": jnp.arange(2)}

    f(2)
    out = f(2)
    assert calls == [2] and isinstance(out["s"], Strict)
    np.testing.assert_array_equal(out["s"].w, np.arange(3.0) * 2)
