"""Decoding validates every field of an array's description against its buffers before
allocating anything (Note [validating received metadata] in jaxtransport/_codec.py).

Targeted cases craft the wire form a buggy or hostile peer could send - ``_rebuild_array(meta,
*buffers)``, the rebuild call every jaxtransport pickle holds - and the fuzz
(tests/_fuzz_decode.py, in a fresh interpreter with 8 CPU devices and 64-bit types) mutates
``jt.dumps`` output of every array kind, thousands of times, against an independent oracle.
"""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport._pickling import _rebuild_array

from .conftest import ROOT, run_python

GiB = 1 << 30


class _Wire:
    """Pickles as ``_rebuild_array(meta, *buffers)`` with the buffers out-of-band."""

    def __init__(self, meta, buffers):
        self.meta, self.buffers = meta, buffers

    def __reduce__(self):
        return _rebuild_array, (self.meta, *[b if isinstance(b, (int, str)) else pickle.PickleBuffer(b)
                                             for b in self.buffers])


def craft(meta: tuple, *buffers) -> tuple[bytes, list]:
    out: list = []
    data = pickle.dumps(_Wire(meta, buffers), protocol=5, buffer_callback=lambda pb: out.append(pb.raw()) or False)
    return data, out


def meta(dtype="float32", shape=(4,), indices=(), *, weak=False, impl=None, sharding=None):
    return (1, dtype, shape, weak, impl, sharding, indices)


def loads_peak(data, buffers, placement="device"):
    """``jt.loads`` with tracemalloc on (numpy's allocations are traced): (result or the
    exception, peak traced bytes)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            out = jt.loads(data, buffers, placement=placement)
        except Exception as e:  # noqa: BLE001
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------------------
# the cases


@pytest.mark.parametrize("placement", ["device", "host", "preserve"])
def test_a_tiny_message_declaring_4_gib_reserves_nothing(placement):
    # A sharded shape of 2**29 float64 (4 GiB) with one 8-byte shard: before, decoding reserved
    # the whole shape with np.empty and filled 8 bytes of it.
    data, bufs = craft(meta("float64", (1 << 29,), (((0, 1),),)), np.zeros(1))
    assert len(data) < 200
    err, peak = loads_peak(data, bufs, placement)
    assert isinstance(err, jt.CorruptTransferError), err
    assert "stop at 1 along dimension 0 of size 536870912" in str(err)
    assert peak < 1 << 20, f"decoding a rejected message traced {peak} bytes"


@pytest.mark.parametrize("placement", ["device", "host"])
def test_shards_that_do_not_cover_the_shape_are_rejected(placement):
    # Two of four (2, 2) tiles of a (4, 4) array: the rest would be uninitialised memory.
    tiles = (((0, 2), (0, 2)), ((2, 4), (2, 4)))
    data, bufs = craft(meta("int32", (4, 4), tiles), np.ones(4, np.int32), np.ones(4, np.int32))
    with pytest.raises(jt.CorruptTransferError, match=r"do not tile shape \(4, 4\).*uninitialised"):
        jt.loads(data, bufs, placement=placement)


@pytest.mark.parametrize(
    "indices,buffers,match",
    [
        ((((0, 3),), ((2, 4),)), [12, 8], "overlap along dimension 0 at 2"),
        ((((0, 2),), ((3, 4),)), [8, 4], "leave a gap along dimension 0 at 2"),
        ((((0, 2),), ((2, 5),)), [8, 12], "outside shape \\(4,\\)"),
        ((((0, 2),), ((-1, 2),)), [8, 12], "outside shape"),
        ((((0, 2),), ((0, 2),), ((2, 4),)), [8, 8, 8], "appears twice"),
        ((((0, 2),), ((2, 4),)), [8, 12], "shard 1 \\(\\(\\(2, 4\\),\\)\\) of a float32 array of shape \\(4,\\) needs 8 bytes but its buffer holds 12"),
        ((((0, 2),), ((2, 4),)), [8], "2 shards are described but 1 buffers arrived"),
        ((((0, 2), (0, 1)), ((2, 4),)), [8, 8], "not one \\(start, stop\\) pair per dimension"),
        ((((0.0, 2),), ((2, 4),)), [8, 8], "outside shape"),
        ([((0, 2),), ((2, 4),)], [8, 8], "are not a tuple"),
    ],
    ids=["overlap", "gap", "beyond", "negative", "duplicate", "size", "count", "ndim", "float", "list"],
)
def test_inconsistent_shard_indices_are_rejected(indices, buffers, match):
    data, bufs = craft(meta("float32", (4,), indices), *[np.zeros(n, np.uint8) for n in buffers])
    with pytest.raises(jt.CorruptTransferError, match=match):
        jt.loads(data, bufs)


def test_a_grid_of_shards_is_assembled_exactly():
    # The positive case the checks must not break: a 2x2 grid sent in an arbitrary order.
    full = np.arange(24, dtype=np.int16).reshape(4, 6)
    tiles = (((2, 4), (0, 3)), ((0, 2), (3, 6)), ((0, 2), (0, 3)), ((2, 4), (3, 6)))
    shards = [np.ascontiguousarray(full[a:b, c:d]) for (a, b), (c, d) in tiles]
    data, bufs = craft(meta("int16", (4, 6), tiles), *shards)
    for placement in ("device", "host"):
        y = jt.loads(data, bufs, placement=placement)
        assert np.asarray(y).dtype == np.int16 and np.array_equal(np.asarray(y), full)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("dtype", "O", "is not one a jax.Array can have"),
        ("dtype", ">f4", "is not one a jax.Array can have"),
        ("dtype", "V4", "is not one a jax.Array can have"),
        ("dtype", "f4,i4", "is not one a jax.Array can have"),
        ("dtype", 5, "is not a dtype name"),
        ("shape", (-4,), "non-negative ints"),
        ("shape", (4.0,), "non-negative ints"),
        ("shape", [4], "non-negative ints"),
        ("shape", (1 << 40, 1 << 30), "impossibly large"),
        ("shape", (8,), "needs 32 bytes but 16 arrived"),
        ("weak", 1, "weak_type 1 is not a bool"),
        ("impl", 3, "PRNG implementation 3 is not a name"),
        ("impl", "threefry2x32", "is not a key array of PRNG implementation 'threefry2x32'"),
        ("impl", "no-such-prng", "PRNG implementation 'no-such-prng'"),
        ("sharding", ("named", "cpu", (2, 2), ("x", "y"), (0, 1, 2), None, None, None), "sharding description"),
        ("sharding", ("single", "cpu", "0", None), "sharding description"),
    ],
)
def test_every_field_is_checked(field, value, match):
    fields = dict(dtype="float32", shape=(4,), indices=(), weak=False, impl=None, sharding=None)
    fields[field] = value
    data, bufs = craft(meta(**fields), np.zeros(4, np.float32))
    with pytest.raises(jt.CorruptTransferError, match=match):
        jt.loads(data, bufs, placement="device")


def test_buffers_must_be_bytes_like_and_complete():
    data, bufs = craft(meta("float32", (4,)), 5)
    with pytest.raises(jt.CorruptTransferError, match="buffer 0 is a int, not a bytes-like object"):
        jt.loads(data, bufs)
    data, _ = jt.dumps(jnp.ones(4))
    with pytest.raises(jt.CorruptTransferError, match="needs 16 bytes but 12 arrived"):
        jt.loads(data, [bytes(12)])


def test_loads_without_its_buffers_says_they_are_missing():
    data, bufs = jt.dumps({"a": jnp.ones(3), "b": jnp.zeros(2, jnp.int8)})
    with pytest.raises(jt.CorruptTransferError) as e:
        jt.loads(data)
    msg = str(e.value)
    assert "refers to 2 out-of-band buffers but 0 were passed" in msg
    assert "jaxtransport.loads(data, buffers)" in msg
    assert "not enough out-of-band buffers" not in msg
    with pytest.raises(jt.CorruptTransferError, match="refers to 2 out-of-band buffers but 1 was passed"):
        jt.loads(data, bufs[:1])
    # A stream that is simply broken is still pickle's error.
    with pytest.raises(pickle.UnpicklingError):
        jt.loads(b"\x80\x05junk", bufs)


def test_corrupt_transfer_error_is_exported_and_pickles():
    assert "CorruptTransferError" in jt.__all__
    assert issubclass(jt.CorruptTransferError, jt.TransportError)
    assert issubclass(jt.CorruptTransferError, ValueError)
    err = jt.CorruptTransferError("Corrupt transfer: the shards of shape (4,) overlap")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is jt.CorruptTransferError and str(back) == str(err)


def test_registered_pickle_validates_too():
    # The same decoder behind pickle.loads after register() (and Ray, and the Pool).
    data, bufs = craft(meta("float32", (4, 4), (((0, 2), (0, 4)),)), np.zeros(8, np.float32))
    jt.register()
    try:
        with pytest.raises(jt.CorruptTransferError, match="uninitialised"):
            pickle.loads(data, buffers=bufs)
    finally:
        jt.unregister()


def test_weak_types_and_keys_still_round_trip_exactly():
    for x in (jnp.asarray(1.5), jnp.broadcast_to(jnp.asarray(2), (3,)), jax.random.key(0),
              jax.random.split(jax.random.key(1, impl="rbg"), 3)):
        y = jt.loads(*jt.dumps(x))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(y) == jax.random.key_impl(x)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        else:
            assert x.weak_type  # the input really is weak (both are built from Python scalars)
            assert y.weak_type
        assert y.dtype == x.dtype and y.shape == x.shape
        assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


# ------------------------------------------------------------------------------------------
# the fuzz


def test_fuzz_mutated_payloads_decode_exactly_or_raise_ours():
    seconds = float(os.environ.get("JAXTRANSPORT_FUZZ_SECONDS", "10"))
    seed = int(os.environ.get("JAXTRANSPORT_FUZZ_SEED", "0"))
    proc = run_python(
        f"import json, sys; sys.path.insert(0, {ROOT!r})\n"
        "from tests._fuzz_decode import main\n"
        f"print('REPORT ' + json.dumps(main({seconds}, {seed}), default=str))\n",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
             "JAX_ENABLE_X64": "1"},
        timeout=seconds + 240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["devices"] == 8 and report["x64"]
    assert report["failures"] == [], json.dumps(report, indent=1)
    # At least 3000 mutated payloads (more when the machine is fast: the loop also runs for
    # JAXTRANSPORT_FUZZ_SECONDS), every mutation kind well represented.
    assert report["cases"] >= 3000, report
    assert min(report["by_kind"].values()) >= 500, report
    assert "SystemError" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["flo,t8_e5m2", "f4,,i4"])
def test_a_dtype_name_numpy_cannot_parse_is_ours(name):
    # numpy's parser raises ValueError (not TypeError) for these: the fuzzer found it surfacing
    # from the decoder; it is a TransportError naming the dtype, as for an unknown name.
    data, bufs = craft(meta(name, (4,)), np.zeros(4, np.float32))
    with pytest.raises(jt.TransportError, match="does not know dtype"):
        jt.loads(data, bufs)
