"""A seeded mutation fuzz of ``jaxtransport.loads`` over ``jaxtransport.dumps`` output.

Run in a fresh interpreter with 8 host CPU devices and 64-bit types (tests/test_decode_validation.py
does); prints one JSON report. Not collected by pytest (no ``test_`` prefix).

Inputs: ``dumps`` of every array kind (every dtype family incl. 64-bit and ml_dtypes, 0-d and
zero-size shapes, weak-typed scalars, typed PRNG keys of three implementations, NamedSharding
shardings - tiled, partly replicated, zero-size - sharded keys, a SingleDeviceSharding,
a pytree of several arrays), each mutated three ways:

- bytes: one byte of the pickle replaced (random or boundary value), deleted or inserted, or the
  pickle truncated;
- fields: the pickle re-made with one field of one array's metadata changed (dtype, shape,
  weak_type, PRNG implementation, sharding, shard indices) - what a buggy or hostile peer sends;
- buffers: one buffer dropped, duplicated, truncated, grown, swapped or replaced.

The oracle (independent of jaxtransport's validator):

- ``capture`` replays the same pickle through ``pickle.loads`` with ``_rebuild_array`` (the
  wire format's rebuild function) swapped for a recorder: it yields the exact (meta, buffers)
  each array decode receives. A reference decoder (``reference`` below: a boolean coverage mask, not
  jaxtransport's interval arithmetic) says what each one legitimately describes, or that it
  describes nothing consistent.
- If ``loads`` returns, every array decode in the stream ran, so every recorded call must be
  consistent, and every array in the result must equal, bit for bit, the array its call
  describes (dtype, shape, weak_type, PRNG implementation; and, with placement="preserve", the
  sender's sharding when that field is unchanged). With the metadata untouched that is the
  original array exactly.
- If ``loads`` raises: a ``jaxtransport.TransportError``, or - only when no frame of the
  traceback is inside jaxtransport's decoder (``_codec.py``, ``_rebuild_array``) - whatever the
  pickle machinery raises for a stream it cannot parse (UnpicklingError, EOFError, KeyError ...).
  A damaged pickle stream is pickle's to report; a well-formed stream with a bad description must
  be refused by jaxtransport with its own error.
- Memory: tracemalloc's peak during ``loads`` (numpy's allocations are traced) stays within the
  bytes of the buffers plus a small slack: nothing is reserved for sizes the buffers cannot fill.

CPython's own unpickler, given a damaged length or memo-index field, allocates what the field
says before it notices the stream is short (BINBYTES, BYTEARRAY8, ...: gigabytes, and on 3.11
a failed BYTEARRAY8 leaves a dangling buffer that crashes the next garbage collection) or grows
its memo to the index (LONG_BINPUT). Those streams never reach jaxtransport's code and are left
out (``unpickler_hazard``, counted in the report); the address space is capped as well, so one
that slips through fails with MemoryError instead of touching gigabytes.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import pickletools
import random
import re
import resource
import sys
import time
import tracemalloc
import traceback
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 - the dtype names below
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jaxtransport as jt
from jaxtransport._pickling import _rebuild_array  # the wire format's rebuild function

REBUILD = (_rebuild_array.__module__, _rebuild_array.__name__)
SLACK = 1 << 20  # bytes of Python objects a decode may allocate besides array data
PLACEMENTS = ("device", "host", "preserve")
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int4", "uint4",
          "int2", "uint2", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
          "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn"]
DTYPES = [d for d in DTYPES if hasattr(ml_dtypes, d) or hasattr(np, d)]
ARRAY_DTYPES = {np.dtype(jnp.dtype(d)) for d in DTYPES}
LEGACY_PRNG_TAGS = {"fry": "threefry2x32", "rbg": "rbg", "urbg": "unsafe_rbg"}
CANONICALIZED = {np.dtype(jnp.dtype(d)) for d in DTYPES if d == "bool" or d.endswith(("int2", "int4"))
                 or d == "float4_e2m1fn"}
ODD_DTYPES = ["V4", "O", ">f4", "S3", "U2", "f4,i4", "(2,)f4", "M8[s]", "float0", "nope", "", 3,
              None, b"float32"]


# ------------------------------------------------------------------------------------------
# inputs


def random_array(dtype: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(jnp.dtype(dtype))
    n = math.prod(shape)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.itemsize == 1 and dt.kind == "V":  # sub-byte and 8-bit ml_dtypes: valid values only
        with np.errstate(invalid="ignore"):
            return np.asarray(rng.integers(1, 3, size=n), dtype=np.float32).astype(dt).reshape(shape)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def inputs() -> dict:
    rng = np.random.default_rng(0)
    cases: dict = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(), (0,), (3, 5), (2, 0, 3)][i % 4]
        cases[f"{dtype}{list(shape)}"] = jnp.asarray(random_array(dtype, shape, rng))
        cases[f"{dtype}[7]"] = jnp.asarray(random_array(dtype, (7,), rng))
    cases["weak-float"] = jnp.asarray(1.5)
    cases["weak-int"] = jnp.asarray(7) * 2
    cases["weak-vector"] = jnp.broadcast_to(jnp.asarray(2.5), (3,))
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        cases[f"key-{impl}"] = jax.random.split(jax.random.key(3, impl=impl), 4)
    cases["key-scalar"] = jax.random.key(1)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    base = jnp.asarray(random_array("float32", (8, 12), rng))
    cases["sharded-xy"] = jax.device_put(base, NamedSharding(mesh, P("x", "y")))
    cases["sharded-x"] = jax.device_put(base, NamedSharding(mesh, P("x")))
    cases["sharded-cols"] = jax.device_put(base, NamedSharding(mesh, P(None, "y")))
    cases["sharded-joint"] = jax.device_put(base, NamedSharding(mesh, P(("x", "y"))))
    cases["sharded-replicated"] = jax.device_put(base, NamedSharding(mesh, P()))
    cases["sharded-joint-cols"] = jax.device_put(jnp.asarray(random_array("int16", (2, 8), rng)),
                                                 NamedSharding(mesh, P(None, ("x", "y"))))
    cases["sharded-bf16-3d"] = jax.device_put(jnp.asarray(random_array("bfloat16", (4, 4, 3), rng)),
                                              NamedSharding(mesh, P("y", None, None)))
    cases["sharded-f64"] = jax.device_put(jnp.asarray(random_array("float64", (4, 8), rng)),
                                          NamedSharding(mesh, P("x", "y")))
    cases["sharded-empty"] = jax.device_put(jnp.zeros((0, 8)), NamedSharding(mesh, P(None, "y")))
    cases["sharded-keys"] = jax.device_put(jax.random.split(jax.random.key(5), 8),
                                           NamedSharding(mesh, P("x")))
    cases["single-device-3"] = jax.device_put(base[:3], SingleDeviceSharding(jax.devices()[3]))
    cases["pytree"] = {"w": base[:2], "b": jnp.asarray(0.5), "k": jax.random.key(9),
                       "s": cases["sharded-xy"], "step": 3}
    return cases


# ------------------------------------------------------------------------------------------
# capture: the (meta, buffers) each array decode of a stream receives


class _Recorded:
    def __init__(self, index: int):
        self.index = index


def capture(data: bytes, buffers: list) -> tuple[list, str | None]:
    """Replays ``pickle.loads(data, buffers=buffers)`` - the very parser ``jt.loads`` uses (a
    file-based Unpickler treats damaged frames differently) - with the rebuild function swapped
    for a recorder for the duration."""
    calls: list = []

    def record(meta, *raw):
        calls.append((meta, raw))
        return _Recorded(len(calls) - 1)

    record.__module__, record.__qualname__ = REBUILD
    module = sys.modules[REBUILD[0]]
    setattr(module, REBUILD[1], record)
    try:
        pickle.loads(data, buffers=buffers)
    except Exception as e:  # noqa: BLE001 - any failure of the stream itself (not kept)
        failed = type(e).__name__
    else:
        failed = None
    finally:
        setattr(module, REBUILD[1], _rebuild_array)
    return calls, failed


def remake(calls_meta: list, calls_raw: list) -> tuple[bytes, list]:
    """A stream (a list of array decodes) with exactly these (meta, buffers): how a peer with
    different metadata would have pickled them."""

    class Call:
        def __init__(self, meta, raw):
            self.meta, self.raw = meta, raw

        def __reduce__(self):
            return _rebuild_array, (self.meta, *[_buf(r) for r in self.raw])

    out: list = []
    data = pickle.dumps([Call(m, r) for m, r in zip(calls_meta, calls_raw)], protocol=5,
                        buffer_callback=lambda pb: out.append(pb.raw()) or False)
    return data, out


def _buf(r):
    try:
        with memoryview(r) as m:
            if not m.c_contiguous:
                return r  # in-band as it is
    except TypeError:
        return r  # not a buffer: in-band as it is
    return pickle.PickleBuffer(r)


# ------------------------------------------------------------------------------------------
# the reference decoder


def nbytes(b) -> int | None:
    try:
        with memoryview(b) as m:
            return m.nbytes if m.c_contiguous else None
    except TypeError:
        return None


def reference(meta, raw, sender_sharding_meta) -> dict | str:
    """What (meta, raw) legitimately describes: a dict, or a string saying why nothing."""
    if type(meta) is not tuple or len(meta) != 7 or type(meta[0]) is not int or meta[0] != 1:
        return "format"
    _, name, shape, weak, impl, sharding, indices = meta
    if not isinstance(name, str):
        return "dtype type"
    try:
        dtype = np.dtype(jnp.dtype(name))
    except Exception:
        return "dtype name"
    if dtype not in ARRAY_DTYPES or not dtype.isnative:
        return "dtype kind"
    if type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 32:
        return "shape"
    if not isinstance(weak, bool) or not (impl is None or isinstance(impl, str)):
        return "flags"
    sizes = [nbytes(b) for b in raw]
    if any(s is None for s in sizes):
        return "buffer type"
    total = math.prod(shape) * dtype.itemsize
    if total > sum(sizes):  # a consistent message never declares more than its buffers hold
        return "declares more bytes than arrived"
    out = np.zeros(total, np.uint8)
    if type(indices) is not tuple:
        return "indices type"
    if not indices:
        if len(raw) != 1 or sizes[0] != total:
            return "whole-array buffer"
        out[:] = np.frombuffer(raw[0], np.uint8)
    else:
        if len(raw) != len(indices):
            return "buffer count"
        view = out.view(dtype).reshape(shape) if dtype.itemsize else None
        covered = np.zeros(shape, bool)
        for idx, b, size in zip(indices, raw, sizes):
            if (type(idx) is not tuple or len(idx) != len(shape)
                    or not all(type(p) is tuple and len(p) == 2 and all(type(v) is int for v in p)
                               and 0 <= p[0] <= p[1] <= n for p, n in zip(idx, shape))):
                return "index"
            region = tuple(slice(a, b_) for a, b_ in idx)
            sub = covered[region]
            if size != sub.size * dtype.itemsize:
                return "shard buffer size"
            if sub.any():
                return "overlap"
            covered[region] = True
            view[region] = np.frombuffer(b, np.uint8).view(dtype).reshape(sub.shape)
        if not covered.all():
            return "not covered"
    data = out.view(dtype).reshape(shape)
    if impl is not None:
        key = None
        # A name, or the short tag JAX < 0.4.36 printed (which receivers accept too).
        for name in (impl, LEGACY_PRNG_TAGS.get(impl)):
            try:
                key = jax.random.wrap_key_data(jax.device_put(data, jax.devices("cpu")[0]), impl=name)
                break
            except Exception:  # noqa: BLE001
                continue
        if key is None:
            return "prng impl"
        impl = str(jax.random.key_impl(key))
    try:
        same = bool(sharding == sender_sharding_meta)
    except Exception:  # noqa: BLE001 - an array inside: not the sender's
        same = False
    return dict(dtype=dtype, shape=shape, weak=weak, impl=impl, data=data,
                sharding_same=same, sharding_meta=sharding)


def bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def matches(y, ref: dict, placement: str, sender_sharding) -> str | None:
    """None when ``y`` is exactly what ``ref`` describes, else what differs."""
    is_key = isinstance(y, jax.Array) and jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
    if ref["impl"] is None and is_key:
        return "a key array where plain data was described"
    if ref["impl"] is not None:
        if not isinstance(y, jax.Array) or not jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key):
            return f"expected a key array, got {type(y).__name__}"
        if str(jax.random.key_impl(y)) != ref["impl"]:
            return "key impl"
        y = jax.random.key_data(y)
    elif placement == "host":
        if type(y) is not np.ndarray:
            return f"expected a numpy array, got {type(y).__name__}"
    else:
        if not isinstance(y, jax.Array):
            return f"expected a jax.Array, got {type(y).__name__}"
        if bool(y.weak_type) != ref["weak"]:
            return "weak_type"
    if np.dtype(y.dtype) != ref["dtype"] or tuple(y.shape) != ref["shape"]:
        return f"dtype/shape {y.dtype}{y.shape} != {ref['dtype']}{ref['shape']}"
    expected = [bits(ref["data"])]
    if placement != "host" and ref["impl"] is None and ref["dtype"] in CANONICALIZED:
        # A description that puts non-canonical bit patterns in a bool or sub-byte array (no
        # JAX sender does) gets those bits or what JAX makes of them on a device (which differs
        # between an aliased and a copied host buffer).
        expected += [bits(jax.device_put(ref["data"])),
                     bits(jax.device_put(np.array(ref["data"]), jax.devices()[0]))]
    if ref["dtype"] == np.dtype(bool) and ref["impl"] is None:
        # A bool description over bytes other than 0 and 1 (no JAX sender makes one): any path
        # may also hand back the canonical True/False of those bytes.
        expected.append(bits(np.asarray(ref["data"]).view(np.uint8) != 0))
    if bits(y) not in expected:
        return "values"
    if placement == "preserve" and ref["sharding_same"] and sender_sharding is not None:
        # Equivalent, not equal: a key array's data sent as plain uint32 (its impl field mutated
        # away) keeps the keys' mesh and axes with one more dimension, P('x', None) for P('x',),
        # the same placement of every element.
        if ref["impl"] is None and not _same_placement(y.sharding, sender_sharding, y.ndim):
            return f"sharding {y.sharding} != {sender_sharding}"
    return None


def _same_placement(a, b, ndim: int) -> bool:
    return a == b or a.is_equivalent_to(b, ndim)


def arrays_in(obj, depth=0) -> list:
    if isinstance(obj, (jax.Array, np.ndarray)):
        return [obj]
    if depth > 6:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [a for v in obj for a in arrays_in(v, depth + 1)]
    return []


def inside_decoder(exc: BaseException) -> bool:
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("jaxtransport", "_codec.py")) or code.co_name == "_rebuild_array":
            return True
    return False


# ------------------------------------------------------------------------------------------
# mutators


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.random()
    pos = rng.randrange(len(b))
    if op < 0.6:
        b[pos] = rng.choice([rng.randrange(256), 0, 1, 0x7F, 0x80, 0xFF, (b[pos] + 1) % 256,
                             (b[pos] - 1) % 256, b[pos] ^ 0x20])
    elif op < 0.75:
        del b[pos]
    elif op < 0.9:
        b.insert(pos, rng.randrange(256))
    else:
        del b[pos:]
    return bytes(b)


def mutate_int(n: int, rng: random.Random):
    return rng.choice([n + 1, n - 1, n * 2, 0, -1, 1 << 40, (1 << 62) + 5, n + 8, True, float(n),
                       np.int64(n)])


def mutate_shape(shape: tuple, rng: random.Random):
    s = list(shape)
    op = rng.randrange(7)
    if op == 0 and s:
        i = rng.randrange(len(s))
        s[i] = mutate_int(s[i], rng)
    elif op == 1:
        s.insert(rng.randrange(len(s) + 1), rng.choice([1, 2, 1 << 29, 0]))
    elif op == 2 and s:
        s.pop(rng.randrange(len(s)))
    elif op == 3:
        return list(s)
    elif op == 4:
        return tuple([1 << 30] + s[1:]) if s else (1 << 29,)
    elif op == 5 and len(s) >= 2:
        s[0], s[1] = s[1], s[0]
    else:
        return tuple(reversed(s)) + (1,)
    return tuple(s)


def mutate_indices(indices: tuple, shape: tuple, rng: random.Random):
    ind = [list(list(p) for p in idx) for idx in indices]
    op = rng.randrange(9)
    if not ind:
        if not shape:
            return ((),) if op < 5 else (((0, 1),),)
        return (tuple((0, n) for n in shape),) if op < 4 else (tuple((0, max(n - 1, 0)) for n in shape),)
    k = rng.randrange(len(ind))
    if op == 0:
        ind.pop(k)
    elif op == 1:
        ind.append(ind[k])
    elif op == 2 and ind[k]:
        d = rng.randrange(len(ind[k]))
        ind[k][d][rng.randrange(2)] = mutate_int(ind[k][d][0], rng)
    elif op == 3 and len(ind) > 1:
        j = rng.randrange(len(ind))
        ind[k], ind[j] = ind[j], ind[k]
    elif op == 4 and ind[k]:
        d = rng.randrange(len(ind[k]))
        a, b = ind[k][d]
        ind[k][d] = [a + 1, b + 1] if rng.random() < 0.5 else [max(a - 1, 0), b]
    elif op == 5:
        return ()
    elif op == 6 and ind[k]:
        ind[k].pop()
    elif op == 7:
        return [tuple(tuple(p) for p in idx) for idx in ind]
    else:
        ind[k] = [[0, 0] for _ in ind[k]]
    return tuple(tuple(tuple(p) for p in idx) for idx in ind)


def mutate_sharding(sh, rng: random.Random):
    if sh is None or rng.random() < 0.2:
        return rng.choice([None, ("single", "cpu", rng.choice([0, 3, 7, 99]), None), ("other", "x"),
                           ("named",), "named", ("single", "tpu", 0, None),
                           ("single", "cpu", 1, "pinned_host"), ("single", "cpu", 1, "nowhere")])
    s = list(sh)
    if s[0] != "named":
        s[rng.randrange(1, len(s))] = rng.choice([None, 5, "cpu", -1, (1,)])
        return tuple(s)
    i = rng.randrange(1, 8)
    if i == 2:
        s[2] = rng.choice([(4, 2), (8,), (2, 2), (2, 4, 1), (0, 4), (2, -4)])
    elif i == 3:
        s[3] = rng.choice([("y", "x"), ("x", "x"), ("x",), ("x", 3), ("a", "b")])
    elif i == 4:
        ids = list(s[4])
        ids[rng.randrange(len(ids))] = rng.choice([99, ids[0], -1])
        s[4] = tuple(ids) if rng.random() < 0.8 else tuple(reversed(ids))
    elif i == 5:
        s[5] = rng.choice([P("x", "y", "x"), P("y", "x"), P("q"), P(None, None, None), P(), P("x"),
                           ("x", "y"), None])
    elif i == 6:
        s[6] = rng.choice(["device", "pinned_host", "unpinned_host", "nowhere", 3])
    else:
        s[rng.randrange(1, 8)] = rng.choice([None, 0, "cpu", ()])
    return tuple(s)


def mutate_meta(meta: tuple, rng: random.Random):
    m = list(meta)
    field = rng.choice(["version", "dtype", "dtype", "shape", "shape", "weak", "impl", "sharding",
                        "indices", "indices", "indices", "type"])
    if field == "version":
        m[0] = rng.choice([0, 2, "1", None])
    elif field == "dtype":
        m[1] = rng.choice(DTYPES + ODD_DTYPES)
    elif field == "shape":
        m[2] = mutate_shape(m[2], rng)
    elif field == "weak":
        m[3] = rng.choice([not m[3], 1, None, "yes"])
    elif field == "impl":
        m[4] = rng.choice([None, "threefry2x32", "rbg", "unsafe_rbg", "nope", 5, "fry"])
    elif field == "sharding":
        m[5] = mutate_sharding(m[5], rng)
    elif field == "indices":
        m[6] = mutate_indices(m[6], m[2], rng)
    else:
        arrayed = list(m)
        arrayed[rng.randrange(len(m))] = np.arange(rng.choice([1, 2]))  # an array where a scalar goes
        return rng.choice([m, m[:-1], m + [None], dict(enumerate(m)), None, tuple(arrayed)])
    return tuple(m)


def mutate_raw(raw: tuple, rng: random.Random) -> tuple:
    r = list(raw)
    op = rng.randrange(7)
    k = rng.randrange(len(r)) if r else 0
    if op == 0 and r:
        r.pop(k)
    elif op == 1 and r:
        r.insert(k, r[k])
    elif op == 2 and r:
        r[k] = memoryview(r[k])[: max(nbytes(r[k]) - rng.choice([1, 2, 4, 8]), 0)]
    elif op == 3 and r:
        r[k] = bytes(r[k]) + bytes(rng.choice([1, 2, 8]))
    elif op == 4 and len(r) > 1:
        j = rng.randrange(len(r))
        r[k], r[j] = r[j], r[k]
    elif op == 5 and r:
        r[k] = rng.choice([5, None, "abc", bytes(0), np.zeros(3, np.uint8)[::2]])
    else:
        r.append(bytes(8))
    return tuple(r)


# ------------------------------------------------------------------------------------------
# the run


def unpickler_hazard(data: bytes) -> bool:
    """Whether CPython's C unpickler itself may misbehave on this damaged stream: a BYTEARRAY8
    whose declared size cannot be allocated (3.11: "SystemError: deallocated bytearray object
    has exported buffers", then a crash at the next garbage collection), or a LONG_BINPUT whose
    index makes it grow (and touch) the memo to gigabytes. Neither reaches jaxtransport's code:
    those streams are left out (and counted)."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("BYTEARRAY8", "LONG_BINPUT") and (op.name == "BYTEARRAY8" or arg > 1 << 16):
                return True
    except Exception as e:  # noqa: BLE001 - a malformed stream: hazardous if it fails on those
        # BINBYTES/BINBYTES8/BYTEARRAY8/BINUNICODE*: CPython allocates the declared length before
        # it finds the stream too short (gigabytes for a damaged length field).
        declared = re.search(r"expected (\d+) bytes in a", str(e))
        return "bytearray8" in str(e) or (declared is not None and int(declared.group(1)) > 1 << 20)
    return False


def judge(data: bytes, bufs: list, placement: str, senders: list) -> str | None:
    """None when decoding (data, bufs) behaved; else what went wrong."""
    calls, cap_err = capture(data, bufs)
    budget = sum(nbytes(b) or 0 for b in bufs) + SLACK
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    # The exception is judged inside the except block and not kept: a kept exception's
    # traceback holds this frame (a reference cycle), and a cycle collector that clears a
    # memoryview while an array still exports it frees memory that array uses (CPython's
    # memoryview tp_clear), which is this harness's doing, not the decoder's.
    raised = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = jt.loads(data, bufs, placement=placement)
    except Exception as e:  # noqa: BLE001
        result = None
        if isinstance(e, jt.TransportError):
            raised = "ours"
        elif inside_decoder(e):
            raised = f"decoder raised {type(e).__name__}: {e}"
        else:
            raised = "pickle"  # the pickle stream itself is broken: pickle's error
    peak = tracemalloc.get_traced_memory()[1] - base
    if peak > budget:
        return f"allocated {peak} bytes for buffers of {budget - SLACK} bytes"
    if raised is not None:
        return None if raised in ("ours", "pickle") else raised
    refs = []
    for i, (meta, raw) in enumerate(calls):
        # The sender's sharding applies when this call's sharding field is the sender's.
        sender = senders[i] if i < len(senders) else (None, None)
        ref = reference(meta, raw, sender[0][5] if sender[0] else None)
        if isinstance(ref, str):
            return f"accepted an inconsistent array description ({ref}): {meta!r}"
        refs.append((ref, sender[1]))
    for y in arrays_in(result):
        problems = [matches(y, ref, placement, sharding) for ref, sharding in refs]
        if all(problems):
            return f"returned a wrong array ({'; '.join(problems) or 'no array was described'})"
    return None


def main(seconds: float, seed: int, min_cases: int = 3000) -> dict:
    """Mutate until ``min_cases`` mutated payloads were judged and ``seconds`` have passed."""
    cases = inputs()
    rng = random.Random(seed)
    tracemalloc.start()
    prepared = []
    for name, x in cases.items():
        data, bufs = jt.dumps(x)
        calls, err = capture(data, bufs)
        assert err is None and calls, name
        # pickled in this order (a dict's values in insertion order)
        arrays = [v for v in (x.values() if isinstance(x, dict) else [x]) if isinstance(v, jax.Array)]
        assert len(arrays) == len(calls), name
        senders = [(meta, a.sharding) for (meta, _), a in zip(calls, arrays)]
        for placement in PLACEMENTS:  # the unmutated payload decodes exactly (and warms up)
            problem = judge(data, bufs, placement, senders)
            assert problem is None, (name, placement, problem)
        prepared.append((name, data, bufs, calls, senders))
    # From here a huge memo request of a mutated pickle fails instead of touching gigabytes.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), hard))
    counts = {"bytes": 0, "fields": 0, "buffers": 0}
    outcomes = {"array": 0, "TransportError": 0, "pickle error": 0}
    failures: list = []
    kinds_of_failure: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    n = skipped = 0
    while time.monotonic() < deadline or n - skipped < min_cases:
        name, data, bufs, calls, senders = prepared[n % len(prepared)]
        n += 1
        placement = rng.choice(PLACEMENTS)
        kind = rng.choice(["bytes", "fields", "fields", "buffers"])
        if kind == "bytes":
            mdata, mbufs = mutate_bytes(data, rng), bufs
            if unpickler_hazard(mdata):
                skipped += 1
                continue
        else:
            metas = [m for m, _ in calls]
            raws = [r for _, r in calls]
            k = rng.randrange(len(calls))
            if kind == "fields":
                metas[k] = mutate_meta(metas[k], rng)
            else:
                raws[k] = mutate_raw(raws[k], rng)
            mdata, mbufs = remake(metas, raws)
        counts[kind] += 1
        try:
            problem = judge(mdata, mbufs, placement, senders)
        except Exception:  # noqa: BLE001 - the oracle itself failed: report it
            problem = "oracle error: " + traceback.format_exc(limit=3)
        if problem is not None:
            kinds_of_failure[problem.split("(")[0].split(":")[0].strip()] += 1
        if problem is not None and len(failures) < 20:
            failures.append({"case": name, "kind": kind, "placement": placement, "problem": problem,
                             "data": mdata.hex() if kind == "bytes" else None,
                             "meta": repr(metas[k]) if kind == "fields" else None})
        elif problem is not None:
            failures.append(None)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return {"cases": n - skipped, "skipped_unpickler_hazards": skipped, "inputs": len(prepared), "by_kind": counts, "failures": failures,
            "failure_kinds": dict(kinds_of_failure),
            "seed": seed, "devices": jax.device_count(), "x64": bool(jax.config.jax_enable_x64)}


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(json.dumps(main(seconds, seed), default=str))
