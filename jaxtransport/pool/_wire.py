"""What travels through a Pool's pipes: cloudpickle with large arrays moved to shared memory.

``encode(obj, ...)`` pickles ``obj`` with cloudpickle (lambdas, closures, ``__main__`` code) and
jaxtransport's array reducers; every ``jax.Array`` and ``numpy.ndarray`` of at least
``threshold`` bytes, anywhere in ``obj``, is replaced by ``_entry(k)`` and listed as an
*entry*. Only after pickling succeeded (so a Tracer or an unpicklable object fails before any
shared memory is touched) each entry's bytes are copied once into a slot of the sender's
:class:`~jaxtransport._shm.Arena`; an entry that already lives in memory received from the peer
goes back as a ``"ref"`` to the peer's own slot (no copy). ``decode`` rebuilds the object; array
entries alias the received slot (Note [slot lifetime] in ``_shm``).

Entry forms (plain tuples on the wire):
- ``("np", dtype, shape, handle)``
- ``("jax", meta, ((offset, nbytes), ...), handle)`` -- one slot holds all of an array's buffers
- ``("ref", kind, info, handle)`` -- a slot of the *receiver's* own arena, ``kind`` "np"/"jax"
- ``("tree", tree_id)`` -- a SharedTree, defined once per worker
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
from typing import Any, Callable

import numpy as np

from .. import _errors, _pickling, _usercode
from .._errors import ShmHandleError
from .._shm import ALIGN, Arena, Mapper

__all__ = ["prepare", "commit", "encode", "decode", "Encoded", "Prepared"]

_PICKLE_PROTOCOL = 5


class Encoded:
    """A pickled object plus its shared-memory entries. ``handles`` lists the arena slots it
    holds (one reference each, owned by the borrower given to ``encode``)."""

    __slots__ = ("data", "entries", "handles", "trees", "segs")

    def __init__(self, data, entries, handles, trees, segs):
        self.data, self.entries, self.handles, self.trees, self.segs = data, entries, handles, trees, segs


_decoding = threading.local()  # .resolved: the entries of the message being unpickled


def _entry(k: int) -> Any:
    """Reconstructor written into pickles for an object that travelled as entry ``k``."""
    try:
        return _decoding.resolved[k]
    except (AttributeError, IndexError, TypeError):
        raise ShmHandleError(f"Corrupt message: entry {k!r} is not in this message") from None


_encoding = threading.local()  # .router: the _Router of the pickling in progress


class _Router:
    """Per-encode state: which objects go to shared memory (``found``) as ``_entry(k)``."""

    def __init__(self, threshold: int, tree_type: type | None):
        self.threshold = threshold
        self.tree_type = tree_type
        self.found: list[tuple[str, Any]] = []
        self._seen: dict[int, int] = {}
        self.trees: list[Any] = []

    def add(self, kind: str, obj: Any):
        k = self._seen.get(id(obj))
        if k is None:
            k = self._seen[id(obj)] = len(self.found)
            self.found.append((kind, obj))
            if kind == "tree":
                self.trees.append(obj)
        return _entry, (k,)


def _route_np(obj):
    r = _encoding.router
    if obj.nbytes < r.threshold or obj.nbytes == 0 or obj.dtype.hasobject:
        return obj.__reduce_ex__(_PICKLE_PROTOCOL)
    return r.add("np", obj)


def _route_jax(obj):
    r = _encoding.router
    try:
        nb = obj.nbytes
    except Exception:
        nb = 0
    if nb < r.threshold or nb == 0:
        return _pickling._reduce_array(obj)
    return r.add("jax", obj)


def _route_tree(obj):
    r = _encoding.router
    if r.tree_type is None or type(obj) is not r.tree_type:
        return obj.__reduce__()  # refuses with an explanation
    return r.add("tree", obj)


_ROUTES: dict = {}
_ROUTES_JAX = False  # whether _ROUTES has JAX's array types (only once JAX is imported)


def _routes(tree_type: type | None) -> dict:
    global _ROUTES_JAX
    if not _ROUTES:
        _ROUTES[np.ndarray] = _route_np
    if not _ROUTES_JAX and "jax" in sys.modules:  # no jax.Array exists before JAX is imported
        from .. import _codec

        for t in _codec.concrete_array_types():
            _ROUTES[t] = _route_jax
        _ROUTES_JAX = True
    if tree_type is not None and tree_type not in _ROUTES:
        _ROUTES[tree_type] = _route_tree
    return _ROUTES


class _Encoder(_usercode.Pickler):
    """cloudpickle (lambdas, closures; ``__main__`` code as Note [user code] in ``_usercode``
    says) + jaxtransport reducers,
    routed through a :class:`_Router` in ``reducer_override`` (which pickle does not call for
    exact ints, floats, strs, bytes, lists, tuples, dicts and sets)."""

    def __init__(self, file, router: _Router):
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.route = _routes(router.tree_type)

    def reducer_override(self, obj):
        r = self.route.get(type(obj))
        if r is not None:
            return r(obj)
        return super().reducer_override(obj)


class _Fallback(Exception):
    pass


def _refuse_fast(obj):
    raise _Fallback


_TABLE: dict = {}
_TABLE_KEY = None


def _fast_table(tree_type: type | None) -> dict:
    """copyreg's table + the routes + refusing entries for Tracers (the cloudpickle path then
    names them). Rebuilt only when copyreg's table changes size."""
    global _TABLE, _TABLE_KEY
    import copyreg

    jax_loaded = "jax" in sys.modules
    key = (len(copyreg.dispatch_table), tree_type, jax_loaded)
    if key != _TABLE_KEY:
        table = dict(copyreg.dispatch_table)
        if jax_loaded:  # no Tracer exists before JAX is imported
            from .._tracers import tracer_types

            for t in tracer_types():
                table[t] = _refuse_fast
        table.update(_routes(tree_type))
        _TABLE, _TABLE_KEY = table, key
    return _TABLE


def _fast_pickle(obj: Any, router: _Router) -> bytes | None:
    """Plain C pickling (no Python call per object), or None when ``obj`` needs cloudpickle:
    something not picklable by reference (lambdas, closures, local classes) or anything
    referring to ``__main__`` (which a spawned worker may not be able to import)."""
    import cloudpickle

    if getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", None):
        return None
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=_PICKLE_PROTOCOL)
    p.dispatch_table = _fast_table(router.tree_type)
    try:
        p.dump(obj)
    except _pickling.tracer_error_type():
        raise
    except Exception:
        return None
    data = buf.getvalue()
    if b"__main__" in data or b"__mp_main__" in data:
        return None
    return data


class FnBlob:
    """A function pickled once (by ``function_blob``) and embedded in many chunks' pickles.
    Each chunk still unpickles its own copy, as multiprocessing does."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (_load_fn, (self.data,))


def _load_fn(data: bytes) -> Any:
    return pickle.loads(data)


def function_blob(fn: Any, *, threshold: int | None, locate: Callable | None = None) -> Any:
    """``fn`` pickled once for reuse across chunks, or ``fn`` itself when it carries large
    arrays (those must go through shared memory with each chunk)."""
    prep = prepare(fn, threshold=threshold, locate=locate)
    return fn if prep.found else FnBlob(prep.data)


def _pointer(obj: Any) -> int | None:
    try:
        if type(obj) is np.ndarray:
            return obj.__array_interface__["data"][0] if obj.flags.c_contiguous else None
        return obj.unsafe_buffer_pointer()
    except Exception:
        return None


class Prepared:
    """Phase 1 of encoding: the pickle and the large objects it refers to (no shared memory)."""

    __slots__ = ("data", "found", "trees")

    def __init__(self, data, found, trees):
        self.data, self.found, self.trees = data, found, trees


def prepare(obj: Any, *, threshold: int | None, tree_type: type | None = None, locate: Callable | None = None) -> Prepared:
    """Pickle ``obj``, setting aside arrays of at least ``threshold`` bytes (None: none).

    Raises TracerTransportError (with the key path ``locate()`` finds) or the pickling error,
    before any shared memory is touched.
    """
    limit = threshold if threshold is not None else 1 << 62
    outer = getattr(_encoding, "router", None)  # pickling can nest (a reducer that pickles)
    router = _encoding.router = _Router(limit, tree_type)
    try:
        data = _fast_pickle(obj, router)
        if data is not None:
            return Prepared(data, router.found, router.trees)
        router = _encoding.router = _Router(limit, tree_type)
        buf = io.BytesIO()
        try:
            _Encoder(buf, router).dump(obj)
        except _pickling.tracer_error_type() as e:
            path = locate() if (locate is not None and e.path is None) else None
            if path is not None:
                raise _errors.TracerTransportError(e.description, path, where=e.where) from None
            raise
        return Prepared(buf.getvalue(), router.found, router.trees)
    finally:
        _encoding.router = outer


def commit(
    prep: Prepared,
    *,
    arena: Arena | None,
    borrower: Any,
    wait: Callable | None = None,
    peer: Mapper | None = None,
) -> Encoded:
    """Phase 2: copy each set-aside array once into a slot of ``arena`` (one reference held by
    ``borrower``), or name the peer's slot when it already lives there. Cost: one memcpy per
    array. On error, every slot taken so far is released."""
    entries: list[tuple] = []
    handles: list[tuple] = []
    segs: set[int] = set()
    try:
        for kind, x in prep.found:
            if kind == "tree":
                entries.append(("tree", x._tree_id))
                continue
            if peer is not None:
                entry = _as_ref(kind, x, peer)
                if entry is not None:
                    entries.append(entry)
                    continue
            if kind == "np":
                src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
                handle, dst = arena.alloc(src.nbytes, borrower, wait)
                handles.append(handle)
                np.copyto(dst, src.reshape(-1).view(np.uint8))
                entries.append(("np", x.dtype, x.shape, handle))
            else:
                from .. import _codec

                meta, bufs = _codec.encode(x)
                layout, total = [], 0
                for b in bufs:
                    layout.append((total, b.nbytes))
                    total += -(-b.nbytes // ALIGN) * ALIGN
                handle, dst = arena.alloc(max(total, 1), borrower, wait)
                handles.append(handle)
                for (off, n), b in zip(layout, bufs):
                    np.copyto(dst[off : off + n], b.reshape(-1).view(np.uint8))
                entries.append(("jax", tuple(meta), tuple(layout), handle))
            segs.add(handle[0])
    except BaseException:
        for h in handles:
            arena.release(h, borrower)
        raise
    return Encoded(prep.data, entries, handles, prep.trees, segs)


def encode(obj: Any, *, threshold: int | None, arena: Arena | None, borrower: Any, wait=None, peer=None,
           tree_type=None, locate=None) -> Encoded:
    """``commit(prepare(obj))``."""
    return commit(prepare(obj, threshold=threshold if arena is not None else None, tree_type=tree_type, locate=locate),
                  arena=arena, borrower=borrower, wait=wait, peer=peer)


def _as_ref(kind: str, x: Any, peer: Mapper) -> tuple | None:
    """An entry naming the peer's own slot when ``x`` is exactly a live received slot."""
    ptr = _pointer(x)
    if ptr is None:
        return None
    try:
        nb = int(x.nbytes)
    except Exception:
        return None
    h = peer.find(ptr, nb)
    if h is None:
        return None
    if kind == "np":
        return ("ref", "np", (x.dtype, x.shape), h)
    from .. import _codec

    try:
        meta, bufs = _codec.encode(x)
    except Exception:
        return None
    if meta.indices or len(bufs) != 1:
        return None
    return ("ref", "jax", tuple(meta), h)


def materialize(
    entry: tuple,
    mapper: Mapper,
    placement: str,
    own: Callable[[tuple], Any] | None = None,
    trees: Callable[[int], Any] | None = None,
    readonly: bool = False,
) -> Any:
    """One entry as the object it stands for, aliasing its slot (no copy on CPU)."""
    kind = entry[0]
    if kind == "tree":
        if trees is None:
            raise ShmHandleError("Corrupt message: a SharedTree reference where none can be")
        return trees(entry[1])
    if kind == "ref":
        if own is None:
            raise ShmHandleError("Corrupt message: a reference to this process's own memory where none can be")
        holder = own(entry[3])
        if entry[1] == "np":
            return _build("np", entry[2], holder, entry[3], placement, True)
        return _build("jax", (entry[2], ((0, entry[3][2]),)), holder, entry[3], placement, True)
    if kind == "np":
        holder = mapper.holder(entry[3])
        return _build("np", (entry[1], entry[2]), holder, entry[3], placement, readonly)
    if kind == "jax":
        holder = mapper.holder(entry[3])
        return _build("jax", (entry[1], entry[2]), holder, entry[3], placement, True)
    raise ShmHandleError(f"Corrupt message: unknown entry kind {kind!r}")


def _build(sub: str, info: Any, holder: Any, handle: tuple, placement: str, readonly: bool) -> Any:
    raw = np.frombuffer(holder, np.uint8, count=handle[2])
    if readonly:
        raw.flags.writeable = False
    if sub == "np":
        dtype, shape = info
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dtype.itemsize != handle[2]:
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: a {dtype} array of shape {shape} needs "
                f"{count * dtype.itemsize} bytes but the handle covers {handle[2]} (truncated)."
            )
        return raw.view(dtype).reshape(shape)
    meta, layout = info
    bufs = []
    for off, n in layout:
        if off < 0 or off + n > handle[2]:
            raise ShmHandleError(f"Bad shared-memory handle {handle!r}: buffer [{off}, {off + n}) is outside it (truncated)")
        bufs.append(raw[off : off + n])
    from .. import _codec  # the first jax.Array to materialize imports JAX in a Pool worker

    try:
        return _codec.decode(meta, bufs, placement)
    except Exception as e:
        if isinstance(e, _codec.CorruptTransferError):
            raise ShmHandleError(f"Bad shared-memory handle {handle!r}: {e}") from None
        raise


def decode(
    data: bytes,
    entries: list,
    mapper: Mapper,
    placement: str,
    own: Callable | None = None,
    trees: Callable | None = None,
    readonly: bool = False,
) -> Any:
    """Rebuild what ``encode`` made. Every entry's holder is created first (validating every
    handle), so a bad handle fails the whole object and releases the good slots."""
    resolved = []
    for i, e in enumerate(entries):
        try:
            resolved.append(materialize(e, mapper, placement, own, trees, readonly))
        except BaseException as err:
            # The sender still counts a reference for every slot this message carried. Slots
            # wrapped in a holder are released when the holder dies; tell the caller which
            # entries never got one (this one, if its handle was rejected, and all later ones).
            rejected = isinstance(err, ShmHandleError)
            err.unheld = ([i] if rejected else []) + list(range(i + 1, len(entries)))
            raise
    token = _pickling._placement_override.set(placement)
    outer = getattr(_decoding, "resolved", None)
    _decoding.resolved = resolved
    try:
        return pickle.loads(data)
    finally:
        _decoding.resolved = outer
        _pickling._placement_override.reset(token)
