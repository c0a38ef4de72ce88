"""Who holds which device (jaxtransport/_devices): the plans, on hosts faked for the test (a fake
/dev with TPU chips, a fake NVIDIA driver), the variables each worker starts with through the
public API, the error a worker that cannot open its device raises, and the device-to-host copy
in pieces (Note [device to host in chunks] in _codec), exercised on the CPU.
What runs on a real accelerator is tests/test_on_device.py (``make test-device``)."""

from __future__ import annotations

import itertools
import math
import logging
import os
import pickle
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
import jaxtransport.multiprocessing as jmp
from jaxtransport import _codec, _copies, _devices, _procenv

from .conftest import SlowPieces


_hosts = itertools.count()


def _tpu_host(tmp_path, chips: int, accel: bool = True) -> _devices.Tpu:
    """A Tpu kind that reads a fake /dev with ``chips`` chips (as /dev/accelN, or as /dev/vfio/N
    the way a TPU VM under gVisor shows them)."""
    root = tmp_path / f"dev{next(_hosts)}"
    (root / "vfio").mkdir(parents=True)
    for i in range(chips):
        (root / (f"accel{i}" if accel else f"vfio/{i}")).write_text("")
    (root / "vfio" / "vfio").write_text("")  # the control node: not a chip

    class FakeTpu(_devices.Tpu):
        dev_root = str(root)

    return FakeTpu()


@pytest.fixture
def parent_on_tpu(monkeypatch):
    """This process as one whose JAX started the TPU backend (what _compat reads)."""
    monkeypatch.setattr(_devices, "_initialized_platforms", lambda: {"tpu", "cpu"})


@pytest.mark.parametrize("accel", [True, False], ids=["accel", "vfio"])
def test_chips_are_counted_as_ray_counts_them(tmp_path, accel):
    assert _tpu_host(tmp_path, 4, accel).host_count() == 4
    assert _tpu_host(tmp_path / "none", 0).host_count() == 0


def test_a_tpu_host_puts_workers_on_the_cpu_by_default(tmp_path, parent_on_tpu, caplog):
    kind = _tpu_host(tmp_path, 1, accel=False)
    plan = _devices.plan(4, environ={}, kinds=(kind,))
    assert [plan.env(i)["JAX_PLATFORMS"] for i in range(4)] == ["cpu"] * 4
    assert "TPU_VISIBLE_CHIPS" not in plan.env(0)
    with caplog.at_level(logging.WARNING, logger="jaxtransport"):
        plan.announce()
        plan.announce()
    notices = [r.getMessage() for r in caplog.records if "devices_per_worker" in r.getMessage()]
    assert len(notices) <= 1  # once per process (an earlier test may have said it already)


@pytest.mark.parametrize("platforms", [None, "tpu", "tpu,cpu", ""])
def test_a_parent_that_may_take_the_tpu_keeps_workers_off_it(tmp_path, monkeypatch, platforms):
    """Before the parent's JAX starts a backend, it may still take the chip (JAX picks the
    accelerator by default): the workers stay off it all the same."""
    monkeypatch.setattr(_devices, "_initialized_platforms", lambda: None)
    env = {} if platforms is None else {"JAX_PLATFORMS": platforms}
    plan = _devices.plan(2, environ=env, kinds=(_tpu_host(tmp_path, 1),))
    if "jax" in os.sys.modules and jax.config.jax_platforms and not platforms:
        pytest.skip("this process's JAX config names its platforms")
    assert plan.env(1)["JAX_PLATFORMS"] == "cpu"
    assert plan.notice and "devices_per_worker" in plan.notice


def test_a_parent_on_the_cpu_passes_that_on_without_a_notice(tmp_path, monkeypatch):
    monkeypatch.setattr(_devices, "_initialized_platforms", lambda: {"cpu"})
    plan = _devices.plan(2, environ={"JAX_PLATFORMS": "cpu"}, kinds=(_tpu_host(tmp_path, 4),))
    assert plan.env(0)["JAX_PLATFORMS"] == "cpu" and plan.notice is None


def test_worker_env_wins(tmp_path, parent_on_tpu):
    plan = _devices.plan(2, overrides={"JAX_PLATFORMS": "tpu"}, environ={}, kinds=(_tpu_host(tmp_path, 1),))
    assert plan.notice is None
    env = _procenv.worker_env(0, devices=plan, overrides={"JAX_PLATFORMS": "tpu"})
    assert env["JAX_PLATFORMS"] == "tpu"


@pytest.mark.parametrize(
    ("chips", "parent_visible", "per", "workers", "expect"),
    [
        # an 8-chip host (v5e-8), the parent restricted to chip 0: workers get chips of their own
        (8, "0", 1, 3, [("1", "1,1,1"), ("2", "1,1,1"), ("3", "1,1,1")]),
        (8, "0,1", 2, 3, [("2,3", "1,2,1"), ("4,5", "1,2,1"), ("6,7", "1,2,1")]),
        (8, "0", 4, 1, [("1,2,3,4", "2,2,1")]),
        # a 4-chip host (v4-8), the parent on the CPU: every chip is free
        (4, None, 1, 4, [("0", "1,1,1"), ("1", "1,1,1"), ("2", "1,1,1"), ("3", "1,1,1")]),
        (4, None, 4, 1, [("0,1,2,3", None)]),  # all the host's chips: libtpu's own bounds
    ],
)
def test_devices_per_worker_hands_out_chips_the_parent_does_not_hold(
    tmp_path, monkeypatch, chips, parent_visible, per, workers, expect
):
    """The environment Ray's TPU manager sets per actor: TPU_VISIBLE_CHIPS with
    TPU_CHIPS_PER_HOST_BOUNDS and TPU_HOST_BOUNDS (not run on a multi-chip host here)."""
    if parent_visible is None:
        environ = {"JAX_PLATFORMS": "cpu"}
        monkeypatch.setattr(_devices, "_initialized_platforms", lambda: {"cpu"})
    else:
        environ = {"TPU_VISIBLE_CHIPS": parent_visible}
        monkeypatch.setattr(_devices, "_initialized_platforms", lambda: {"tpu", "cpu"})
    plan = _devices.plan(workers, devices_per_worker=per, environ=environ, kinds=(_tpu_host(tmp_path, chips),))
    got = []
    for i in range(workers):
        env = _procenv.worker_env(i, devices=plan, overrides=None)
        got.append((env["TPU_VISIBLE_CHIPS"], env["TPU_CHIPS_PER_HOST_BOUNDS"]))
        assert env["JAX_PLATFORMS"] is None  # JAX picks the chips it is given
        assert env["TPU_HOST_BOUNDS"] == (None if per == chips else "1,1,1")
    assert got == expect
    held = set((parent_visible or "").split(",")) - {""}
    handed = [set(v.split(",")) for v, _ in got]
    assert all(not (h & held) for h in handed)
    assert sum(len(h) for h in handed) == len(set().union(*handed))  # disjoint


def test_devices_per_worker_refuses_chips_the_parent_holds(tmp_path, parent_on_tpu):
    with pytest.raises(ValueError, match=r"holds 1 of them.*one process only.*Fix"):
        _devices.plan(2, devices_per_worker=1, environ={}, kinds=(_tpu_host(tmp_path, 1),))
    with pytest.raises(ValueError, match="1, 2 or 4 chips"):
        _devices.plan(1, devices_per_worker=3, environ={"TPU_VISIBLE_CHIPS": "0"}, kinds=(_tpu_host(tmp_path, 8),))
    with pytest.raises(ValueError, match="devices_per_worker must be an int >= 1"):
        _devices.plan(1, devices_per_worker=0, environ={}, kinds=(_tpu_host(tmp_path, 8),))


def test_pool_and_executor_refuse_at_construction(tmp_path, monkeypatch, parent_on_tpu):
    monkeypatch.setattr(_devices, "KINDS", (_tpu_host(tmp_path, 1),))
    monkeypatch.setattr(_devices.plan, "__kwdefaults__", {**_devices.plan.__kwdefaults__, "kinds": _devices.KINDS})
    with pytest.raises(ValueError, match="devices_per_worker=1"):
        jt.Pool(1, devices_per_worker=1)
    with pytest.raises(ValueError, match="devices_per_worker=1"):
        jt.Executor(1, devices_per_worker=1)


def _env_of(name):
    return os.environ.get(name)


def _worker_view(x=None):
    import jax as _jax

    out = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"), "platform": _jax.devices()[0].platform}
    if x is not None:
        out["sum"] = float(x.sum())
    return out


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_pool_workers_on_a_tpu_host_run_on_the_cpu(tmp_path, monkeypatch, parent_on_tpu, start_method, caplog):
    """Through the public API: the Pool asks the device plan; its workers start with
    JAX_PLATFORMS=cpu and say so once; worker_env still wins."""
    monkeypatch.setattr(_devices.plan, "__kwdefaults__", {**_devices.plan.__kwdefaults__, "kinds": (_tpu_host(tmp_path, 1),)})
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    with caplog.at_level(logging.WARNING, logger="jaxtransport"):
        with jt.Pool(2, start_method=start_method) as p:
            views = p.map(_worker_view, [jnp.arange(4.0)] * 2)
    assert all(v == {"JAX_PLATFORMS": "cpu", "platform": "cpu", "sum": 6.0} for v in views)
    with jt.Pool(1, start_method=start_method, worker_env={"JAX_PLATFORMS": "cpu,tpu"}) as p:
        assert p.apply(_env_of, ("JAX_PLATFORMS",)) == "cpu,tpu"


def _child_view(q):
    q.put(os.environ.get("JAX_PLATFORMS"))


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_multiprocessing_children_on_a_tpu_host_run_on_the_cpu(tmp_path, monkeypatch, parent_on_tpu, start_method):
    monkeypatch.setattr(_devices.plan, "__kwdefaults__", {**_devices.plan.__kwdefaults__, "kinds": (_tpu_host(tmp_path, 1),)})
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    ctx = jmp.get_context(start_method)
    q = ctx.Queue()
    p = ctx.Process(target=_child_view, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) == "cpu"
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert os.environ.get("JAX_PLATFORMS") is None  # the parent's own environment is untouched


_LOCK_TEXT = (
    "Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with pid 1442. "
    "Not attempting to load libtpu.so in this process. (set JAX_PLATFORMS='' to automatically choose "
    "an available backend)"
)


def test_a_busy_device_is_explained():
    e = RuntimeError(_LOCK_TEXT)
    out = _devices.explain(e)
    assert isinstance(out, jt.DeviceUnavailableError) and out.__cause__ is e
    assert "another process holds it" in str(out) and "devices_per_worker" in str(out) and "worker_env" in str(out)
    assert "already in use by process with pid 1442" in str(out)
    assert pickle.loads(pickle.dumps(out)).args == out.args
    other = RuntimeError("something else")
    assert _devices.explain(other) is other


def test_a_decode_that_cannot_open_the_device_says_why(monkeypatch):
    """jt.loads (any process's decode) explains a chip held by another process; every other
    error passes through as it was."""
    from jaxtransport import _compat

    data, bufs = jt.dumps(jnp.arange(8.0))

    def busy(*args, **kwargs):
        raise RuntimeError(_LOCK_TEXT)

    monkeypatch.setattr(_compat, "put_on_default_device", busy)
    with pytest.raises(jt.DeviceUnavailableError, match="another process holds it") as info:
        jt.loads(data, bufs)
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.undo()
    with pytest.raises(jt.CorruptTransferError):
        jt.loads(data, [b"\0" * 3])


def _raise_busy():
    raise RuntimeError(_LOCK_TEXT)


def test_a_worker_that_cannot_open_its_device_says_why():
    with jt.Pool(1) as p:
        with pytest.raises(jt.DeviceUnavailableError, match="another process holds it"):
            p.apply(_raise_busy)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("lanes", [256, 8, 6])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int16"])
@pytest.mark.parametrize("shape", [(1000, 33), (7, 3, 5), (1,), (64, 64), (3000,), (500, 4)])
def test_device_to_host_in_pieces_is_bit_exact(monkeypatch, dtype, shape, lanes, threads):
    """The piecewise copy (forced here on CPU arrays, with tiny pieces): every row once, the last
    piece overlapping its neighbour, pieces reshaped to rows of ``lanes`` elements where their
    size allows, any shape and dtype; copied on the caller's thread, or by copy threads with a
    window of 4 pieces in flight (Note [copies into a slot in threads])."""
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "CHUNK_BYTES", 96)
    monkeypatch.setattr(_codec, "LANES", lanes)
    monkeypatch.setattr(_copies, "COPY_THREADS", threads)
    monkeypatch.setattr(_codec, "WINDOW_BYTES", 0)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 255, shape).astype(dtype))
    dst = np.zeros(_codec.host_nbytes(x), np.uint8)
    _codec.copy_into(x, dst)
    assert dst.tobytes() == np.asarray(x).tobytes()


def test_a_failed_piece_raises_only_after_every_copy_into_the_slot_ended(monkeypatch):
    """A piece whose copy fails (here the third) raises in the caller, and only once no copy
    thread can still write into the destination: its slot may go to another message at once
    (Note [copies into a slot in threads])."""
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "CHUNK_BYTES", 4000)
    monkeypatch.setattr(_copies, "COPY_THREADS", 3)
    monkeypatch.setattr(_codec, "WINDOW_BYTES", 1 << 20)
    slow = SlowPieces(np.asarray, fail_at=3)
    x = jnp.arange(40_000, dtype=jnp.float32)
    dst = np.zeros(_codec.host_nbytes(x), np.uint8)
    monkeypatch.setattr(_codec.np, "asarray", slow)
    with pytest.raises(RuntimeError, match="piece 3 failed"):
        _codec.copy_into(x, dst)
    assert slow.running == 0  # nothing still copying when the error reached the caller
    assert len(slow.ended) < 40_000 * 4 // 4000 + 1  # the pieces not started were cancelled


@pytest.mark.parametrize("nbytes", [5 << 20, 32 << 20, (40 << 20) + 4093])
def test_a_large_host_copy_in_ranges_side_by_side_is_bit_exact(monkeypatch, nbytes):
    """A host copy of PARALLEL_MIN bytes and up goes in ranges copied by the copy threads and
    the caller (Note [copies into a slot in threads]), any length; a smaller one in one piece."""
    monkeypatch.setattr(_copies, "COPY_THREADS", 3)
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    ranges = []
    real = np.copyto

    def counted(d, s_, *args, **kwargs):
        ranges.append(d.nbytes)
        return real(d, s_, *args, **kwargs)

    monkeypatch.setattr(_copies.np, "copyto", counted)
    _copies.copy_bytes(src, dst)
    monkeypatch.undo()
    assert np.array_equal(src, dst)
    assert sum(ranges) == nbytes
    assert len(ranges) == (1 if nbytes < _copies.PARALLEL_MIN else 4), ranges


def test_a_host_copy_that_fails_raises_once_no_range_is_still_copying(monkeypatch):
    monkeypatch.setattr(_copies, "COPY_THREADS", 3)
    running, lock = [0, 0], threading.Lock()
    real = np.copyto

    def slow(d, s_, *args, **kwargs):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.05)
            if d.nbytes and s_.ctypes.data == src.ctypes.data:
                raise MemoryError("the first range failed")
            return real(d, s_, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    src = np.ones(64 << 20, np.uint8)
    dst = np.zeros_like(src)
    monkeypatch.setattr(_copies.np, "copyto", slow)
    with pytest.raises(MemoryError, match="first range"):
        _copies.copy_bytes(src, dst)
    assert running[0] == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "bool", "complex64", "int4"])
def test_types_the_chip_may_change_travel_whole(monkeypatch, dtype):
    """A float16 piece came back from a TPU with its NaNs made canonical: only PIECEWISE types are
    cut (Note [device to host in chunks]); the others travel as one np.asarray."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"{dtype} was cut into pieces")

    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "CHUNK_BYTES", 96)
    monkeypatch.setattr(_codec, "_copy_in_pieces", refuse)
    x = jnp.zeros((4000, 8), dtype)
    dst = np.zeros(_codec.host_nbytes(x), np.uint8)
    _codec.copy_into(x, dst)
    assert dst.tobytes() == np.asarray(x).tobytes()


@pytest.mark.parametrize(
    ("rows", "row_elems", "nbytes", "want"),
    [
        (1 << 20, 64, 256 << 20, 32768),  # 8 MiB of a (1M, 64) float32: whole rows of 256 lanes
        (8 << 20, 1, 32 << 20, 2 << 20),  # a flat float32 of 32 MiB: quarters of 8 MiB
        (1_000_000, 3, 12_000_000, 249_856),  # a quarter is 250,000 rows: down to a multiple of 256
        (1000, 1 << 20, 4000 << 20, 2),  # rows of 4 MiB: two per piece
        (3, 3 << 20, 36 << 20, 0),  # rows bigger than a piece: none (a single transfer)
        (1000, 3, 12_000, 87381),  # tiny: a MIN_PIECE piece holds more than the array (a single transfer)
    ],
)
def test_pieces_are_whole_rows_of_lanes_where_they_can_be(rows, row_elems, nbytes, want):
    per = _codec._rows_per_piece(rows, nbytes, row_elems)
    assert per == want
    if 1 <= per < rows:
        assert (per * row_elems) % _codec.LANES == 0 or per * row_elems < _codec.LANES


@pytest.mark.parametrize("dtype", ["float32", "int8", "uint16", "int32"])
@pytest.mark.parametrize("shape", [(1000, 33), (3000,), (64, 64), (5, 4, 3), (1, 7, 300)])
@pytest.mark.parametrize("weak", [False, True])
def test_decode_puts_a_large_array_in_pieces_bit_exact(monkeypatch, dtype, shape, weak):
    """Onto an accelerator a large array goes in pieces joined on the device (Note [host to
    device in pieces]; forced here on the CPU): the same bytes (random bits: NaN payloads), shape
    and type, weak where the sender's was, uncommitted on the default device as
    ``jax.device_put`` leaves it; through ``jt.loads`` and through a decoder used twice."""
    joined = []
    joiner = _codec._joiner

    def counted(shape, dtype):
        joined.append((shape, dtype))
        return joiner(shape, dtype)

    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    monkeypatch.setattr(_codec, "_joiner", counted)
    a = np.random.default_rng(2).integers(0, 256, (math.prod(shape) * np.dtype(dtype).itemsize,), np.uint8)
    a = a.view(dtype).reshape(shape)
    x = jnp.asarray(a)
    if weak:
        x = _codec._compat.with_weak_type(x)
    y = jt.loads(*jt.dumps(x))
    assert joined and joined[0] == (shape, np.dtype(dtype))
    assert isinstance(y, jax.Array) and y.dtype == a.dtype and y.shape == a.shape
    assert np.asarray(y).tobytes() == a.tobytes()
    assert y.weak_type == weak and y._committed is False
    assert y.sharding == jax.device_put(a).sharding
    meta, buffers = _codec.encode(x)
    again = _codec.decoder(meta, buffers)
    z1, z2 = again(), again()
    assert z1 is not z2 and np.asarray(z1).tobytes() == np.asarray(z2).tobytes() == a.tobytes()
    assert z2.weak_type == weak


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "bool", "complex64", "float8_e4m3fn"])
def test_types_the_chip_may_change_go_to_it_whole(monkeypatch, dtype):
    """Only PIECEWISE types go to an accelerator in pieces (Note [host to device in pieces])."""
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    monkeypatch.setattr(_codec, "_joiner", lambda *a: pytest.fail(f"{dtype} went in pieces"))
    a = np.zeros((300, 8), dtype)
    assert np.asarray(jt.loads(*jt.dumps(jnp.asarray(a)))).tobytes() == a.tobytes()


def test_on_the_cpu_a_large_array_is_put_whole():
    """On the CPU ``device_put`` aliases an aligned buffer: nothing goes in pieces there."""
    assert _codec._piece_count(np.zeros(4 << 20, np.float32)) == 0


def test_pieces_that_do_not_fit_on_the_device_go_whole(monkeypatch):
    """Out of device memory for the pieces or their join, the array goes whole (Note [host to
    device in pieces]); any other error is raised; an array over H2D_MAX never goes in pieces."""

    def exhausted(shape, dtype):
        def join(*pieces):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 42 bytes.")

        return join

    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    monkeypatch.setattr(_codec, "_joiner", exhausted)
    a = np.arange(3000, dtype=np.float32)
    y = jt.loads(*jt.dumps(jnp.asarray(a)))
    assert isinstance(y, jax.Array) and np.asarray(y).tobytes() == a.tobytes()

    def broken(shape, dtype):
        def join(*pieces):
            raise RuntimeError("INTERNAL: something else")

        return join

    monkeypatch.setattr(_codec, "_joiner", broken)
    with pytest.raises(RuntimeError, match="something else"):
        jt.loads(*jt.dumps(jnp.asarray(a)))
    monkeypatch.setattr(_codec, "H2D_MAX", a.nbytes - 1)
    assert _codec._piece_count(a) == 0
