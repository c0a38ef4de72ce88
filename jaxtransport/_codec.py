"""jax.Array <-> (meta, host buffers): the faithful encoding every transport builds on.

``encode(x)`` returns a small picklable :class:`ArrayMeta` and a list of C-contiguous host
``numpy.ndarray`` views, one per *unique* shard (a fully replicated array ships one buffer, a
sharded one ships each distinct shard once; a large array on an accelerator ships in pieces along
its first long axis, described as shards are: Note [pickled in pieces]). On CPU the views alias
the device buffers: encoding copies nothing.

``decode(meta, buffers, placement)`` re-materializes on the receiver:

- ``"device"`` (default): like JAX's own unpickling, on the receiver's default device,
  uncommitted. A single-buffer array on a CPU receiver aliases the host buffer when it is
  64-byte aligned (``jax.device_put`` does not copy then); see Note [aliasing].
- ``"host"``: a ``numpy.ndarray`` view of the buffer (typed PRNG keys cannot be numpy arrays:
  they come back as key arrays on the host CPU device).
- ``"preserve"``: the same sharding (NamedSharding: mesh shape, axis names, device ids,
  PartitionSpec, memory kind; SingleDeviceSharding: device id) when the receiver has those
  devices; otherwise ``"device"`` with a :class:`PlacementFallbackWarning` saying why.

Preserved bit-exactly: every dtype (bytes are moved, never converted), 0-d and zero-size shapes,
``weak_type``, typed PRNG keys (impl by name).

Note [aliasing]: ``jax.device_put(ndarray)`` on CPU aliases a 64-byte-aligned host buffer,
writeable or not (jax-ml/jax#37830), and keeps the ndarray alive for as long as the device
buffer lives. So the decoded array keeps whatever owns ``buffers`` alive (a pickle's out-of-band
buffer, a Ray object-store buffer, a shared-memory slot) and sees writes to it: callers that
recycle memory must wait until the array (and anything derived from it) is gone.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from . import _compat, _copies, _devices
from ._errors import (
    ArrayDeletedError,
    CorruptTransferError,
    DtypeUnavailableError,
    UnsupportedArrayError,
)
from ._nojax import PLACEMENTS, check_placement

__all__ = [
    "PLACEMENTS",
    "ArrayMeta",
    "PlacementFallbackWarning",
    "check_placement",
    "decode",
    "decoder",
    "encode",
    "is_jax_array",
    "nbytes",
]

# Note [format versions]
# The array format's version, the first field of every ArrayMeta written. What a pickle of
# ``jt.dumps`` or of a ``register()``'d pickler stores (the rebuild function's import path, the
# meta tuple, the buffers) is data at rest: caches and checkpoints keep it across upgrades. So
# this reader accepts every version from 1 to FORMAT_VERSION (each release that bumps it keeps a
# reader for the older ones, and adds golden files under tests/golden/ that stay checked), and
# refuses a newer one with what to do. Shared-memory handles (the Pool's and
# jaxtransport.multiprocessing's) are not data at rest: they live only while their pool or queue
# does and are never stored.
FORMAT_VERSION = 1
OLDEST_FORMAT_VERSION = 1


class PlacementFallbackWarning(UserWarning):
    """``placement="preserve"`` could not rebuild the sender's sharding on this receiver."""


class ArrayMeta(NamedTuple):
    """Everything but the bytes. Small, picklable, stable (a plain tuple on the wire)."""

    version: int
    dtype: str  # jnp dtype name of the shipped data ("uint32" for PRNG key data)
    shape: tuple  # global shape of the shipped data
    weak_type: bool
    prng_impl: str | None  # typed PRNG key implementation name, None for plain arrays
    sharding: tuple | None  # see _encode_sharding
    indices: tuple  # per buffer: ((start, stop), ...) into ``shape``; () = the whole array


def concrete_array_types() -> tuple[type, ...]:
    """The exact classes of concrete JAX arrays (``jax.Array`` itself is abstract)."""
    return _compat.concrete_array_types()


def is_jax_array(x: Any) -> bool:
    """True for concrete jax arrays (not Tracers, which also pass ``isinstance(x, jax.Array)``)."""
    return type(x) in concrete_array_types()


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def nbytes(meta: ArrayMeta) -> int:
    """Bytes the buffers of ``meta`` hold together."""
    itemsize = np.dtype(_np_dtype(meta.dtype)).itemsize
    if not meta.indices:
        return math.prod(meta.shape) * itemsize
    return sum(math.prod(b - a for a, b in idx) * itemsize for idx in meta.indices)


# --------------------------------------------------------------------------------------------
# encode


def _check_alive(x: Any) -> None:
    if x.is_deleted():
        raise ArrayDeletedError(
            f"Cannot transport a jax.Array of shape {x.shape} and dtype {x.dtype}: it was deleted "
            "or donated (x.delete(), or passed to a jit function with donate_argnums / "
            "donate_argnames), so its buffer no longer exists. Send the array before donating "
            "it, or send the result of the call that consumed it."
        )


def _norm_index(index: tuple, shape: tuple) -> tuple:
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:  # pragma: no cover - JAX shards are contiguous ranges
            raise UnsupportedArrayError(f"Shard index with step {step} is not supported")
        out.append((start, stop))
    return tuple(out)


def _encode_sharding(sharding: Any) -> tuple | None:
    from jax.sharding import NamedSharding, SingleDeviceSharding

    memory_kind = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return ("single", device.platform, device.id, memory_kind)  # type: ignore[attr-defined]
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        devices = np.asarray(mesh.devices)
        ids = tuple(int(d.id) for d in devices.flat)
        platform = devices.flat[0].platform
        axis_types = getattr(mesh, "axis_types", None)
        return (
            "named",
            platform,
            tuple(devices.shape),
            tuple(mesh.axis_names),
            ids,
            sharding.spec,
            memory_kind,
            axis_types,
        )
    return ("other", repr(sharding))


def encode(x: Any, *, host: bool = True) -> tuple[ArrayMeta, list[Any]]:
    """Split a concrete jax.Array into (meta, host buffers). Copies nothing on CPU.

    With ``host=False`` a buffer that lives on an accelerator stays there (a one-device
    jax.Array) for :func:`copy_into` to bring over straight into the caller's memory (Note
    [device to host in chunks]); :func:`host_nbytes` gives its size on the host.

    Raises ArrayDeletedError for deleted or donated arrays and UnsupportedArrayError for arrays
    whose shards live on other processes' devices.
    """
    _check_alive(x)
    prng_impl = None
    if _is_key(x):
        prng_impl = _compat.prng_impl_name(x)  # the canonical name on every JAX
        x = jax.random.key_data(x)
    if not x.is_fully_addressable:
        raise UnsupportedArrayError(
            f"Cannot transport a jax.Array of shape {x.shape} spanning devices of other "
            "processes (multi-controller JAX): only this process's shards are reachable. Send "
            "x.addressable_shards' data, or gather it first with "
            "jax.experimental.multihost_utils.process_allgather."
        )
    sharding_meta = _encode_sharding(x.sharding)
    indices: tuple = ()
    if x.is_fully_replicated:
        one = x if len(x.sharding.device_set) == 1 else x.addressable_shards[0].data
        pieces = _fetch_in_pieces(one) if host else None
        if pieces is not None:
            indices, buffers = pieces
        else:
            buffers = [np.asarray(one) if host else _host_or_device(one)]
    else:
        seen: dict[tuple, Any] = {}
        for shard in x.addressable_shards:
            idx = _norm_index(shard.index, x.shape)
            if idx not in seen:
                seen[idx] = shard.data
        indices = tuple(seen)
        buffers = _fetch_at_once(list(seen.values())) if host else [_host_or_device(d) for d in seen.values()]
    buffers = [b if not isinstance(b, np.ndarray) or b.flags.c_contiguous else np.ascontiguousarray(b) for b in buffers]
    meta = ArrayMeta(
        FORMAT_VERSION,
        str(x.dtype),
        tuple(x.shape),
        bool(x.weak_type),
        prng_impl,
        sharding_meta,
        indices,
    )
    return meta, buffers


# Note [device to host in chunks]
# Sending an accelerator's array through shared memory takes it to the host and copies it into
# a slot. ``np.asarray`` of a whole large array allocates a fresh host buffer (above glibc's
# mmap threshold: new pages, each faulted in), the copy into the slot comes after the transfer,
# and how fast the runtime brings an array over depends on its device layout. Measured on a TPU
# v5e (JAX 0.10.2), float32, ``np.asarray`` and the copy into a slot: 32 MiB shaped (8M,) 45 ms,
# (128K, 64) 95 ms (a 64-wide minor dimension is padded to the chip's 128 lanes), (32K, 256)
# 7 ms; 256 MiB shaped (64M,) 114 ms, (1M, 64) 672 ms, (256K, 256) 115 ms.
#
# So a large one-device array off the CPU (CHUNKED_MIN bytes and up, of a type in PIECEWISE)
# travels in pieces, rows along its first axis: pieces of CHUNK_BYTES, or of a quarter of the
# array when that is less. Each piece is cut by a jitted ``dynamic_slice``, taken as unsigned
# integers of its width (``bitcast_convert_type``) and, where its element count allows, reshaped
# to rows of LANES elements (the same bytes in the same order); they are started
# with ``copy_to_host_async`` and each copied into the destination while the next ones travel.
# WINDOW_BYTES of pieces are in flight (all of a 256 MiB array's 32): the chip's copies to the
# host run side by side. Because they do, the pieces arrive close together, and copied into the
# destination one after another the copies ran after the transfer: where the host has cores to
# spare, copy threads take and copy them (Note [copies into a slot in threads] in ``_copies``).
# Measured on the chip for the six arrays above, in 8 MiB pieces: reshaped 6, 6, 6 and 41, 40,
# 41 ms; not reshaped 7, 34, 6 and 42, 262, 40 ms (4 MiB pieces: a little slower; 16 MiB
# pieces, not reshaped: 8, 69, 7 and 61, 303, 56 ms). Those runs reshaped the float32 pieces
# as they were; the integer view came after a float16 piece came back from the chip with its
# NaNs made canonical and a reshaped bfloat16 one with other bits, and the float32, uint8 and
# int8 pieces were then checked bit for bit on the chip through the integer view
# (tests/test_on_device.py, random bits). Types outside PIECEWISE travel as one ``np.asarray``.
#
# ``jt.dumps`` (``encode`` with ``host=True``) has no destination to copy into: it takes such an
# array in pieces of its own, each its own host buffer (Note [pickled in pieces]).
#
# Costs: one compile of the slicing function per shape, dtype and piece size (cached by jit),
# and up to WINDOW_BYTES of pieces in device memory while it runs. An array whose host copy
# JAX already holds (``_npy_value``) is copied from there.
CHUNKED_MIN = 8 << 20
CHUNK_BYTES = 8 << 20
MIN_PIECES, MIN_PIECE = 4, 1 << 20
WINDOW_BYTES = 256 << 20
MIN_WINDOW = 4
LANES = 256
# The types whose pieces the chip gives back bit for bit (a NaN's payload, a subnormal), seen on
# a TPU v5e with random bits (tests/test_on_device.py): a float16 piece came back with its NaNs
# made canonical, a bfloat16 one reshaped with other bits. Integers are moved, never computed on.
# Every other type travels as one np.asarray, which is exact for all of them.
PIECEWISE: dict[str, np.dtype] = {
    "float32": np.dtype(np.uint32),
    "int32": np.dtype(np.uint32),
    "uint32": np.dtype(np.uint32),
    "int16": np.dtype(np.uint16),
    "uint16": np.dtype(np.uint16),
    "int8": np.dtype(np.uint8),
    "uint8": np.dtype(np.uint8),
}


# Note [fetch every leaf at once]
# Each small array on an accelerator that a message carries is fetched by ``np.asarray`` when
# the pickler reaches it: a synchronous device-to-host transfer whose cost on a TPU is mostly
# latency, paid once per leaf, one after another. A rollout's task carries dozens (an
# environment state's fields, a key; a policy's layers). On a TPU v5e, 28 arrays of 64 bytes
# took 12.2 ms one after another and 2.7 ms started together; in the rollouts demo with its
# learner on the chip, the two tasks' 30 small arrays cost 18 ms of an iteration, 9 ms so (4 ms
# starting them, 5 ms pickling).
# ``prefetch(obj)``, called before a message is pickled, starts the transfer of each such leaf
# of ``obj``'s pytree (``copy_to_host_async``, as ``jax.device_get`` does for a tree), so that
# the transfers overlap and the pickler's ``np.asarray`` then finds each host copy ready or in
# flight. Only one-device arrays off the host are started, and not those of CHUNKED_MIN bytes
# and up of a PIECEWISE type, which travel in pieces into their destination (Note [device to
# host in chunks]), nor PRNG keys, whose data is a new array at encoding. Leaves inside objects
# that are not pytrees (an instance of a plain class) are fetched as before, when pickled. It
# does nothing in a process that has started no accelerator backend (no array there is off the
# host), nor when ``obj`` fails to flatten. The host copy is the one ``np.asarray`` would have
# cached on the array anyway.


def prefetch(obj: Any) -> None:
    """Start the device-to-host copy of every small one-device accelerator array among the
    pytree leaves of ``obj`` (Note [fetch every leaf at once])."""
    platforms = _compat.initialized_platforms()
    if not platforms or platforms == {"cpu"}:
        return
    try:
        leaves = jax.tree.leaves(obj)
    except Exception:  # noqa: BLE001 - whatever does not flatten is fetched when pickled
        return
    types = concrete_array_types()
    for a in leaves:
        if type(a) not in types:
            continue
        try:
            if (
                _on_host(a)
                or len(a.sharding.device_set) != 1
                or _is_key(a)
                or a.is_deleted()
                or (a.nbytes >= CHUNKED_MIN and str(a.dtype) in PIECEWISE)
                or _compat.cached_host_copy(a) is not None
            ):
                continue
            a.copy_to_host_async()
        except Exception:  # noqa: BLE001 - the pickler's own fetch raises what it raises
            continue


def _host_or_device(a: Any) -> Any:
    """``a``'s host copy when it has one without a transfer (on the CPU, or cached by JAX), else
    ``a`` itself (a one-device array off the host)."""
    if _on_host(a):
        return np.asarray(a)
    cached = _compat.cached_host_copy(a)
    return a if cached is None else cached


def _on_host(a: Any) -> bool:
    try:
        devices = a.sharding.device_set
        memory_kind = getattr(a.sharding, "memory_kind", None)
    except Exception:  # noqa: BLE001 - not a jax.Array as we know it: let np.asarray say
        return True
    return all(d.platform == "cpu" for d in devices) or memory_kind not in (None, "device")


def host_nbytes(b: Any) -> int:
    """Bytes of buffer ``b`` (from :func:`encode`) on the host."""
    if isinstance(b, np.ndarray):
        return b.nbytes
    return math.prod(b.shape) * np.dtype(b.dtype).itemsize


def copy_into(b: Any, dst: np.ndarray) -> None:
    """Copy buffer ``b`` (from :func:`encode`) into ``dst``, a uint8 array of
    :func:`host_nbytes` bytes: one memcpy from the host, or a device-to-host transfer (Note
    [device to host in chunks])."""
    if isinstance(b, np.ndarray):
        _copies.copy_bytes(b.reshape(-1).view(np.uint8), dst)
        return
    nbytes = host_nbytes(b)
    rows = b.shape[0] if b.ndim else 0
    row_elems = math.prod(b.shape[1:])
    per = _rows_per_piece(rows, nbytes, row_elems) if rows else 0
    as_bits = PIECEWISE.get(str(b.dtype))
    if nbytes < CHUNKED_MIN or as_bits is None or not 1 <= per < rows:
        np.copyto(dst, np.asarray(b).reshape(-1).view(np.uint8))
        return
    lanes = LANES if LANES and (per * row_elems) % LANES == 0 else 0
    _copy_in_pieces(b, dst, rows, per, nbytes // rows, lanes, as_bits)


def _rows_per_piece(rows: int, nbytes: int, row_elems: int) -> int:
    """Rows of about CHUNK_BYTES, or of a quarter of the array when that is less (at least
    MIN_PIECE bytes), rounded down to a multiple that makes a piece whole rows of LANES
    elements when such a piece is smaller than the array (Note [device to host in chunks])."""
    piece = min(CHUNK_BYTES, max(nbytes // MIN_PIECES, MIN_PIECE))
    per = piece // max(nbytes // rows, 1)
    if not LANES or not per:
        return per
    step = LANES // math.gcd(row_elems, LANES)
    aligned = max(per // step, 1) * step
    return aligned if aligned < rows else per


@functools.cache
def _slicer(per: int, lanes: int, as_bits: np.dtype) -> Callable[[Any, int], Any]:
    from jax import lax

    def take(a, start):
        piece = lax.dynamic_slice_in_dim(a, start, per, 0)
        if piece.dtype != as_bits:
            piece = lax.bitcast_convert_type(piece, as_bits)
        return piece.reshape(-1, lanes) if lanes else piece

    return jax.jit(take)


def _copy_in_pieces(
    b: Any, dst: np.ndarray, rows: int, per: int, row_bytes: int, lanes: int, as_bits: np.dtype
) -> None:
    take = _slicer(per, lanes, as_bits)
    starts = list(range(0, rows, per))
    window = max(MIN_WINDOW, WINDOW_BYTES // max(per * row_bytes, 1))

    def issue(k: int) -> tuple[int, Any, Any]:
        first = min(starts[k], rows - per)  # dynamic_slice keeps the piece inside: the last overlaps
        piece = take(b, first)
        piece.copy_to_host_async()
        return k, first, piece

    def land(k: int, first: int, piece: Any) -> None:
        start, stop = starts[k], min(starts[k] + per, rows)
        host = np.asarray(piece).reshape(-1).view(np.uint8)
        dst[start * row_bytes : stop * row_bytes] = host[(start - first) * row_bytes : (stop - first) * row_bytes]

    pool = _copies.copiers()
    if pool is None:
        pending = collections.deque(issue(k) for k in range(min(window, len(starts))))
        for k in range(len(starts)):
            done = pending.popleft()
            if k + window < len(starts):
                pending.append(issue(k + window))
            land(*done)
            del done
        return
    landing: collections.deque = collections.deque()
    try:
        for k in range(len(starts)):
            if len(landing) >= window:
                landing.popleft().result()
            landing.append(pool.submit(land, *issue(k)))
        while True:  # not `while <test>:` (Note [loops that end in a test])
            if not landing:
                break
            landing.popleft().result()
    finally:
        _copies.settle(landing)


# Note [pickled in pieces]
# ``jt.dumps`` (``encode`` with ``host=True``: every pickle, Ray's serializer, joblib's store)
# returns host buffers, and a large one-device array off the CPU (CHUNKED_MIN bytes to
# PIECES_MAX, of a type in PIECEWISE) becomes several of them: rows along its first axis longer
# than 1 (every axis before it has length 1, so each piece is a contiguous range of the array's
# bytes), cut as in Note [device to host in chunks] (pieces of CHUNK_BYTES, or of a quarter of the
# array when that is less, whole rows of LANES elements where they can be; a last, shorter
# piece: pieces never overlap here), all cut by one jitted function, all started with
# ``copy_to_host_async`` at once, then each taken by ``np.asarray`` (in the copy threads where
# the process has them, ``_take_all``): one host buffer per piece, allocated by the runtime, and
# no joining copy anywhere on the sending side. Taking a piece is itself a host copy, from the
# runtime's staging into that new buffer, which faults its pages in: in one run on the v5e every
# fetch taken on one thread took 78-109 ms, ``jt.dumps`` 86 ms, while the Pool's argument, whose
# pieces were taken in threads, took 25 ms; in the next run all of them took 21.4-22.7 ms.
# On a TPU v5e (JAX 0.10.2, 256 MiB of float32) ``np.asarray`` of the whole array took 101 ms and
# 32 slices fetched at once 43 ms (8 slices: 95 ms; 64: 76 ms); into one host buffer of the
# sender's own, as tried at 776d1d5, the joining copy cost more than the pieces saved (311 ms
# against 107).
#
# The pieces travel as the array's shards do, in the same format (format 1: ``indices`` names
# each piece's rows, one buffer per piece, each its own out-of-band pickle-5 buffer), so any
# reader of format 1, older releases included, reads them, and ``_validate`` checks them as it
# checks shards (an exact tiling; each buffer exactly its rows' bytes) before anything is
# allocated. The receiver (``_row_pieces``):
# - onto an accelerator (placement "device", or "preserve" of a one-device sharding), within the
#   sizes and types of Note [host to device in pieces]: the received buffers ARE the pieces put
#   at once (cut further where one is larger than a piece should be; no host copy) and joined
#   on the device;
# - on the CPU, or placement "host": joined into one host array, one copy (``_assemble``), where
#   an array sent whole would be aliased (no copy). The pieces' buffers are separate
#   allocations, so no view of them can be one array without that copy.
# An array over PIECES_MAX goes whole (its pieces would double its footprint in device memory),
# as does one the device has no memory to cut; sharded arrays go as their shards, whose
# transfers all start at once (``_fetch_at_once``).
PIECES_MAX = 1 << 30


def _fetch_at_once(arrays: list[Any]) -> list[np.ndarray]:
    """``np.asarray`` of each array, their device-to-host copies started together first."""
    for a in arrays:
        if not _on_host(a) and _compat.cached_host_copy(a) is None:
            a.copy_to_host_async()
    return [np.asarray(a) for a in arrays]


def _split_axis(shape: tuple) -> int | None:
    """The first axis longer than 1 (pieces along it are contiguous bytes), or None."""
    return next((d for d, n in enumerate(shape) if n > 1), None)


def _fetch_in_pieces(a: Any) -> tuple[tuple, list[np.ndarray]] | None:
    """``(indices, host buffers)`` of a one-device array off the CPU fetched in pieces (Note
    [pickled in pieces]), or None where it goes whole."""
    as_bits = PIECEWISE.get(str(a.dtype))
    if as_bits is None or _on_host(a) or _compat.cached_host_copy(a) is not None:
        return None
    nbytes = int(a.nbytes)
    axis = _split_axis(tuple(a.shape))
    if axis is None or not CHUNKED_MIN <= nbytes <= PIECES_MAX:
        return None
    shape = tuple(a.shape)
    rows, row_elems = shape[axis], math.prod(shape[axis + 1 :])
    per = _rows_per_piece(rows, nbytes, row_elems)
    if not 1 <= per < rows:
        return None
    bounds = tuple((s, min(s + per, rows)) for s in range(0, rows, per))
    try:
        pieces = _splitter(axis, bounds, as_bits, LANES)(a)
        for p in pieces:
            p.copy_to_host_async()
        buffers = _take_all(pieces)
    except Exception as e:  # noqa: BLE001 - out of device memory: whole; anything else raises
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None
    del pieces
    lead = ((0, 1),) * axis
    rest = tuple((0, n) for n in shape[axis + 1 :])
    return tuple((*lead, b, *rest) for b in bounds), buffers


def _take_all(pieces: list) -> list[np.ndarray]:
    """``np.asarray`` of each piece (their transfers started), in the copy threads where the
    process has them: taking a piece is also a copy, from the runtime's staging into the new
    host buffer, which faults that buffer's pages in; one thread did them one after another
    (Note [copies into a slot in threads])."""
    pool = _copies.copiers()
    if pool is None or len(pieces) < 2:
        return [np.asarray(p) for p in pieces]
    landing = collections.deque(pool.submit(np.asarray, p) for p in pieces)
    try:
        return [f.result() for f in list(landing)]
    finally:
        _copies.settle(landing)


@functools.cache
def _splitter(axis: int, bounds: tuple, as_bits: np.dtype, lanes: int) -> Callable[[Any], list]:
    """One jitted function cutting an array into its pieces along ``axis`` (rows ``bounds``),
    each as unsigned integers of its width, reshaped to rows of ``lanes`` where its size allows
    (the same bytes in the same order)."""
    from jax import lax

    def split(a):
        out = []
        for start, stop in bounds:
            piece = lax.slice_in_dim(a, start, stop, axis=axis)
            if piece.dtype != as_bits:
                piece = lax.bitcast_convert_type(piece, as_bits)
            piece = piece.reshape(-1)
            out.append(piece.reshape(-1, lanes) if lanes and piece.size % lanes == 0 else piece)
        return out

    return jax.jit(split)


# --------------------------------------------------------------------------------------------
# decode


@functools.cache
def _np_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp

    try:
        dtype = np.dtype(jnp.dtype(name))
    except Exception as e:  # noqa: BLE001 - numpy's parser of a peer-sent name raises TypeError,
        # ValueError or even SyntaxError (comma-separated field specs): each is a name it lacks
        raise DtypeUnavailableError(
            f"This process's JAX/ml_dtypes does not know dtype {name!r} (sent by the peer). "
            "Install the same jax and ml_dtypes versions on both sides."
        ) from e
    return dtype  # structured, object or void: refused by _validate, which names the field


def _check_x64(dtype: np.dtype, placement: str) -> None:
    if placement == "host" or dtype.itemsize < 8 or dtype.kind not in "iufc":
        return
    if dtype.kind == "c" and dtype.itemsize < 16:
        return
    if not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        raise DtypeUnavailableError(
            f"Received a {dtype} array but this process has 64-bit types disabled, so JAX would "
            "silently truncate it. Fix: enable them before any JAX computation "
            "(jax.config.update('jax_enable_x64', True) or JAX_ENABLE_X64=1), or receive with "
            "placement='host' to get the exact numpy array."
        )


# Note [validating received metadata]
# ``decode`` trusts nothing it is told: before anything is allocated, ``_validate`` checks every
# field of the metadata against the buffers that arrived (the format version is checked first).
# - dtype: a name this JAX knows (else DtypeUnavailableError) of a type a jax.Array can have:
#   bool, integer, float, complex or an ml_dtypes type, native byte order; never object,
#   string, datetime, structured or void.
# - shape: a tuple of at most _MAX_NDIM non-negative ints whose product (zero dimensions
#   counted as one) stays below 2**62, so no size computation can overflow.
# - weak_type a bool, prng_impl a str or None, the sharding description well-formed.
# - buffers: bytes-like and C-contiguous; exactly one per shard (one when ``indices`` is empty);
#   each exactly the bytes of its shard (or of the whole array), so the declared size is bounded
#   by the bytes that arrived and no more memory is ever reserved than the sender supplied.
# - indices: one (start, stop) pair per dimension with 0 <= start <= stop <= dim, each distinct
#   shard once (the encoder sends each distinct shard once: replicas are never sent twice, so
#   there is nothing to compare), and together an exact tiling of the shape - along each
#   dimension the distinct ranges follow each other from 0 to the dimension's end, and every
#   combination of them is present. Every JAX sharding splits an array into such a grid (uneven
#   shardings included), and an exact tiling means every element of the array assembled from
#   the shards comes from exactly one buffer: no uninitialised memory can reach the caller.
# A failure raises CorruptTransferError naming the field and what is wrong with it. Anything
# JAX itself rejects later (a PRNG implementation unknown here, a sharding that does not fit the
# shape) raises CorruptTransferError too: decode lets no other exception type escape for a bad
# payload.

_MAX_NDIM = 32  # numpy 1's limit (numpy 2 allows 64); no jax.Array comes near it
_MAX_ELEMENTS = 1 << 62


def _corrupt(what: str) -> CorruptTransferError:
    return CorruptTransferError(f"Corrupt transfer: {what}")


def _is_int(v: Any) -> bool:
    return type(v) is int  # what the encoder sends; numpy ints could overflow size arithmetic


@functools.cache
def _array_dtype_ok(dtype: np.dtype) -> bool:
    if not dtype.isnative or dtype.hasobject or dtype.names is not None or dtype.subdtype is not None:
        return False
    if dtype.kind in "biufc":
        return True
    return dtype.kind == "V" and dtype.type.__module__.split(".")[0] == "ml_dtypes"


def _buffer_nbytes(buf: Any, k: int) -> int:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise _corrupt(f"buffer {k} is not C-contiguous")
        return int(buf.nbytes)
    if type(buf) is memoryview and buf.c_contiguous:  # what pickle and Ray hand over
        return buf.nbytes
    try:
        with memoryview(buf) as m:
            if not m.c_contiguous:
                raise _corrupt(f"buffer {k} is not C-contiguous")
            return int(m.nbytes)
    except TypeError:
        raise _corrupt(f"buffer {k} is a {type(buf).__name__}, not a bytes-like object") from None


def _check_tiling(indices: tuple, shape: tuple) -> None:
    ndim = len(shape)
    seen: set = set()
    ranges: list[set] = [set() for _ in shape]
    for k, idx in enumerate(indices):
        if type(idx) is not tuple or len(idx) != ndim:
            raise _corrupt(f"shard {k}'s index {idx!r} is not one (start, stop) pair per dimension of shape {shape}")
        for d, pair in enumerate(idx):
            if (
                type(pair) is not tuple
                or len(pair) != 2
                or type(pair[0]) is not int
                or type(pair[1]) is not int
                or not 0 <= pair[0] <= pair[1] <= shape[d]
            ):
                raise _corrupt(f"shard {k}'s index {idx!r} is outside shape {shape} (dimension {d}: {pair!r})")
            ranges[d].add(pair)
        if idx in seen:
            raise _corrupt(f"shard index {idx} appears twice (each distinct shard is sent once)")
        seen.add(idx)
    tiles = 1
    for d, (pairs, dim) in enumerate(zip(ranges, shape)):
        end = 0
        ordered = sorted(pairs)
        for a, b in ordered:
            if a != end:
                what = "overlap" if a < end else "leave a gap"
                raise _corrupt(
                    f"the shards of shape {shape} {what} along dimension {d} at {min(a, end)} "
                    f"(their ranges there: {ordered})"
                )
            end = b
        if end != dim:
            raise _corrupt(
                f"the shards of shape {shape} stop at {end} along dimension {d} of size {dim} "
                f"(their ranges there: {ordered}): part of the array would be uninitialised"
            )
        tiles *= len(pairs)
    if tiles != len(indices):
        raise _corrupt(
            f"the {len(indices)} shards do not tile shape {shape}: their boundaries make "
            f"{tiles} tiles, so part of the array would be uninitialised"
        )


def _check_sharding_meta(sh: Any) -> None:
    if sh is None:
        return
    ok = type(sh) is tuple and len(sh) >= 1
    kind = sh[0] if ok and type(sh[0]) is str else None
    if kind == "single":
        ok = len(sh) == 4 and isinstance(sh[1], str) and _is_int(sh[2]) and (sh[3] is None or isinstance(sh[3], str))
    elif kind == "named":
        ok = len(sh) == 8
        if ok:
            _, platform, mesh_shape, axis_names, ids, spec, memory_kind, _axis_types = sh
            ok = (
                isinstance(platform, str)
                and type(mesh_shape) is tuple
                and all(_is_int(n) and n > 0 for n in mesh_shape)
                and type(axis_names) is tuple
                and len(axis_names) == len(mesh_shape)
                and all(isinstance(n, str) for n in axis_names)
                and len(set(axis_names)) == len(axis_names)
                and type(ids) is tuple
                and all(_is_int(i) for i in ids)
                and len(ids) == math.prod(mesh_shape)
                and len(set(ids)) == len(ids)
                and isinstance(spec, jax.sharding.PartitionSpec)
                and (memory_kind is None or isinstance(memory_kind, str))
            )
    elif kind == "other":
        ok = len(sh) == 2 and isinstance(sh[1], str)
    else:
        ok = False
    if not ok:
        raise _corrupt(f"the sharding description {sh!r} is malformed")


def _validate(meta: ArrayMeta, buffers: Sequence[Any]) -> np.dtype:
    """Check every field of ``meta`` against ``buffers`` (Note [validating received metadata]);
    returns the numpy dtype. Allocates nothing."""
    if not isinstance(meta.dtype, str):
        raise _corrupt(f"the dtype {meta.dtype!r} is not a dtype name")
    dtype = _np_dtype(meta.dtype)
    if not _array_dtype_ok(dtype):
        raise _corrupt(f"dtype {meta.dtype!r} ({dtype!r}) is not one a jax.Array can have")
    shape = meta.shape
    if type(shape) is not tuple or len(shape) > _MAX_NDIM or not all(_is_int(n) and n >= 0 for n in shape):
        raise _corrupt(f"the shape {shape!r} is not a tuple of at most {_MAX_NDIM} non-negative ints")
    if math.prod(max(int(n), 1) for n in shape) >= _MAX_ELEMENTS:
        raise _corrupt(f"the shape {shape} is impossibly large")
    if not isinstance(meta.weak_type, bool):
        raise _corrupt(f"weak_type {meta.weak_type!r} is not a bool")
    if meta.prng_impl is not None and not isinstance(meta.prng_impl, str):
        raise _corrupt(f"the PRNG implementation {meta.prng_impl!r} is not a name")
    _check_sharding_meta(meta.sharding)
    indices = meta.indices
    if type(indices) is not tuple:
        raise _corrupt(f"the shard indices {indices!r} are not a tuple")
    sizes = [_buffer_nbytes(b, k) for k, b in enumerate(buffers)]
    itemsize = dtype.itemsize
    if not indices:
        if len(sizes) != 1:
            raise _corrupt(f"a whole {dtype} array of shape {shape} comes in 1 buffer, got {len(sizes)}")
        need = math.prod(shape) * itemsize
        if sizes[0] != need:
            raise _corrupt(f"a {dtype} array of shape {shape} needs {need} bytes but {sizes[0]} arrived")
        return dtype
    if len(sizes) != len(indices):
        raise _corrupt(f"{len(indices)} shards are described but {len(sizes)} buffers arrived")
    _check_tiling(indices, shape)
    for k, (idx, n) in enumerate(zip(indices, sizes)):
        need = math.prod(b - a for a, b in idx) * itemsize
        if n != need:
            raise _corrupt(
                f"shard {k} ({idx}) of a {dtype} array of shape {shape} needs {need} bytes but its buffer holds {n}"
            )
    return dtype


def _typed(buf: Any, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """A ``dtype``/``shape`` view of ``buf`` (whose size ``_validate`` checked)."""
    if isinstance(buf, np.ndarray) and buf.dtype == dtype and buf.shape == shape:
        return buf
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    need = math.prod(shape) * dtype.itemsize
    if raw.nbytes != need:  # pragma: no cover - _validate checked it
        raise _corrupt(f"a {dtype} buffer of shape {shape} needs {need} bytes but {raw.nbytes} arrived.")
    return raw.view(dtype).reshape(shape)


def _assemble(meta: ArrayMeta, buffers: Sequence[Any], dtype: np.dtype, aligned: bool = False) -> np.ndarray:
    """The whole array as one host ndarray; a view when a single buffer covers it (``aligned``:
    a copy starts at a 64-byte boundary, so that device_put on CPU aliases it). ``meta`` was
    validated: the shards tile the shape exactly, so the new array is entirely overwritten."""
    if not meta.indices:
        return _typed(buffers[0], dtype, meta.shape)
    if aligned:
        out = _copies.aligned_empty(meta.shape, dtype)
    else:
        out = np.empty(meta.shape, dtype)
    for idx, buf in zip(meta.indices, buffers):
        shard_shape = tuple(b - a for a, b in idx)
        out[tuple(slice(a, b) for a, b in idx)] = _typed(buf, dtype, shard_shape)
    return out


# Note [host to device in pieces]
# ``jax.device_put`` of one large host array is a single transfer; on a TPU v5e (JAX 0.10.2) 256
# MiB of float32 took 43.6 ms, and the same bytes as 8 pieces put at once (one ``device_put`` of
# the list: the transfers overlap) and joined on the chip by one jitted ``concatenate`` 25.8 ms
# (issue 49, another run: whole 46 ms, 8 pieces 26 ms, 32 pieces 22 ms).
# So an array decoded onto the default device (placement "device": ``jt.loads``, the Pool's
# results, the queues) of CHUNKED_MIN bytes and up, of a PIECEWISE type, goes to an accelerator
# that way: its bytes as unsigned integers of its width (the chip moves them and never computes
# on them, as for the other direction: Note [device to host in chunks]), in pieces of about
# H2D_PIECE bytes, at least H2D_PIECES and at most H2D_MAX_PIECES of them (32 at 256 MiB), of
# whole rows of LANES elements where the size allows, joined, viewed back as its type
# (``bitcast_convert_type``) and reshaped on the chip. An array that arrived in pieces (Note
# [pickled in pieces], or the shards of an array split along its first long axis) is put from
# the buffers it arrived in, each cut further where it is larger than a piece: no host copy. The
# result is what ``jax.device_put`` gives: on the default device, uncommitted, weak-typed where
# the sender's was. Costs: one compile per shape, type and cut (cached by jit) and, while it
# runs, the pieces beside the result in device memory (twice the array). On the CPU nothing
# changes: ``device_put`` there aliases an aligned buffer and copies nothing. Arrays over
# H2D_MAX bytes go whole (the pieces' second copy in device memory stays bounded; the gain was
# measured at 256 MiB), and where the device runs out of memory for the pieces or their join,
# the array goes whole instead.
H2D_PIECES = 8
H2D_MAX_PIECES = 32
H2D_PIECE = 8 << 20
H2D_MAX = 1 << 30


def _default_platform() -> str:
    device = getattr(jax.config, "jax_default_device", None)
    if device is None:
        return jax.devices()[0].platform
    return str(getattr(device, "platform", device))


def _pieces_for(nbytes: int, dtype: np.dtype, platform: str | None = None) -> int:
    """How many pieces ``nbytes`` of ``dtype`` go to the device in (``platform``: the default
    device's by default); 0 when they go whole (Note [host to device in pieces])."""
    if (
        not max(CHUNKED_MIN, 1) <= nbytes <= H2D_MAX
        or str(dtype) not in PIECEWISE
        or H2D_PIECES < 2
        or (platform or _default_platform()) == "cpu"
    ):
        return 0
    return min(max(H2D_PIECES, round(nbytes / H2D_PIECE)), max(H2D_MAX_PIECES, H2D_PIECES))


def _piece_count(host: np.ndarray) -> int:
    """How many pieces ``host`` goes to the default device in (Note [host to device in
    pieces]); 0 when it goes whole."""
    if not host.flags.c_contiguous:
        return 0
    return _pieces_for(host.nbytes, host.dtype)


def _row_pieces(meta: ArrayMeta, buffers: Sequence[Any]) -> list[Any] | None:
    """The buffers of a validated ``meta`` in the order of the array's bytes when its shards
    are pieces along one axis (every axis before it of length 1, every other axis whole: Note
    [pickled in pieces]); None otherwise."""
    if len(meta.indices) < 2:
        return None
    axis = _split_axis(meta.shape)
    if axis is None:
        return None
    for idx in meta.indices:
        for d, (a, b) in enumerate(idx):
            if d != axis and (a, b) != (0, meta.shape[d]):
                return None
    order = sorted(range(len(meta.indices)), key=lambda k: meta.indices[k][axis][0])
    return [buffers[k] for k in order]


@functools.cache
def _joiner(shape: tuple, dtype: np.dtype) -> Callable[..., Any]:
    import jax.numpy as jnp
    from jax import lax

    def join(*pieces):
        flat = jnp.concatenate([p.reshape(-1) for p in pieces])
        if flat.dtype != dtype:
            flat = lax.bitcast_convert_type(flat, dtype)
        return flat.reshape(shape)

    return jax.jit(join)


def _put(host: np.ndarray, weak_type: bool) -> Any:
    """``jax.device_put(host)`` weak-typed where asked (``_compat.put_on_default_device``); in
    pieces to an accelerator where :func:`_piece_count` says so."""
    count = _piece_count(host)
    if not count:
        return _compat.put_on_default_device(host, weak_type)
    return _put_in_pieces(host, weak_type, count)


def _put_in_pieces(host: np.ndarray, weak_type: bool, count: int) -> Any:
    """:func:`_put` of ``host`` in ``count`` pieces (Note [host to device in pieces])."""
    return _put_parts([host], host.shape, host.dtype, weak_type, count, lambda: host)


def _cut(parts: Sequence[Any], as_bits: np.dtype, count: int) -> list[np.ndarray]:
    """``parts`` (host buffers holding an array's bytes in order) as pieces of at most about
    1/``count`` of the whole, unsigned integers of ``as_bits``, each reshaped to rows of LANES
    where its size allows: views, no copy."""
    bits = [(p if isinstance(p, np.ndarray) else np.frombuffer(p, np.uint8)).reshape(-1).view(as_bits) for p in parts]
    per = -(-sum(b.size for b in bits) // count)
    per = -(-per // LANES) * LANES if LANES else per
    pieces = []
    for b in bits:
        for start in range(0, b.size, max(per, 1)):
            piece = b[start : start + per]
            pieces.append(piece.reshape(-1, LANES) if LANES and piece.size % LANES == 0 else piece)
    return pieces


def _put_parts(
    parts: Sequence[Any],
    shape: tuple,
    dtype: np.dtype,
    weak_type: bool,
    count: int,
    whole: Callable[[], np.ndarray],
    device: Any = None,
) -> Any:
    """The array whose bytes ``parts`` hold in order, put on the device in pieces at once and
    joined there (Note [host to device in pieces]); on ``device`` (committed) when given, else
    on the default device as ``jax.device_put`` leaves it. Out of device memory: ``whole()``
    put whole."""
    pieces = _cut(parts, PIECEWISE[str(dtype)], count)
    try:
        out = _joiner(tuple(shape), np.dtype(dtype))(*_put_pieces(pieces, device))
    except Exception as e:  # noqa: BLE001 - out of device memory: whole; anything else raises
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        if device is not None:
            return _set_weak_type(jax.device_put(whole(), device), weak_type)
        return _compat.put_on_default_device(whole(), weak_type)
    return _set_weak_type(out, weak_type)


# Note [a result put while it lands]
# A Pool worker's large result reaches a parent on an accelerator in two steps: the worker copies
# it into its slot, then the parent puts it on the device (Note [host to device in pieces]). On a
# TPU v5e host, 256 MiB of float32 in one process: copy (8 threads) then put 31.9 ms, the put
# alone 23.6 ms; putting each quarter's pieces as soon as that quarter was copied, then joining,
# 28.1 ms (eighths 28.6, sixteenths 31.0, 32nds 37.5: each put blocks its caller while it stages
# its pieces, so small groups serialize). So a worker of a pool with placement "device" copies
# an array of LANDING_MIN bytes and up in LANDING_GROUPS parts and says after each but the last
# how far it has landed (``_protocol.Landing``); the parent's manager puts the pieces that lie
# wholly below that mark (:func:`landing_pieces`, :func:`put_landed`) while the worker copies
# the rest, and the result's decode takes those device pieces instead of putting the same host
# pieces again (:func:`landed`, read by :func:`_put_pieces`: a piece is known by its address,
# size, shape and type, so only the very memory that was put matches). The host pieces are views
# of the slot's holder, which the decode then uses too, so the slot is released only once every
# transfer over it is done. Whatever goes wrong in the early puts only loses the overlap: the
# decode puts what is missing, and validates the message as it always does.
LANDING_MIN = 32 << 20
LANDING_GROUPS = 4

_landed = threading.local()


@contextlib.contextmanager
def landed(cache: dict):
    """While active, this thread's :func:`_put_pieces` takes the device pieces of ``cache``
    (:func:`put_landed`'s) for host pieces of the same memory (Note [a result put while it
    lands]); each is used once."""
    outer = getattr(_landed, "cache", None)
    _landed.cache = cache
    try:
        yield
    finally:
        _landed.cache = outer


def _piece_key(p: np.ndarray) -> tuple:
    return (p.__array_interface__["data"][0], p.nbytes, p.shape, p.dtype.str)


def _put_pieces(pieces: list, device: Any) -> list:
    """``jax.device_put(pieces, device)``, with the pieces already put by :func:`put_landed`
    taken from this thread's :func:`landed` cache (the default device only)."""
    cache = getattr(_landed, "cache", None)
    if not cache or device is not None:
        return jax.device_put(pieces, device)
    got = [cache.pop(_piece_key(p), None) for p in pieces]
    rest = [p for p, g in zip(pieces, got) if g is None]
    fresh = iter(jax.device_put(rest) if rest else ())
    return [next(fresh) if g is None else g for g in got]


def landing_pieces(meta: Any, buffer: np.ndarray) -> list[np.ndarray]:
    """The host pieces, views of ``buffer``, that decoding a one-buffer array of ``meta`` onto
    the default device would put (Note [host to device in pieces]); empty where it would put
    the array whole. Raises what decoding would raise for a bad ``meta``."""
    _check_format(meta)
    meta = ArrayMeta(*meta)
    if meta.indices:
        return []
    dtype = _validate(meta, [buffer])
    _check_x64(dtype, "device")
    host = _typed(buffer, dtype, meta.shape)
    count = _piece_count(host)
    return _cut([host], PIECEWISE[str(dtype)], count) if count else []


def put_landed(pieces: list[np.ndarray], cache: dict) -> None:
    """Start putting ``pieces`` on the default device, each kept in ``cache`` for a later
    decode under :func:`landed`."""
    for p, d in zip(pieces, jax.device_put(pieces)):
        cache[_piece_key(p)] = d


def _put_received(meta: ArrayMeta, buffers: Sequence[Any], dtype: np.dtype) -> Any:
    """``decode``'s placement "device" of a validated ``meta``: from the pieces it arrived in
    where they are pieces of the array's bytes bound for an accelerator, else assembled and
    :func:`_put`."""
    parts = _row_pieces(meta, buffers)
    count = _pieces_for(nbytes(meta), dtype) if parts is not None else 0
    if parts is not None and count:
        return _put_parts(parts, meta.shape, dtype, meta.weak_type, count, lambda: _assemble(meta, buffers, dtype))
    return _put(_assemble(meta, buffers, dtype), meta.weak_type)


def _devices_by_id(platform: str) -> dict[int, Any]:
    try:
        return {d.id: d for d in jax.devices(platform)}
    except RuntimeError:
        return {}


def _fallback(reason: str) -> None:
    warnings.warn(
        f"jaxtransport: placement='preserve' fell back to placement='device': {reason}",
        PlacementFallbackWarning,
        stacklevel=3,
    )


def _rebuild_sharding(sharding_meta: tuple | None) -> Any | None:
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    if sharding_meta is None:
        return None
    kind = sharding_meta[0]
    if kind == "single":
        _, platform, dev_id, memory_kind = sharding_meta
        device = _devices_by_id(platform).get(dev_id)
        if device is None:
            _fallback(f"this process has no {platform} device with id {dev_id}.")
            return None
        try:
            return SingleDeviceSharding(device, memory_kind=memory_kind)
        except Exception as e:  # memory kind unknown here
            _fallback(f"cannot place on {device} with memory kind {memory_kind!r}: {e}")
            return None
    if kind == "named":
        _, platform, mesh_shape, axis_names, ids, spec, memory_kind, axis_types = sharding_meta
        available = _devices_by_id(platform)
        missing = [i for i in ids if i not in available]
        if missing:
            _fallback(
                f"the sender's mesh {dict(zip(axis_names, mesh_shape))} uses {platform} devices "
                f"{list(ids)} but this process lacks ids {missing} (it has "
                f"{sorted(available)})."
            )
            return None
        devices = np.array([available[i] for i in ids], dtype=object).reshape(mesh_shape)
        try:
            if axis_types is not None:
                mesh = Mesh(devices, axis_names, axis_types=axis_types)
            else:
                mesh = Mesh(devices, axis_names)
            return NamedSharding(mesh, spec, memory_kind=memory_kind)
        except Exception as e:
            _fallback(f"cannot rebuild NamedSharding(spec={spec}, memory_kind={memory_kind!r}): {e}")
            return None
    _fallback(f"sharding {sharding_meta[1]} is not a NamedSharding or SingleDeviceSharding.")
    return None


def _set_weak_type(x: Any, weak_type: bool) -> Any:
    """``x`` rebuilt weak-typed over the same buffers (Note [weak types] in ``_compat``)."""
    if weak_type and not x.weak_type:
        return _compat.with_weak_type(x)
    return x


def _decode_preserved(meta: ArrayMeta, buffers: Sequence[Any], dtype: np.dtype, sharding: Any):
    try:
        index_map = sharding.addressable_devices_indices_map(meta.shape)
    except Exception as e:
        raise _corrupt(f"the sender's sharding {sharding} does not fit its shape {meta.shape}: {e}") from None
    from jax.sharding import SingleDeviceSharding

    if isinstance(sharding, SingleDeviceSharding) and getattr(sharding, "memory_kind", None) in (None, "device"):
        # one device: an array that arrived in pieces goes to it in pieces (Note [pickled in pieces])
        (device,) = sharding.device_set
        parts = _row_pieces(meta, buffers)
        count = _pieces_for(nbytes(meta), dtype, device.platform) if parts is not None else 0  # type: ignore[attr-defined]
        if parts is not None and count:
            assemble = functools.partial(_assemble, meta, buffers, dtype)
            return _put_parts(parts, meta.shape, dtype, False, count, assemble, device)
    by_index: dict[tuple, np.ndarray] = {}
    if not meta.indices:
        whole = _typed(buffers[0], dtype, meta.shape)
    else:
        whole = None
        for idx, buf in zip(meta.indices, buffers):
            by_index[idx] = _typed(buf, dtype, tuple(b - a for a, b in idx))
    memory_kind = getattr(sharding, "memory_kind", None)
    arrays = []
    for device, index in index_map.items():
        idx = _norm_index(index, meta.shape)
        if idx in by_index:
            data = by_index[idx]
        else:  # one buffer, or the receiver's sharding differs from the sender's shard layout
            if whole is None:
                whole = _assemble(meta, buffers, dtype)
            data = whole[tuple(slice(a, b) for a, b in idx)]
        arrays.append(jax.device_put(data, SingleDeviceSharding(device, memory_kind=memory_kind)))
    return jax.make_array_from_single_device_arrays(meta.shape, sharding, arrays)


def _wrap_key(data: Any, impl: str) -> Any:
    try:
        return _compat.wrap_key_data(data, impl)
    except UnsupportedArrayError as e:
        raise _corrupt(
            f"key data of shape {data.shape} and dtype {data.dtype} is not a key array of PRNG "
            f"implementation {impl!r}: {e}"
        ) from None


def _readable(meta: Any) -> bool:
    """Whether ``meta`` is a meta tuple of a format this release reads (Note [format versions])."""
    return (
        isinstance(meta, tuple)
        and len(meta) == len(ArrayMeta._fields)
        and type(meta[0]) is int
        and OLDEST_FORMAT_VERSION <= meta[0] <= FORMAT_VERSION
    )


def _check_format(meta: Any) -> None:
    if _readable(meta):
        return
    version = meta[0] if isinstance(meta, tuple) and meta else meta
    if isinstance(meta, tuple) and type(version) is int and version > FORMAT_VERSION:
        raise UnsupportedArrayError(
            f"This array was written in jaxtransport array format {version}, by a newer "
            f"jaxtransport release; this one reads formats {OLDEST_FORMAT_VERSION} to "
            f"{FORMAT_VERSION}. Upgrade jaxtransport where it is read."
        )
    raise UnsupportedArrayError(
        f"Unsupported jaxtransport array format {version!r}: not an array meta tuple this "
        f"release reads (formats {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})."
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def _device_errors_explained(fn: _F) -> _F:
    """``fn`` raising :class:`DeviceUnavailableError` (naming the cause and the fix) where the
    runtime says the accelerator is held by another process (``_devices.explain``)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            explained = _devices.explain(e)
            try:
                if explained is not e:
                    raise explained from e
                raise
            finally:
                # No local may keep the exception: its traceback holds this frame, and a
                # cycle through the caller's buffers is freed by the garbage collector while
                # an array may still use them (see tests/_fuzz_decode.py on memoryview tp_clear).
                del explained

    return wrapped  # type: ignore[return-value]


@_device_errors_explained
def decode(meta: ArrayMeta, buffers: Sequence[Any], placement: str = "device") -> Any:
    """Rebuild the array ``encode`` described. See the module docstring for placements.

    Costs: "device" and "host" with one buffer copy nothing on CPU when the buffer is 64-byte
    aligned (else ``device_put`` copies once); sharded arrays (and arrays sent in pieces: Note
    [pickled in pieces]) received as "device"/"host" are assembled with one copy, except pieces
    bound for an accelerator, which are put as they are; "preserve" places each shard on its
    device (no copy on CPU when aligned).
    """
    _check_format(meta)
    meta = ArrayMeta(*meta)
    dtype = _validate(meta, buffers)
    _check_x64(dtype, placement)
    if placement == "host":
        data = _assemble(meta, buffers, dtype)
        if meta.prng_impl is None:
            return data
        return _wrap_key(jax.device_put(data, jax.devices("cpu")[0]), meta.prng_impl)
    if placement == "preserve":
        sharding = _rebuild_sharding(meta.sharding)
        if sharding is not None:
            out = _set_weak_type(_decode_preserved(meta, buffers, dtype, sharding), meta.weak_type)
            if meta.prng_impl is not None:
                out = _wrap_key(out, meta.prng_impl)
            return out
    elif placement != "device":
        check_placement(placement)
    # jax.device_put's result, weak-typed where the sender's was (see _compat).
    out = _put_received(meta, buffers, dtype)
    if meta.prng_impl is not None:
        out = _wrap_key(out, meta.prng_impl)
    return out


@_device_errors_explained
def decoder(meta: ArrayMeta, buffers: Sequence[Any], placement: str = "device") -> Any:
    """A function that returns, at each call, what ``decode(meta, buffers, placement)`` returns:
    a new array each time (a new ``jax.Array``, or a new numpy view for "host"; read-only when
    it is a sharded array's one assembled copy), over the same buffers on CPU. For decoding one
    received array many times: an array placed on the default device or on the host is
    validated (and a sharded one assembled, read-only, unless its pieces go to an accelerator as
    they are: Note [pickled in pieces]) once, and each call costs one ``device_put`` (no copy on
    CPU) or one view; anything else ("preserve", PRNG keys) decodes in
    full at each call. Raises what ``decode`` raises for bad metadata: here for the arrays
    validated once, else at the call."""
    if _readable(meta):
        meta = ArrayMeta(*meta)
        if placement in ("device", "host") and meta.prng_impl is None:
            dtype = _validate(meta, buffers)
            _check_x64(dtype, placement)
            parts = _row_pieces(meta, buffers) if placement == "device" else None
            count = _pieces_for(nbytes(meta), dtype) if parts is not None else 0
            put_once: Callable[[], Any]
            if parts is not None and count:  # pieces bound for an accelerator: put as they are
                whole = functools.cache(functools.partial(_assemble, meta, buffers, dtype))
                put_once = functools.partial(_put_parts, parts, meta.shape, dtype, meta.weak_type, count, whole)
            else:
                host = _assemble(meta, buffers, dtype, aligned=True)
                if meta.indices:
                    host.flags.writeable = False  # shared by every call's array
                if placement == "host":
                    return host.view
                count = _piece_count(host)
                put_once = (
                    functools.partial(_put_in_pieces, host, meta.weak_type, count)
                    if count
                    else _compat.putter_on_default_device(host, meta.weak_type)
                )
            put = _device_errors_explained(put_once)
            if dtype.itemsize < 8:
                return put

            def put_checked():  # 64-bit: x64 may have been turned off since
                _check_x64(dtype, placement)
                return put()

            return put_checked
    return functools.partial(decode, meta, buffers, placement)
