"""On an accelerator (``make test-device``): this process holds the device JAX finds (a TPU
chip, a GPU); every face of jaxtransport moves its arrays, both ways, and the processes that
jaxtransport starts keep off the device by default (jaxtransport/_devices). Without an
accelerator every test here is skipped (conftest: the ``device`` marker), as in CI.

Arrays are made with ``jax.device_put`` of host data, not ``jnp.asarray``: on a TPU v5e some
operations do not compile for some narrow dtypes (a reshape of an int2 vector is refused, and a
jnp.asarray of int2 once aborted the whole interpreter), and what is under test is the
transport, whose decode only ever puts buffers on a device."""

from __future__ import annotations

import io
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
import jaxtransport.multiprocessing as jmp

from .conftest import dtype_missing

pytestmark = pytest.mark.device

MiB = 1 << 20
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32",
          "complex64", "int4", "uint4", "int2", "uint2", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn"]


def _np_dtype(name):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


def _bits(dtype, shape, seed=0):
    dt = _np_dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    a = raw.view(dt).reshape(shape) if dt.itemsize > 0 else raw
    if dt.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn", "bool"):
        a = np.zeros(shape, dt)  # (values outside the narrow type's range do not round-trip anywhere)
        a.reshape(-1)[::3] = np.ones((), dt)
    return a


def _sha(a):
    import hashlib

    return hashlib.sha256(np.asarray(a).tobytes()).hexdigest()


def _same_bytes(a, b):
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _platform(x):
    return next(iter(x.devices())).platform


@pytest.fixture(scope="module")
def device():
    d = jax.devices()[0]
    assert d.platform != "cpu"
    return d


# -- the codec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("placement", ["device", "host", "preserve"])
def test_every_dtype_round_trips_bit_exact(device, dtype, placement):
    why = dtype_missing(dtype)
    if why:
        pytest.skip(why)
    a = _bits(dtype, (8, 16))
    x = jax.device_put(a, device)
    y = jt.loads(*jt.dumps(x), placement=placement)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _same_bytes(y, a)
    if placement == "host":
        assert isinstance(y, np.ndarray)
    else:
        assert _platform(y) == device.platform


def test_weak_types_and_prng_keys(device):
    w = jax.device_put(jnp.asarray(2.5), device)
    assert w.weak_type
    w2 = jt.loads(*jt.dumps(w))
    assert w2.weak_type and float(w2) == 2.5 and _platform(w2) == device.platform
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        k = jax.device_put(jax.random.split(jax.random.key(7, impl=impl), 4), device)
        k2 = jt.loads(*jt.dumps(k))
        assert _platform(k2) == device.platform
        assert _same_bytes(jax.random.key_data(k2), jax.random.key_data(k))
        # the same key draws the same numbers on the same device
        assert _same_bytes(jax.random.normal(k2[1], (5,)), jax.random.normal(k[1], (5,)))
    raw = jax.device_put(jax.random.PRNGKey(3), device)
    assert _same_bytes(jt.loads(*jt.dumps(raw)), raw)


def test_shardings_and_memory_kinds(device):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    a = _bits("float32", (64, 32))
    mesh = Mesh(np.array([device]), ("d",))
    shardings = [SingleDeviceSharding(device), NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())]
    kinds = {str(getattr(m, "kind", m)) for m in device.addressable_memories()} if hasattr(device, "addressable_memories") else set()
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            shardings.append(NamedSharding(mesh, PartitionSpec(), memory_kind=kind))
    for s in shardings:
        x = jax.device_put(a, s)
        y = jt.loads(*jt.dumps(x), placement="preserve")
        assert _same_bytes(y, a)
        assert y.sharding == x.sharding, (x.sharding, y.sharding)
        assert jt.loads(*jt.dumps(x)).sharding.memory_kind in (None, device.default_memory().kind)


def test_large_arrays_cross_in_pieces_bit_exact(device):
    """Shared memory (the Pool's arguments, queues) takes a large array in pieces straight from
    the device (Note [device to host in chunks]), reshaped to rows of lanes on the chip as
    unsigned integers (random bits: NaN payloads and subnormals must survive): rows not a
    multiple of a piece, 1-row arrays, 3-D and 4-D arrays, a 64-wide minor dimension, flat
    arrays, uint8, int8; and the types that travel whole instead (bf16, float16, float8, bool,
    complex64). Decoded back onto the chip, the same arrays go in pieces the other way (Note
    [host to device in pieces])."""
    from jaxtransport import _codec

    cases = [
        ((4099, 4096), "float32"),
        ((1, 40 * MiB // 4), "float32"),
        ((3, 2051, 4096), "bfloat16"),
        ((200_003, 64), "float32"),
        ((9 * MiB // 4 + 5,), "float32"),
        ((129, 16, 84, 84), "uint8"),
        ((5000, 3000), "int8"),
        ((4097, 2048), "float16"),
        ((10 * MiB + 7,), "float8_e4m3fn"),
        ((3001, 4096), "bool"),
        ((1100, 1024), "complex64"),
    ]
    for shape, dtype in cases:
        a = _bits(dtype, shape, seed=1)
        x = jax.device_put(a, device)
        dst = np.empty(_codec.host_nbytes(x), np.uint8)
        _codec.copy_into(x, dst)
        assert dst.tobytes() == a.tobytes()
        y = jt.loads(*jt.dumps(x))  # onto the chip in pieces (Note [host to device in pieces])
        assert y.dtype == a.dtype and y.shape == a.shape and y.devices() == {device}
        assert np.asarray(y).tobytes() == a.tobytes(), (shape, dtype)
        del x, y
    w = _codec._compat.with_weak_type(jax.device_put(_bits("float32", (3 * MiB,), seed=2), device))
    y = jt.loads(*jt.dumps(w))
    assert y.weak_type and y._committed == jax.device_put(np.asarray(w))._committed
    assert np.asarray(y).tobytes() == np.asarray(w).tobytes()


def test_large_arrays_are_pickled_in_pieces_bit_exact(device):
    """``jt.dumps`` and ``jaxtransport.ray``'s serializer take a large array in pieces fetched at
    once, one out-of-band buffer each (Note [pickled in pieces]); the PIECEWISE types only (the
    others whole); each comes back bit for bit onto the chip (from the pieces as they are), onto
    the host (joined there) and with placement "preserve" (its one device)."""
    from jaxtransport import _codec

    cases = [
        ((64 * MiB // 4,), "float32"),
        ((200_003, 64), "float32"),
        ((1, 9 * MiB // 4 + 5), "float32"),
        ((129, 16, 84, 84), "uint8"),
        ((5000, 3000), "int8"),
        ((3000, 1500), "int16"),
        ((4097, 2048), "float16"),
        ((3, 2051, 4096), "bfloat16"),
    ]
    for shape, dtype in cases:
        a = _bits(dtype, shape, seed=3)
        x = jax.device_put(a, device)
        data, buffers = jt.dumps(x)
        assert (len(buffers) > 1) == (dtype in _codec.PIECEWISE), (shape, dtype, len(buffers))
        for placement in ("device", "host", "preserve"):
            y = jt.loads(data, buffers, placement=placement)
            assert y.dtype == a.dtype and y.shape == a.shape
            assert np.asarray(y).tobytes() == a.tobytes(), (shape, dtype, placement)
            if placement != "host":
                assert y.devices() == {device}
            del y
        del x, data, buffers
    w = _codec._compat.with_weak_type(jax.device_put(_bits("float32", (3 * MiB,), seed=4), device))
    y = jt.loads(*jt.dumps(w))
    assert y.weak_type and np.asarray(y).tobytes() == np.asarray(w).tobytes()
    k = jax.device_put(jax.random.split(jax.random.key(5), 2 * MiB), device)  # 16 MiB of key data
    k2 = jt.loads(*jt.dumps(k))
    assert k2.devices() == {device} and _same_bytes(jax.random.key_data(k2), jax.random.key_data(k))
    try:
        from jaxtransport import ray as jray
    except ImportError:
        return
    import pickle

    a = _bits("float32", (4099, 4096), seed=6)
    payload = jray._serialize(jax.device_put(a, device))
    oob: list = []
    msg = pickle.dumps(payload, protocol=5, buffer_callback=lambda pb: oob.append(pb) or False)
    assert len(oob) > 1
    y = jray._deserialize(pickle.loads(msg, buffers=oob))
    assert y.devices() == {device} and np.asarray(y).tobytes() == a.tobytes()


def test_tracers_fail_fast(device, pool):
    x = jax.device_put(jnp.ones(3), device)
    with pytest.raises(jt.TracerTransportError):
        jax.jit(lambda v: jt.dumps(v))(x)
    with pytest.raises(jt.TracerTransportError):
        jax.jit(lambda v: pool.apply(np.sum, (v,)))(x)


# -- processes: the defaults on an accelerator host


def _where(x=None):
    import jax as _jax

    out = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"), "platform": _jax.devices()[0].platform}
    if x is not None:
        out["sha"] = _sha(x)
        out["platform_of_x"] = next(iter(x.devices())).platform
    return out


def _produce(n, seed):
    import jax as _jax

    return _jax.random.uniform(_jax.random.key(seed), (n,))


@pytest.fixture
def pool():
    with jt.Pool(2) as p:
        yield p


def test_pool_workers_run_on_the_cpu_and_say_so(device, caplog, monkeypatch):
    from jaxtransport import _devices

    monkeypatch.setattr(_devices, "_noticed", set())  # (said once per process: maybe already)
    with caplog.at_level(logging.WARNING, logger="jaxtransport"):
        with jt.Pool(1) as p:
            view = p.apply(_where)
    assert view == {"JAX_PLATFORMS": "cpu", "platform": "cpu"}
    said = [r.getMessage() for r in caplog.records if r.name == "jaxtransport"]
    assert len(said) == 1 and "JAX_PLATFORMS=cpu" in said[0] and "devices_per_worker" in said[0], said


def test_pool_arguments_and_results_both_ways(device, pool):
    for n in (1000, 64 * MiB // 4 + 3):  # inline, and shared memory in pieces
        a = _bits("float32", (n,), seed=n)
        x = jax.device_put(a, device)
        views = pool.map(_where, [x, x])
        assert all(v["sha"] == _sha(a) and v["platform_of_x"] == "cpu" for v in views)
    out = pool.starmap(_produce, [(16 * MiB, 1), (10, 2)])
    with jax.default_device(jax.devices("cpu")[0]):  # made where the workers make it
        ref = [np.asarray(_produce(n, s)) for n, s in [(16 * MiB, 1), (10, 2)]]
    for got, want in zip(out, ref):
        assert _platform(got) == device.platform and _same_bytes(got, want)


def _bits_array(dtype, n, seed):
    import jax.numpy as _jnp

    return _jnp.asarray(_bits(dtype, (n,), seed))


def test_large_results_go_on_the_device_while_the_worker_copies_them(device, pool, monkeypatch):
    # Note [a result put while it lands] (_codec): every type that goes to a device in pieces,
    # random bits (NaN payloads, subnormals), bit-exact; the manager put pieces early.
    from jaxtransport import _codec

    early = []
    put_landed = _codec.put_landed

    def counted(pieces, cache):
        early.append(len(pieces))
        put_landed(pieces, cache)

    monkeypatch.setattr(_codec, "put_landed", counted)
    for k, dtype in enumerate(sorted(_codec.PIECEWISE)):
        n = (_codec.LANDING_MIN + 5 * MiB) // _np_dtype(dtype).itemsize + k
        before = len(early)
        got = pool.apply(_bits_array, (dtype, n, k))
        assert _platform(got) == device.platform and _same_bytes(got, _bits(dtype, (n,), k)), dtype
        assert len(early) > before, f"{dtype}: nothing was put while the worker copied it"
        del got


def test_executor_both_ways(device):
    with jt.Executor(2) as ex:
        x = jax.device_put(_bits("bfloat16", (2048, 4096), seed=3), device)
        assert ex.submit(_where, x).result(120)["platform_of_x"] == "cpu"
        y = ex.submit(_produce, 1 << 20, 5).result(120)
        assert _platform(y) == device.platform


def _echo_child(qin, qout):
    x = qin.get(timeout=120)
    qout.put((_where(x), x))


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_queues_both_ways(device, start_method):
    ctx = jmp.get_context(start_method)
    qin, qout = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo_child, args=(qin, qout))
    p.start()
    try:
        a = _bits("float32", (48 * MiB // 4,), seed=4)
        qin.put(jax.device_put(a, device))
        view, back = qout.get(timeout=180)
    finally:
        p.join(60)
    assert p.exitcode == 0
    assert view["JAX_PLATFORMS"] == "cpu" and view["platform_of_x"] == "cpu"
    assert _platform(back) == device.platform and _same_bytes(back, a)


def test_joblib_backend_and_memory(device, tmp_path):
    joblib = pytest.importorskip("joblib")
    import jaxtransport.joblib as jtj

    jtj.register()
    x = jax.device_put(_bits("float32", (1 << 20,), seed=5), device)
    try:
        with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
            views = joblib.Parallel()(joblib.delayed(_where)(x) for _ in range(2))
            made = joblib.Parallel()(joblib.delayed(_produce)(1 << 18, s) for s in range(2))
    finally:
        jtj.shutdown()  # the backend keeps its warm pool between calls
    assert all(v["platform_of_x"] == "cpu" for v in views)
    assert all(_platform(m) == device.platform for m in made)
    mem = jtj.Memory(tmp_path, verbose=0)
    calls = []

    def double(v):
        calls.append(1)
        return v * 2

    cached = mem.cache(double)
    first, again = cached(x), cached(x)
    assert len(calls) == 1 and _same_bytes(first, again) and _platform(again) == device.platform


def test_a_worker_sent_to_the_held_device_says_why(device):
    """worker_env wins: a worker told to use the accelerator the parent holds fails with the
    cause and the fix, and the pool cleans up."""
    with jt.Pool(1, worker_env={"JAX_PLATFORMS": device.platform}) as p:
        with pytest.raises(jt.DeviceUnavailableError, match="another process holds it"):
            p.apply(_where)


def test_devices_per_worker_never_hands_out_the_parents_chips(device):
    from jaxtransport import _devices

    kinds = [k for k in _devices.KINDS if device.platform in k.platforms and k.exclusive]
    if not kinds:
        pytest.skip(f"{device.platform} devices can be shared between processes")
    held = len(kinds[0].host_ids(os.environ))
    with pytest.raises(ValueError, match="one process only"):
        jt.Pool(1, devices_per_worker=held + kinds[0].host_count())


# -- the demo end to end


def test_the_demo_learns_on_the_device_with_actors_on_the_cpu(device):
    from jaxtransport import rollouts

    cfg = rollouts.Config(workers=2, envs=8, steps=32, frame_size=32, param_mb=2, iterations=3, seed=0)
    runs = [rollouts.train(cfg, t, out=io.StringIO(), err=io.StringIO()) for t in ("jaxtransport", "stock")]
    assert runs[0].params_sha256 == runs[1].params_sha256  # identical learning, both transports
    assert runs[0].returns == runs[1].returns


# -- jaxtransport.data


def _image_of(i, rng):
    """A 3 MiB uint8 image and a float32 vector from the index alone (the workers run on the CPU)."""
    r = np.random.default_rng(int(i))
    return {"image": r.integers(0, 256, (1024, 1024, 3), dtype=np.uint8), "x": r.random(5).astype(np.float32)}


def test_loader_batches_land_on_the_device_in_pieces_and_on_a_one_device_mesh(device):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxtransport.data import Loader

    want = [_image_of(i, None) for i in range(16)]
    mesh = Mesh(np.array([device]), ("data",))
    for sharding in (None, mesh):
        with Loader(range(16), _image_of, batch_size=8, workers=2, sharding=sharding) as loader:
            batches = list(loader)  # 24 MiB of uint8 each: pieces, joined on the chip
        assert len(batches) == 2
        for k, b in enumerate(batches):
            assert _platform(b["image"]) == device.platform and _platform(b["x"]) == device.platform
            if sharding is not None:
                assert b["image"].sharding == NamedSharding(mesh, PartitionSpec("data"))
            expected = np.stack([w["image"] for w in want[8 * k : 8 * k + 8]])
            assert _same_bytes(b["image"], expected)
            assert _same_bytes(b["x"], np.stack([w["x"] for w in want[8 * k : 8 * k + 8]]))
