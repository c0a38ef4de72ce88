"""The core codec: bit-exact round trips, placements, zero copy, registration, errors."""

from __future__ import annotations

import copyreg
import io
import multiprocessing
import pickle
import sys
import warnings

import cloudpickle
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _codec, _compat
from jaxtransport._pickling import _rebuild_array

from .conftest import dtype_missing, dtype_params, run_python, shard_map, weak_typed

# Every 32-bit-or-narrower JAX dtype (64-bit ones need x64: see test_x64_* below).
DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "float16",
    "bfloat16",
    "float32",
    "complex64",
    "int4",
    "uint4",
    "int2",
    "uint2",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "float4_e2m1fn",
]
ALL_DTYPES = [d for d in DTYPES if d == "bool" or hasattr(ml_dtypes, d) or hasattr(np, d)]
# Those this JAX has (older ones lack int2, float8_e8m0fnu, ...): tests parametrized with
# dtype_params(ALL_DTYPES) skip the others with the reason.
DTYPES = [d for d in ALL_DTYPES if dtype_missing(d) is None]
SHAPES = [(), (0,), (3, 0, 2), (7,), (3, 5), (2, 3, 4)]
PLACEMENTS = ["device", "host", "preserve"]


def random_bits(dtype, shape, seed=0) -> np.ndarray:
    """Arbitrary bit patterns valid for ``dtype`` (NaN payloads, -0.0, subnormals included)."""
    dt = np.dtype(jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn"):
        info_bits = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "float4_e2m1fn": 4}[dt.name]
        raw = rng.integers(0, 1 << info_bits, size=n, dtype=np.uint8)
        if dt.name.startswith("int"):  # sign-extend into the byte as ml_dtypes stores it
            sign = 1 << (info_bits - 1)
            raw = np.where(raw & sign, raw | (0xFF ^ ((1 << info_bits) - 1)), raw).astype(np.uint8)
        return raw.view(dt).reshape(shape)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def make(dtype, shape, seed=0):
    return jnp.asarray(random_bits(dtype, shape, seed))


def bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def assert_same(a, b, *, placement="device"):
    if placement == "host" and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        assert isinstance(b, np.ndarray)
    else:
        assert isinstance(b, jax.Array)
        assert getattr(b, "weak_type", False) == getattr(a, "weak_type", False)
    assert b.dtype == a.dtype and b.shape == a.shape
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b))
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert bits(a) == bits(b)


# ------------------------------------------------------------------------------------------
# round trips in-process


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", dtype_params(ALL_DTYPES))
def test_roundtrip_dumps_loads(dtype, shape, placement):
    x = make(dtype, shape)
    data, buffers = jt.dumps(x)
    y = jt.loads(data, buffers, placement=placement)
    assert_same(x, y, placement=placement)
    if placement == "device":
        assert not _compat.is_committed(y)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_registered_pickle_all_protocols(protocol):
    x = make("bfloat16", (4, 5))
    jt.register()
    try:
        blob = pickle.dumps({"x": x, "w": jnp.asarray(1.5)}, protocol=protocol)
        assert b"_rebuild_array" in blob
        out = pickle.loads(blob)
    finally:
        jt.unregister()
    assert_same(x, out["x"])
    assert out["w"].weak_type and float(out["w"]) == 1.5


def test_nan_payloads_and_negative_zero():
    raw = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0x00000001], np.uint32)
    x = jnp.asarray(raw.view(np.float32))
    y = jt.loads(*jt.dumps(x))
    assert np.asarray(y).view(np.uint32).tolist() == raw.tolist()


@pytest.mark.parametrize("placement", ["device", "preserve"])
def test_weak_type_preserved(placement):
    weak = (jnp.asarray(2.0), jnp.asarray(3), jnp.asarray(1j), jnp.full((3,), 2.0) * 1,
            jnp.full((2, 0), 1.5), weak_typed(jnp.arange(5, dtype=jnp.float32)))
    strong = (jnp.asarray(np.float32(2.0)), jnp.ones(3) * jnp.asarray(2.0))
    assert all(x.weak_type for x in weak) and not any(x.weak_type for x in strong)
    for x in weak + strong:
        y = jt.loads(*jt.dumps(x), placement=placement)
        assert y.weak_type == x.weak_type
        assert bits(y) == bits(x)
        assert (y + np.float16(1)).dtype == (x + np.float16(1)).dtype


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 2)], ids=str)
def test_prng_keys(impl, shape):
    k = jax.random.key(42, impl=impl)
    if shape:
        k = jax.random.split(k, int(np.prod(shape))).reshape(shape)
    for placement in PLACEMENTS:
        k2 = jt.loads(*jt.dumps(k), placement=placement)
        assert_same(k, k2, placement=placement)
        assert jnp.array_equal(jax.random.normal(k.reshape(-1)[0], (3,)), jax.random.normal(k2.reshape(-1)[0], (3,)))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_prng_impl_travels_by_canonical_name(impl):
    """The wire carries the name wrap_key_data accepts on every jax (before jax 0.4.36,
    str(key_impl) is a short tag such as 'fry'); tags from older senders still decode."""
    k = jax.random.key(7, impl=impl)
    meta, buffers = _codec.encode(k)
    assert meta.prng_impl == impl
    legacy = {"threefry2x32": "fry", "rbg": "rbg", "unsafe_rbg": "urbg"}[impl]
    k2 = _codec.decode(tuple(meta._replace(prng_impl=legacy)), buffers)
    assert_same(k, k2)


def test_unknown_prng_impl_is_a_transport_error():
    meta, buffers = _codec.encode(jax.random.key(0))
    with pytest.raises(jt.TransportError, match=r"'no_such_prng'.*jax " + jax.__version__.replace(".", r"\.")):
        _codec.decode(tuple(meta._replace(prng_impl="no_such_prng")), buffers)


def test_weak_type_without_a_way_to_build_it_is_a_transport_error(monkeypatch):
    """When this jax's internals leave no way to rebuild a weak-typed array, decoding says so
    (TransportError naming the jax version), not a bare AttributeError from inside JAX."""

    def moved(x):
        raise AttributeError("property '' of 'ArrayImpl' object has no setter")

    monkeypatch.setattr(_compat, "_rewrap_weak", moved)
    monkeypatch.setattr(_compat, "_weak_ok", None)
    w = jnp.full((4,), 1.5)
    assert w.weak_type
    data, buffers = jt.dumps(w)
    with pytest.raises(jt.TransportError, match=r"weak-typed.*jax " + jax.__version__.replace(".", r"\.")):
        jt.loads(data, buffers, placement="preserve")
    np.testing.assert_array_equal(jt.loads(data, buffers, placement="host"), np.full(4, 1.5, np.float32))


def test_no_private_jax_api_outside_compat():
    """Every private JAX API use sits in jaxtransport/_compat.py (probe, fallback, reference)."""
    import pathlib
    import re

    pkg = pathlib.Path(jt.__file__).parent
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"jax\._src|jaxlib\.|\.aval\s*=[^=]|\b_committed\b", line):
                offenders.append(f"{path.relative_to(pkg)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_legacy_uint32_keys_stay_plain_arrays():
    k = jax.random.PRNGKey(0)
    k2 = jt.loads(*jt.dumps(k))
    assert k2.dtype == jnp.uint32 and bits(k) == bits(k2)


def test_nested_object_graph_and_shared_references():
    x = make("float32", (8,))
    tree = {"a": [x, x], "b": (jnp.ones(2), {"c": None, "d": "text"}), "f": lambda v: v + 1}
    out = jt.loads(*jt.dumps(tree))
    assert out["a"][0] is out["a"][1]  # pickle memo: one array, one rebuild
    assert bits(out["a"][0]) == bits(x)
    assert out["f"](1) == 2  # cloudpickle: lambdas travel


# ------------------------------------------------------------------------------------------
# zero copy


def test_dumps_ships_out_of_band_without_copy():
    x = jnp.arange(1 << 18, dtype=jnp.float32)  # 1 MiB
    data, buffers = jt.dumps(x)
    assert len(data) < 1024, "the array bytes must not be in the pickle stream"
    assert [b.nbytes for b in buffers] == [x.nbytes]
    addr = np.frombuffer(buffers[0], np.uint8).ctypes.data
    assert addr == x.unsafe_buffer_pointer(), "dumps copied the device buffer"


def test_loads_aliases_aligned_buffer_on_cpu():
    x = jnp.arange(1 << 16, dtype=jnp.float32)
    data, buffers = jt.dumps(x)
    # A receiver's buffer: a fresh 64-byte-aligned copy, as a transport would deliver it.
    store = np.empty(x.nbytes + 64, np.uint8)
    off = (-store.ctypes.data) % 64
    view = store[off : off + x.nbytes]
    view[:] = np.frombuffer(buffers[0], np.uint8)
    y = jt.loads(data, [memoryview(view)])
    assert y.unsafe_buffer_pointer() == view.ctypes.data, "device placement copied an aligned buffer"
    h = jt.loads(data, [memoryview(view)], placement="host")
    assert h.ctypes.data == view.ctypes.data
    del y, h


def test_decode_takes_the_short_device_put_path(monkeypatch):
    """decode places host buffers through batched_device_put directly (no jax.device_put
    layers); the result is what jax.device_put would give: uncommitted, default device, same
    weak type, aliasing; and the plain jax.device_put path gives the same values."""
    from jaxtransport import _compat

    fast, why = _compat.fast_put_available()
    if not fast:  # a perf loss in a jax whose internals moved, not an error
        pytest.skip(f"jax {jax.__version__}: batched_device_put path unavailable ({why}), decode uses jax.device_put")
    for x in (jnp.arange(1 << 12, dtype=jnp.float32), jnp.full((1 << 12,), 1.5)):
        data, buffers = jt.dumps(x)
        y = jt.loads(data, buffers)
        ref = jax.device_put(np.asarray(x))
        assert (y.sharding, _compat.is_committed(y), y.dtype) == (ref.sharding, _compat.is_committed(ref), ref.dtype)
        assert y.weak_type == x.weak_type
        monkeypatch.setattr(_compat, "_FAST_PUT", False)
        z = jt.loads(data, buffers)
        monkeypatch.undo()
        assert bits(z) == bits(y) == bits(x)
        assert (z.sharding, z.weak_type) == (y.sharding, y.weak_type)


def test_decode_honours_the_default_device():
    code = """
import jax, jax.numpy as jnp, numpy as np, jaxtransport as jt
from jaxtransport import _codec
x = jnp.arange(4096, dtype=jnp.float32)
data, buffers = jt.dumps(x)
store = np.empty(x.nbytes + 64, np.uint8); off = (-store.ctypes.data) % 64
view = store[off:off + x.nbytes]; view[:] = np.frombuffer(buffers[0], np.uint8)
with jax.default_device(jax.devices()[1]):
    y = jt.loads(data, [memoryview(view)])
    ref = jax.device_put(np.asarray(x))
assert y.devices() == ref.devices() == {jax.devices()[1]}, (y.devices(), ref.devices())
from jaxtransport._compat import is_committed
assert not is_committed(y) and y.unsafe_buffer_pointer() == view.ctypes.data
assert jt.loads(data, buffers).devices() == {jax.devices()[0]}
print("ok")
"""
    proc = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_loaded_array_outlives_source_and_its_deletion():
    x = jnp.arange(1024, dtype=jnp.int32) * 3
    expected = bits(x)
    y = jt.loads(*jt.dumps(x))
    x.delete()
    _ = [jnp.ones(4096) + i for i in range(20)]  # churn the allocator
    assert bits(y) == expected


# ------------------------------------------------------------------------------------------
# errors


def test_deleted_array_error():
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(jt.ArrayDeletedError, match="deleted or donated"):
        jt.dumps(x)


def test_donated_array_error():
    f = jax.jit(lambda a: a + 1, donate_argnums=0)
    x = jnp.ones(16)
    f(x)
    if not x.is_deleted():
        pytest.skip("this backend ignores donation")
    with pytest.raises(jt.ArrayDeletedError, match="donat"):
        jt.dumps({"x": x})


def test_bad_placement():
    data, bufs = jt.dumps(jnp.ones(2))
    with pytest.raises(jt.PlacementError, match=r"'device'.*'host'.*'preserve'"):
        jt.loads(data, bufs, placement="gpu")
    with pytest.raises(jt.PlacementError):
        jt.register(placement="nowhere")
    assert not jt.is_registered()


def test_corrupt_buffers_raise_clearly():
    data, bufs = jt.dumps(jnp.ones(16))
    with pytest.raises(jt.TransportError, match="needs 64 bytes but 8 arrived"):
        jt.loads(data, [memoryview(bytes(8))])


def test_errors_pickle():
    for err in (
        jt.TracerTransportError("f32[3] tracer", "['a']", where="x"),
        jt.ArrayDeletedError("gone"),
        jt.DtypeUnavailableError("no x64"),
        jt.UnsupportedArrayError("no"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


# ------------------------------------------------------------------------------------------
# tracers


def _catch(fn):
    try:
        fn()
    except jt.TracerTransportError as e:
        return e
    raise AssertionError("no TracerTransportError")


def _traced_error(transform, send):
    """Run ``send(tracer)`` inside ``transform`` and return the error it raised."""
    box = {}

    def f(x):
        box["err"] = _catch(lambda: send(x))
        return x.sum() if transform is jax.grad else x

    if transform is jax.lax.scan:
        jax.lax.scan(lambda c, x: (c, f(x)), 0.0, jnp.ones((2, 3)))
    elif transform is jax.vmap:
        jax.vmap(f)(jnp.ones((2, 3)))
    elif transform is jax.grad:
        jax.grad(f)(jnp.ones(3))
    else:
        transform(f)(jnp.ones(3))
    return box["err"]


SENDERS = {
    "dumps": lambda t: jt.dumps({"params": {"w": t}}),
    "check": lambda t: jt.check_transportable({"params": {"w": t}}),
}


@pytest.mark.parametrize("how", list(SENDERS))
@pytest.mark.parametrize(
    "transform,label",
    [(jax.jit, "jit"), (jax.grad, "grad"), (jax.vmap, "vmap"), (jax.lax.scan, "scan")],
    ids=["jit", "grad", "vmap", "scan"],
)
def test_tracer_errors(transform, label, how):
    err = _traced_error(transform, SENDERS[how])
    assert isinstance(err, jax.errors.ConcretizationTypeError)
    assert err.path == "['params']['w']"
    msg = str(err)
    assert "['params']['w']" in msg and label in msg
    assert "io_callback" in msg and "outside" in msg
    assert "f32[3]" in msg or "f32[]" in msg
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, jt.TracerTransportError) and back.path == err.path


def test_tracer_under_shard_map():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    box = {}

    def body(x):
        box["err"] = _catch(lambda: jt.check_transportable([x]))
        return x

    shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones(4))
    assert box["err"].path == "[0]"
    assert "shard_map" in str(box["err"])


def test_registered_pickle_refuses_tracers_and_existing_handlers_still_catch():
    jt.register()
    try:
        def f(x):
            with pytest.raises(jax.errors.ConcretizationTypeError, match="check_transportable"):
                pickle.dumps([1, {"k": x}])
            with pytest.raises(jt.TracerTransportError):
                cloudpickle.dumps(x)
            return x

        jax.jit(f)(1.0)
        jax.vmap(f)(jnp.ones(2))
    finally:
        jt.unregister()


class _Plain:  # a flax.linen-style object: not a pytree, state in __dict__
    def __init__(self, w):
        self.layer = {"w": w}


class _Slots:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b


def test_check_transportable_paths_through_containers():
    import collections
    import dataclasses

    Point = collections.namedtuple("Point", "x y")

    @dataclasses.dataclass
    class Params:
        w: jax.Array
        b: jax.Array

    # fields named: jax < 0.4.36 cannot infer them
    jax.tree_util.register_dataclass(Params, data_fields=["w", "b"], meta_fields=[])

    def f(x):
        cases = {
            "[1].y": [0, Point(1, x)],
            ".b": Params(w=np.ones(1), b=x),
            "['m'].layer['w']": {"m": _Plain(x)},
            "[0].b": [_Slots(1, x)],
            "[{1: 2}][0]": [{1: 2, "a": 3, None: [x]}],  # unsortable keys: the plain walk
        }
        for expected, tree in cases.items():
            err = _catch(lambda: jt.check_transportable(tree))
            assert err.path == expected or expected.startswith("[{"), (expected, err.path)
        jt.check_transportable({"fine": [np.ones(2), "s", 1, None, {1, 2}, _Plain(3)]})
        return x

    jax.jit(f)(1.0)


def test_check_transportable_root_prefix():
    def f(x):
        err = _catch(lambda: jt.check_transportable(({"p": x},), root="args"))
        assert err.path == "args[0]['p']"
        return x

    jax.jit(f)(1.0)


# ------------------------------------------------------------------------------------------
# registration


def _jax_own_pickle(x):
    return pickle.dumps(x, protocol=5)


def test_register_unregister_restores_exactly():
    x = jnp.arange(6.0)
    before_table = dict(copyreg.dispatch_table)
    before_bytes = _jax_own_pickle(x)
    jt.register()
    jt.register(placement="host")  # idempotent; only the placement changes
    assert jt.is_registered()
    assert b"jaxtransport" in pickle.dumps(x)
    assert isinstance(pickle.loads(pickle.dumps(x)), np.ndarray)
    jt.unregister()
    jt.unregister()
    assert dict(copyreg.dispatch_table) == before_table
    assert _jax_own_pickle(x) == before_bytes
    assert b"jaxtransport" not in pickle.dumps(x)
    assert not jt.is_registered()


def test_register_keeps_a_users_previous_reducer():
    cls = type(jnp.zeros(()))
    sentinel = lambda a: (int, (7,))  # noqa: E731
    copyreg.dispatch_table[cls] = sentinel
    try:
        jt.register()
        assert copyreg.dispatch_table[cls] is not sentinel
        jt.unregister()
        assert copyreg.dispatch_table[cls] is sentinel
    finally:
        copyreg.dispatch_table.pop(cls, None)


def test_register_reaches_cloudpickle_and_forking_pickler():
    from multiprocessing.reduction import ForkingPickler

    x = jnp.ones(4)
    jt.register()
    try:
        assert b"_rebuild_array" in cloudpickle.dumps(x)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(x)
        assert b"_rebuild_array" in buf.getvalue()
    finally:
        jt.unregister()


def _queue_child(q_in, q_out):
    import jaxtransport as jt_

    jt_.register()
    item = q_in.get(timeout=60)
    q_out.put({"back": item["x"] * 2, "placement": type(item["x"]).__name__, "key": item["k"]})


def test_multiprocessing_queue_roundtrip_spawned():
    ctx = multiprocessing.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_queue_child, args=(q_in, q_out))
    jt.register()
    try:
        p.start()
        x = make("bfloat16", (16, 16))
        k = jax.random.key(1, impl="rbg")
        q_in.put({"x": x, "k": k})
        out = q_out.get(timeout=120)
    finally:
        jt.unregister()
        p.join(30)
        q_in.close(), q_out.close()
        q_in.join_thread(), q_out.join_thread()
    assert p.exitcode == 0
    assert out["placement"] == "ArrayImpl"
    assert bits(out["back"]) == bits(x * 2)
    assert_same(k, out["key"])


# ------------------------------------------------------------------------------------------
# a real spawned process: every dtype x shape x placement


_CHILD = r"""
import pickle, sys, hashlib, json
import numpy as np, jax, jax.numpy as jnp
import jaxtransport as jt
from jaxtransport._compat import is_committed
cases = pickle.load(open(sys.argv[1] if len(sys.argv) > 1 else {path!r}, "rb"))
out = {{}}
for name, (data, buffers) in cases.items():
    for placement in ("device", "host", "preserve"):
        y = jt.loads(data, [memoryview(b) for b in buffers], placement=placement)
        is_key = jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
        raw = jax.random.key_data(y) if is_key else y
        out[name + "/" + placement] = dict(
            type=type(y).__name__,
            dtype=str(y.dtype),
            shape=list(y.shape),
            weak=bool(getattr(y, "weak_type", False)),
            sha=hashlib.sha256(np.ascontiguousarray(np.asarray(raw)).view(np.uint8).tobytes()).hexdigest(),
            committed=is_committed(y) if isinstance(y, jax.Array) else False,
        )
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def spawned_results(tmp_path_factory):
    import hashlib
    import json

    cases, expected = {}, {}
    for dtype in DTYPES:
        for shape in SHAPES:
            x = make(dtype, shape, seed=len(cases))
            name = f"{dtype}{list(shape)}"
            data, bufs = jt.dumps(x)
            cases[name] = (data, [bytes(b) for b in bufs])
            expected[name] = (x, hashlib.sha256(bits(x)).hexdigest())
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        k = jax.random.split(jax.random.key(3, impl=impl), 4)
        name = f"key-{impl}"
        data, bufs = jt.dumps(k)
        cases[name] = (data, [bytes(b) for b in bufs])
        expected[name] = (k, hashlib.sha256(bits(jax.random.key_data(k))).hexdigest())
    w = jnp.asarray(0.5)
    cases["weak"] = tuple(jt.dumps(w))
    cases["weak"] = (cases["weak"][0], [bytes(b) for b in cases["weak"][1]])
    expected["weak"] = (w, hashlib.sha256(bits(w)).hexdigest())
    path = tmp_path_factory.mktemp("spawn") / "cases.pkl"
    with open(path, "wb") as f:
        pickle.dump(cases, f)
    proc = run_python(_CHILD.format(path=str(path)), env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return expected, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_spawned_process_roundtrip_every_dtype_shape(spawned_results, placement):
    expected, got = spawned_results
    for name, (x, sha) in expected.items():
        r = got[f"{name}/{placement}"]
        is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        assert r["sha"] == sha, name
        assert r["dtype"] == str(x.dtype) and r["shape"] == list(x.shape), name
        if placement == "host" and not is_key:
            assert r["type"] == "ndarray", name
        else:
            assert r["type"] in ("ArrayImpl", "PRNGKeyArray"), name
            assert r["weak"] == bool(getattr(x, "weak_type", False)), name
        if placement == "device":
            assert not r["committed"], name


# ------------------------------------------------------------------------------------------
# 64-bit types


def test_x64_roundtrip_and_receiver_without_x64(tmp_path):
    code = r"""
import jax, jax.numpy as jnp, numpy as np, pickle, sys
jax.config.update("jax_enable_x64", True)
import jaxtransport as jt
xs = {d: jnp.asarray(np.arange(-3, 3).astype(d) * (np.pi if d.startswith(("f", "c")) else 1) + (1j if d.startswith("c") else 0))
      for d in ("float64", "int64", "uint64", "complex128")}
xs["uint64"] = jnp.asarray(np.array([0, 2**64 - 1], np.uint64))
blob = {d: (lambda p: (p[0], [bytes(b) for b in p[1]]))(jt.dumps(x)) for d, x in xs.items()}
for d, (data, bufs) in blob.items():
    y = jt.loads(data, bufs)
    assert y.dtype == xs[d].dtype and np.asarray(y).tobytes() == np.asarray(xs[d]).tobytes(), d
pickle.dump({d: (b, np.asarray(xs[d])) for d, b in blob.items()}, open(sys.argv[1] if len(sys.argv) > 1 else PATH, "wb"))
print("ok")
""".replace("PATH", repr(str(tmp_path / "x64.pkl")))
    proc = run_python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    with open(tmp_path / "x64.pkl", "rb") as f:
        blob = pickle.load(f)
    assert not jax.config.jax_enable_x64
    for d, ((data, bufs), ref) in blob.items():
        with pytest.raises(jt.DtypeUnavailableError, match="jax_enable_x64"):
            jt.loads(data, bufs)
        host = jt.loads(data, bufs, placement="host")
        assert host.dtype == ref.dtype and host.tobytes() == ref.tobytes()


# ------------------------------------------------------------------------------------------
# import has no side effects


def test_import_has_no_side_effects():
    code = r"""
import copyreg, sys, threading
import jax, numpy, cloudpickle  # what jaxtransport's dependencies register is not ours
before_threads = threading.active_count()
before = dict(copyreg.dispatch_table)
import jaxtransport
import jax._src.xla_bridge as xb
assert "ray" not in sys.modules, "imported ray"
assert dict(copyreg.dispatch_table) == before, "registered reducers"
assert not xb._backends, "started a JAX backend"
assert threading.active_count() == before_threads, "started threads"
assert not jaxtransport.is_registered()
import multiprocessing
assert not multiprocessing.active_children(), "started processes"
print("clean")
"""
    proc = run_python(code)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------
# property tests

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    seed=st.integers(0, 2**31),
    placement=st.sampled_from(PLACEMENTS),
    weak=st.booleans(),
    protocol=st.sampled_from([None, 4, 5]),
)
def test_property_roundtrip(dtype, shape, seed, placement, weak, protocol):
    x = make(dtype, shape, seed)
    if weak and dtype in ("float32", "int32", "complex64"):
        x = weak_typed(x)
    if protocol is None:
        y = jt.loads(*jt.dumps(x), placement=placement)
    else:
        jt.register(placement=placement)
        try:
            y = pickle.loads(pickle.dumps(x, protocol=protocol))
        finally:
            jt.unregister()
    assert_same(x, y, placement=placement)


def test_rebuild_path_is_stable():
    # The rebuild function's import path is written into every pickle.
    assert _rebuild_array.__module__ == "jaxtransport._pickling"
    assert _codec.FORMAT_VERSION == 1
    assert "jaxtransport._pickling" in sys.modules


def test_copy_and_deepcopy_unaffected_by_register():
    import copy

    jt.register()
    try:
        for x in (make("bfloat16", (3, 2)), jax.random.key(0, impl="rbg"), jnp.asarray(1.0)):
            for fn in (copy.copy, copy.deepcopy):
                assert_same(x, fn(x))
    finally:
        jt.unregister()
