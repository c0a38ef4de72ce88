"""A large array on an accelerator is pickled in pieces (Note [pickled in pieces] in
jaxtransport/_codec.py): ``jt.dumps`` and ``jaxtransport.ray``'s serializer send one
out-of-band buffer per piece, fetched at once with no joining copy, described as shards along
one axis (array format 1, unchanged); the receiver puts pieces bound for an accelerator as they
are and joins them on the device, and joins them on the host (one copy) otherwise.

Forced here on CPU arrays with tiny pieces (``_on_host`` says no, CHUNKED_MIN 0), and onto an
"accelerator" by ``_default_platform``; tests/test_on_device.py runs the real thing on a chip.
"""

from __future__ import annotations

import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _codec, _compat, _copies

from .conftest import SlowPieces, dtype_params
from .test_decode_validation import craft, loads_peak, meta

# Every kind of dtype: the PIECEWISE ones go in pieces, the others whole (the chip changed
# float16 / bfloat16 pieces' bits: Note [device to host in chunks]).
DTYPES = ["float32", "int32", "uint32", "int16", "uint16", "int8", "uint8", "float16", "bfloat16", "bool",
          "complex64", "float8_e4m3fn", "int4"]


def _bits(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    dt = np.dtype(jnp.dtype(dtype))
    if dt.name in ("bool", "int4"):
        a = np.zeros(shape, dt)
        a.reshape(-1)[::3] = np.ones((), dt)
        return a
    raw = np.random.default_rng(seed).integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)  # random bits: NaN payloads, subnormals


@pytest.fixture
def pieces(monkeypatch):
    """CPU arrays taken as if they were on an accelerator, in pieces of 4 KiB."""
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "MIN_PIECE", 1)
    monkeypatch.setattr(_codec, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(_codec, "_on_host", lambda a: False)
    joins: list = []
    joiner = _codec._joiner

    def counted(shape, dtype):
        joins.append((shape, np.dtype(dtype)))
        return joiner(shape, dtype)

    monkeypatch.setattr(_codec, "_joiner", counted)
    return joins


def _onto_accelerator(monkeypatch):
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", dtype_params(DTYPES))
def test_every_dtype_round_trips_bit_exact(pieces, monkeypatch, dtype, threads):
    """Taken on the caller's thread, or by copy threads (``_take_all``)."""
    monkeypatch.setattr(_copies, "COPY_THREADS", threads)
    a = _bits(dtype, (300, 40))
    x = jnp.asarray(a)
    data, buffers = jt.dumps(x)
    piecewise = dtype in _codec.PIECEWISE
    assert (len(buffers) > 1) == piecewise, len(buffers)
    assert sum(b.nbytes for b in buffers) == a.nbytes
    for placement in ("host", "device", "preserve"):
        y = jt.loads(data, buffers, placement=placement)
        assert isinstance(y, np.ndarray if placement == "host" else jax.Array)
        assert y.dtype == a.dtype and y.shape == a.shape
        assert np.asarray(y).tobytes() == a.tobytes(), placement
    assert not pieces  # on the CPU the pieces are joined on the host
    _onto_accelerator(monkeypatch)
    y = jt.loads(data, buffers)
    assert np.asarray(y).tobytes() == a.tobytes()
    assert y._committed is False and y.sharding == jax.device_put(a).sharding
    assert bool(pieces) == piecewise  # joined on the "device", from the buffers as they came


@pytest.mark.parametrize("shape", [(3000,), (1, 70, 300), (1000, 33), (50, 1, 400), (2, 1, 1), (3, 4000)])
def test_pieces_are_rows_of_the_first_long_axis(pieces, shape):
    """Each piece is a contiguous range of the array's bytes: rows along the first axis longer
    than 1; an array too small to cut, or whose rows are larger than a piece, goes whole."""
    a = _bits("float32", shape, seed=1)
    m, buffers = _codec.encode(jnp.asarray(a))
    axis = _codec._split_axis(shape)
    if a.nbytes <= 4096 or a.nbytes // shape[axis] > 4096:
        assert m.indices == () and len(buffers) == 1
        return
    assert len(m.indices) == len(buffers) > 1
    starts = [idx[axis][0] for idx in m.indices]
    assert starts == sorted(starts)
    for idx, b in zip(m.indices, buffers):
        assert all(idx[d] == (0, n) for d, n in enumerate(shape) if d != axis)
        assert np.asarray(b).tobytes() == a[tuple(slice(s, t) for s, t in idx)].tobytes()
    assert b"".join(np.asarray(b).tobytes() for b in buffers) == a.tobytes()


def test_weak_types_prng_keys_and_the_decoder(pieces, monkeypatch):
    _onto_accelerator(monkeypatch)
    w = _compat.with_weak_type(jnp.asarray(_bits("float32", (5000,), seed=2)))
    data, buffers = jt.dumps(w)
    assert len(buffers) > 1
    y = jt.loads(data, buffers)
    assert y.weak_type and np.asarray(y).tobytes() == np.asarray(w).tobytes()
    keys = jax.random.split(jax.random.key(3), 2000)  # key data: (2000, 2) uint32, in pieces
    data, buffers = jt.dumps(keys)
    assert len(buffers) > 1
    k2 = jt.loads(data, buffers)
    assert jax.dtypes.issubdtype(k2.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(k2), jax.random.key_data(keys))
    m, bufs = _codec.encode(w)
    again = _codec.decoder(m, bufs)
    n = len(pieces)
    z1, z2 = again(), again()
    assert len(pieces) == n + 2 and z1 is not z2 and z2.weak_type
    assert np.asarray(z1).tobytes() == np.asarray(z2).tobytes() == np.asarray(w).tobytes()


def test_preserve_of_one_device_puts_the_pieces_on_it(pieces, monkeypatch):
    a = _bits("int16", (4000, 3), seed=4)
    x = jax.device_put(a, jax.devices()[0])  # committed
    pieces_for = _codec._pieces_for
    monkeypatch.setattr(_codec, "_pieces_for", lambda n, d, platform=None: pieces_for(n, d, "tpu"))
    y = jt.loads(*jt.dumps(x), placement="preserve")
    assert pieces and y.sharding == x.sharding and y._committed
    assert np.asarray(y).tobytes() == a.tobytes()


def test_out_of_device_memory_for_the_pieces_goes_whole(pieces, monkeypatch):
    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 42 bytes.")

    a = _bits("float32", (3000,), seed=5)
    monkeypatch.setattr(_codec, "_splitter", lambda *key: exhausted)  # the sender's cut
    data, buffers = jt.dumps(jnp.asarray(a))
    assert len(buffers) == 1
    monkeypatch.undo()
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(_codec, "_on_host", lambda a: False)
    data, buffers = jt.dumps(jnp.asarray(a))
    assert len(buffers) > 1
    _onto_accelerator(monkeypatch)
    monkeypatch.setattr(_codec, "_joiner", lambda shape, dtype: exhausted)  # the receiver's join
    y = jt.loads(data, buffers)
    assert np.asarray(y).tobytes() == a.tobytes()


def test_the_sender_fetches_every_piece_before_waiting_on_one(pieces, monkeypatch):
    """All pieces' transfers start (``copy_to_host_async``) before the first ``np.asarray``."""
    events = []
    split = _codec._splitter

    class Piece:
        def __init__(self, p):
            self.p = p

        def copy_to_host_async(self):
            events.append("start")

        def __array__(self, dtype=None, copy=None):
            events.append("take")
            return np.asarray(self.p)

    monkeypatch.setattr(_codec, "_splitter", lambda *key: lambda a: [Piece(p) for p in split(*key)(a)])
    a = _bits("uint8", (20000,), seed=6)
    data, buffers = jt.dumps(jnp.asarray(a))
    n = len(buffers)
    assert n > 2 and events == ["start"] * n + ["take"] * n
    assert jt.loads(data, buffers, placement="host").tobytes() == a.tobytes()


def test_ray_serializer_sends_the_pieces_out_of_band(pieces, monkeypatch):
    """``jaxtransport.ray``'s serializer and deserializer, in process (no Ray started): one
    out-of-band buffer per piece through a protocol-5 pickle, as Ray's pickler makes it."""
    jray = pytest.importorskip("jaxtransport.ray")
    a = _bits("float32", (6000,), seed=7)
    payload = jray._serialize(jnp.asarray(a))
    oob: list = []
    data = pickle.dumps(payload, protocol=5, buffer_callback=lambda pb: oob.append(pb) or False)
    assert len(oob) == len(payload) - 1 > 1 and len(data) < 2048
    for placement, accel in (("host", False), ("device", False), ("device", True)):
        if accel:
            _onto_accelerator(monkeypatch)
        monkeypatch.setattr(jray, "_placement", placement)
        y = jray._deserialize(pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in oob]))
        assert np.asarray(y).tobytes() == a.tobytes()
    assert pieces


# -- what a buggy or hostile peer may send: every size and index is checked before anything is
# allocated (Note [validating received metadata]), on the way to the device's pieces too


@pytest.mark.parametrize("placement", ["device", "host", "preserve"])
def test_pieces_declaring_4_gib_reserve_nothing(monkeypatch, placement):
    _onto_accelerator(monkeypatch)
    big = 1 << 30
    data, bufs = craft(meta("float32", (big,), (((0, 1),), ((1, big),))), np.zeros(1, np.float32),
                       np.zeros(1, np.float32))
    err, peak = loads_peak(data, bufs, placement)
    assert isinstance(err, jt.CorruptTransferError), err
    assert "needs 4294967292 bytes but its buffer holds 4" in str(err)
    assert peak < 1 << 20, f"decoding a rejected message traced {peak} bytes"


@pytest.mark.parametrize(
    "indices,sizes,match",
    [
        ((((0, 1), (0, 4)), ((1, 4), (0, 4))), [48, 16], "shard 0 .* needs 16 bytes but its buffer holds 48"),
        ((((0, 1), (0, 4)), ((1, 3), (0, 4)), ((3, 4), (0, 4))), [16, 32], "3 shards are described but 2"),
        ((((0, 1), (0, 4)), ((1, 3), (0, 4))), [16, 32, 16], "2 shards are described but 3"),
        ((((0, 2), (0, 4)), ((1, 3), (0, 4))), [32, 32], "overlap along dimension 0"),
        ((((0, 1), (0, 4)), ((2, 3), (0, 4))), [16, 16], "leave a gap along dimension 0"),
        ((((0, 1), (0, 4)), ((1, 3), (0, 4))), [16, 32], "stop at 3 along dimension 0 of size 4"),
    ],
    ids=["sizes", "fewer-buffers", "more-buffers", "overlap", "gap", "short"],
)
@pytest.mark.parametrize("placement", ["device", "host"])
def test_pieces_whose_sizes_or_counts_lie_are_refused(monkeypatch, indices, sizes, match, placement):
    _onto_accelerator(monkeypatch)
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    monkeypatch.setattr(_codec, "_joiner", lambda *a: pytest.fail("a lying message reached the device"))
    data, bufs = craft(meta("float32", (4, 4), indices), *[np.zeros(n, np.uint8) for n in sizes])
    with pytest.raises(jt.CorruptTransferError, match=match):
        jt.loads(data, bufs, placement=placement)


@pytest.mark.parametrize("accelerator", [False, True])
def test_pieces_in_any_order_and_shards_across_are_placed_exactly(monkeypatch, accelerator):
    """Pieces listed out of order land where their indices say; shards split along another
    axis than the first long one are assembled on the host, never joined as pieces."""
    monkeypatch.setattr(_codec, "CHUNKED_MIN", 0)
    if accelerator:
        _onto_accelerator(monkeypatch)
    full = np.arange(24, dtype=np.int32).reshape(6, 4)
    rows = (((4, 6), (0, 4)), ((0, 1), (0, 4)), ((1, 4), (0, 4)))
    data, bufs = craft(meta("int32", (6, 4), rows), *[full[a:b].copy() for (a, b), _ in rows])
    assert np.array_equal(jt.loads(data, bufs), full)
    cols = (((0, 6), (2, 4)), ((0, 6), (0, 2)))
    data, bufs = craft(meta("int32", (6, 4), cols), *[full[:, a:b].copy() for _, (a, b) in cols])
    assert np.array_equal(jt.loads(data, bufs), full)
    empty = (((0, 2), (0, 0)), ((2, 4), (0, 0)))  # zero-size pieces: nothing to put in pieces
    data, bufs = craft(meta("int32", (4, 0), empty), np.zeros(0, np.uint8), np.zeros(0, np.uint8))
    assert jt.loads(data, bufs).shape == (4, 0)


def test_a_piece_that_fails_to_arrive_raises_once_no_piece_is_still_being_taken(pieces, monkeypatch):
    """The pieces are taken by copy threads; one that fails (here the second) raises in the
    caller of ``jt.dumps``, after every piece under way has been taken or cancelled."""
    monkeypatch.setattr(_copies, "COPY_THREADS", 3)
    slow = SlowPieces(np.asarray, fail_at=2)
    x = jnp.arange(40_000, dtype=jnp.float32)
    monkeypatch.setattr(_codec.np, "asarray", slow)
    with pytest.raises(RuntimeError, match="piece 2 failed"):
        jt.dumps(x)
    assert slow.running == 0
    assert len(slow.ended) < 40_000 * 4 // 4096  # the pieces not started were cancelled
