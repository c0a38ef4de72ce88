"""Reducers for concrete JAX arrays and Tracers; ``register``/``unregister``; ``dumps``/``loads``.

The wire form of an array is ``_rebuild_array(meta, *raw)`` where ``meta`` is a plain tuple
(see ``_codec.ArrayMeta``) and each ``raw`` is one host buffer. Under protocol 5 a buffer is
pickled as a ``PickleBuffer``, so every transport that passes a ``buffer_callback`` (``dumps``
below, Ray, Dask, your socket code) ships the bytes out-of-band without copying them; under
protocol < 5 it travels in-band as ``bytes``. The receiver gets whatever buffer object the
transport hands back (PickleBuffer, memoryview, bytes, bytearray) and the codec validates its
size. The format does not depend on numpy's own pickling (whose module paths differ between
numpy 1 and 2).

``_rebuild_array``'s import path is written into every pickle: keep it stable.
"""

from __future__ import annotations

import contextvars
import copyreg
import io
import pickle
import pickletools
from collections.abc import Callable
from typing import Any, SupportsIndex

import cloudpickle
import numpy as np

from . import _errors
from ._nojax import PICKLE_PROTOCOL, jax_loaded
from ._registry import Registration

# JAX (with _codec and _tracers, which need it) is imported where a JAX object is at hand or
# the caller asked for JAX, never at import: a process that has not imported JAX holds no
# jax.Array and no Tracer, so there is nothing for these reducers to do (a Pool worker running
# numpy-only tasks never imports it).
_JAX_KINDS = None  # (concrete jax.Array types, Tracer base class), once JAX is imported


def _jax_kinds() -> tuple | None:
    """(array types, Tracer) when JAX is imported in this process, else None."""
    global _JAX_KINDS
    if _JAX_KINDS is None and jax_loaded():
        from . import _codec
        from ._tracers import Tracer

        _JAX_KINDS = (frozenset(_codec.concrete_array_types()), Tracer)
    return _JAX_KINDS


class _NoSuchError(Exception):
    """Never raised: what ``except tracer_error_type()`` catches while JAX is not imported."""


def tracer_error_type() -> type[Any]:
    """``TracerTransportError``, without importing JAX to name it where none can be raised."""
    return _errors.TracerTransportError if jax_loaded() else _NoSuchError


__all__ = [
    "current_placement",
    "dumps",
    "is_registered",
    "loads",
    "override_placement",
    "register",
    "restore_placement",
    "unregister",
]

# The process default placement, set by register(); loads(placement=...) overrides it for the
# duration of one call (per thread/context).
_default_placement = "device"
_placement_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxtransport_placement", default=None)

# Our reducers in copyreg.dispatch_table, and what they replaced (restored by unregister()).
_registration = Registration(lambda: copyreg.dispatch_table)


def current_placement() -> str:
    return _placement_override.get() or _default_placement


def override_placement(placement: str | None) -> contextvars.Token:
    """Make ``placement`` (None: the process default) the current one in this thread/context
    until :func:`restore_placement` is called with the token returned (as ``loads`` does)."""
    return _placement_override.set(placement)


def restore_placement(token: contextvars.Token) -> None:
    _placement_override.reset(token)


# --------------------------------------------------------------------------------------------
# reducers (top-level functions: their import paths are part of the wire format)


class _Raw:
    """One host buffer on its way out: out-of-band under protocol 5, in-band bytes below."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        if int(protocol) >= 5:
            return _buffer, (pickle.PickleBuffer(self.array),)  # type: ignore[arg-type]
        return _buffer, (self.array.tobytes(),)


def _buffer(buf: Any) -> Any:
    return buf


def raw(buf: np.ndarray) -> _Raw:
    return _Raw(buf.reshape(-1).view(np.uint8))


def reduce_array(x: Any) -> tuple:
    """copyreg reducer for ArrayImpl and PRNGKeyArray: out-of-band capable, sharding-aware."""
    from . import _codec

    meta, buffers = _codec.encode(x)
    return _rebuild_array, (tuple(meta), *[raw(b) for b in buffers])


def _rebuild_array(meta: tuple, *raw: Any) -> Any:
    from . import _codec

    return _codec.decode(meta, raw, current_placement())  # type: ignore[arg-type]


# The reconstructor that reduce_array writes (its import path is the wire format), for a writer
# that has the metadata and buffers but no jax.Array (_wire.standalone, jaxtransport.joblib's cache).
rebuild_array = _rebuild_array


def _reduce_tracer(t: Any) -> tuple:
    from ._tracers import tracer_error

    raise tracer_error(t, where="while pickling")


# --------------------------------------------------------------------------------------------
# global registration


def register(placement: str = "device") -> None:
    """Make pickle, cloudpickle and multiprocessing use jaxtransport for JAX arrays.

    Installs reducers in ``copyreg.dispatch_table`` (which ``pickle``, ``cloudpickle``,
    multiprocessing's ``ForkingPickler`` and Ray's pickler all consult) for every concrete JAX
    array type, and a refusing reducer for every Tracer type defined now. ``placement`` is how
    this process materializes arrays it unpickles ("device", "host" or "preserve").
    Idempotent: calling it again only updates the placement. Undo with :func:`unregister`.

    A Tracer then raises :class:`TracerTransportError` wherever it is pickled - which, for a
    stock ``multiprocessing.Queue``, is its background feeder thread: ``q.put(tracer)`` returns
    normally, the error is printed from that thread and the item is dropped (the consumer never
    receives it). Call :func:`check_transportable` on the object before ``q.put`` to fail at the
    call site, with the tracer's key path.
    """
    global _default_placement
    from . import _codec
    from ._tracers import tracer_types

    _codec.check_placement(placement)
    with _registration.lock:
        _default_placement = placement
        entries: list[tuple[type, Callable]] = [(t, reduce_array) for t in _codec.concrete_array_types()]
        entries += [(t, _reduce_tracer) for t in tracer_types()]
        _registration.install(entries)


def unregister() -> None:
    """Undo :func:`register`: restore exactly what ``copyreg.dispatch_table`` held before."""
    global _default_placement
    with _registration.lock:
        _registration.restore()
        _default_placement = "device"


def is_registered() -> bool:
    return _registration.active


# --------------------------------------------------------------------------------------------
# dumps / loads


class _Pickler(cloudpickle.Pickler):
    """cloudpickle (lambdas, closures, ``__main__`` code) + jaxtransport's reducers, without
    touching any global table."""

    _array_types = None

    def reducer_override(self, obj: Any) -> Any:
        kinds = _JAX_KINDS or _jax_kinds()
        if kinds is not None:
            if type(obj) in kinds[0]:
                return reduce_array(obj)
            if isinstance(obj, kinds[1]):
                from ._tracers import tracer_error

                raise tracer_error(obj, where="while pickling")
        return super().reducer_override(obj)


def _with_path(err: Any, obj: Any, root: str) -> Any:
    from ._tracers import find_tracer

    if err.path is not None:
        return err
    found = find_tracer(obj, root)
    if found is None:
        return err
    return _errors.TracerTransportError(err.description, found[0] or "<root>", where=err.where)


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj`` (protocol 5, cloudpickle) with array data out-of-band.

    Returns ``(data, buffers)``: ``data`` holds the object graph and array metadata only;
    ``buffers`` are read-only memoryviews of the arrays' host memory (on CPU, the device buffers
    themselves: nothing is copied). Send both; rebuild with ``loads(data, buffers)``. The
    buffers keep the arrays alive until they are released.

    Raises TracerTransportError (with the tracer's key path) if ``obj`` holds a Tracer.
    """
    buffers: list[memoryview] = []

    def callback(pb: pickle.PickleBuffer) -> bool:
        buffers.append(pb.raw())
        return False  # out-of-band

    if jax_loaded():  # the small device arrays' transfers at once (Note [fetch every leaf at once])
        from . import _codec

        _codec.prefetch(obj)
    f = io.BytesIO()
    try:
        _Pickler(f, protocol=PICKLE_PROTOCOL, buffer_callback=callback).dump(obj)
    except tracer_error_type() as e:
        raise _with_path(e, obj, "") from None
    return f.getvalue(), buffers


def loads(data: bytes, buffers: Any = (), *, placement: str | None = None) -> Any:
    """Rebuild what :func:`dumps` produced.

    ``placement`` ("device", "host", "preserve") defaults to the one given to ``register()``,
    else "device". On CPU the arrays alias ``buffers`` where they are 64-byte aligned (no
    copy): do not modify or reuse those buffers while the arrays live.

    Every array's metadata is checked against its buffers before anything is allocated: a
    payload that does not fit (or ``data`` without all of its ``buffers``) raises
    :class:`CorruptTransferError` naming what is wrong. A damaged pickle stream raises what
    ``pickle.loads`` raises. Like any unpickling, ``loads`` runs code named by ``data`` (and
    CPython's unpickler allocates whatever a damaged length field in ``data`` declares): only
    load data from a peer you trust, over a channel that detects corruption.
    """
    if placement:
        from . import _codec

        placement = _codec.check_placement(placement)
    token = override_placement(placement or None)
    try:
        return pickle.loads(data, buffers=buffers)
    except pickle.UnpicklingError as e:
        missing = _missing_buffers(data, buffers)
        if missing is not None:
            raise missing from e
        raise
    finally:
        restore_placement(token)


def _missing_buffers(data: Any, buffers: Any) -> _errors.CorruptTransferError | None:
    """The error to raise when ``data`` refers to more out-of-band buffers than were passed
    (pickle only says "not enough out-of-band buffers"); None when that is not what happened.
    Runs on the error path only: it walks the pickle's opcodes."""
    try:
        wanted = sum(1 for op, _, _ in pickletools.genops(data) if op.name == "NEXT_BUFFER")
        given = len(buffers) if buffers is not None else 0
    except Exception:
        return None
    if wanted <= given:
        return None
    return _errors.CorruptTransferError(
        f"jaxtransport.loads: the data refers to {wanted} out-of-band buffers but "
        f"{given} {'was' if given == 1 else 'were'} passed. Array data travels outside the "
        "pickle: pass the buffers that jaxtransport.dumps returned along with the data, in the "
        "same order: data, buffers = jaxtransport.dumps(obj); ...; "
        "jaxtransport.loads(data, buffers)."
    )
