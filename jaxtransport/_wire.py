"""What travels through a process transport's pipes: cloudpickle with large arrays moved to shared memory.

Used from above by the Pool (``pool/``: tasks, results, SharedTrees) and by
``jaxtransport.multiprocessing`` (queues and pipes, ``multiprocessing/_sharing``). Its entry points:

- sending, in two steps: :func:`prepare` pickles an object with cloudpickle (lambdas, closures,
  ``__main__`` code) and jaxtransport's array reducers; every ``jax.Array`` and
  ``numpy.ndarray`` of at least ``threshold`` bytes, anywhere in it, is replaced by ``_entry(k)``
  and set aside (a :class:`Prepared`). Only after pickling succeeded (so a Tracer or an
  unpicklable object fails before any shared memory is touched) :func:`commit` copies each
  set-aside array's bytes once into a slot of the sender's :class:`~jaxtransport._shm.Arena`; an
  array that already lives in memory received from the peer goes back as a ``"ref"`` to the
  peer's own slot (no copy). The result, an :class:`Encoded`, is what travels.
- receiving: :func:`decode` rebuilds the object once; :class:`Held` holds the slots of an object
  rebuilt many times (a SharedTree, once per task). Array entries alias the received slot (Note
  [slot lifetime] in ``_shm``). :func:`standalone` makes of a received message one pickle that
  needs no shared memory (its arrays copied in), which :func:`loads` (or any unpickler) rebuilds.
- :func:`function_blob`: a task's function, pickled once for many chunks.

Entries travel as plain tuples ``(kind, *fields)`` and are read back as the records of
``_entries`` (``NpEntry``, ``JaxEntry`` -- one slot holds all of an array's buffers --,
``RefEntry`` -- a slot of the *receiver's* own arena --, ``TreeEntry``), validated on arrival.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _copies, _entries, _errors, _pickling, _usercode
from ._errors import CorruptTransferError, ShmHandleError
from ._nojax import jax_loaded
from ._pickling import PICKLE_PROTOCOL
from ._shm import ALIGN, Handle

if TYPE_CHECKING:
    from ._shm import Arena, Mapper

__all__ = [
    "Encoded",
    "Held",
    "Prepared",
    "commit",
    "decode",
    "function_blob",
    "loads",
    "loads_each",
    "plain",
    "prepare",
    "prepare_calls",
    "standalone",
    "task_function",
]


class Encoded:
    """A pickled object plus its shared-memory entries. ``handles`` lists the arena slots it
    holds (one reference each, owned by the borrower given to ``commit``)."""

    __slots__ = ("data", "entries", "handles", "segs", "trees")

    def __init__(self, data, entries, handles, trees, segs):
        self.data, self.entries, self.handles, self.trees, self.segs = data, entries, handles, trees, segs


_decoding = threading.local()  # .resolved: the entries of the message being unpickled


def _entry(k: int) -> Any:
    """Reconstructor written into pickles for an object that travelled as entry ``k``."""
    try:
        return _decoding.resolved[k]
    except (AttributeError, IndexError, TypeError):
        raise CorruptTransferError(f"Corrupt message: entry {k!r} is not in this message") from None


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
        return obj.__reduce_ex__(PICKLE_PROTOCOL)
    return r.add("np", obj)


def _route_jax(obj):
    r = _encoding.router
    try:
        nb = obj.nbytes
    except Exception:
        nb = 0
    if nb < r.threshold or nb == 0:
        return _pickling.reduce_array(obj)
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
    if not _ROUTES_JAX and jax_loaded():  # no jax.Array exists before JAX is imported
        from . import _codec

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
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.route = _routes(router.tree_type)

    def reducer_override(self, obj):
        r = self.route.get(type(obj))
        if r is not None:
            return r(obj)
        if type(obj) is types.CodeType:
            return _reduce_code(obj)
        return super().reducer_override(obj)


def _reduce_code(code: types.CodeType):
    """cloudpickle's reduction of a code object, keeping its file name (cloudpickle writes
    ``<dynamic-code>``), so a worker's traceback names the file and line, and shows the source
    line when the file is readable there, as multiprocessing.Pool's does."""
    reduced = _usercode.code_reduction(code)
    if reduced is None:
        return NotImplemented
    fn, args = reduced
    return fn, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Fallback(Exception):
    pass


def _refuse_fast(obj):
    raise _Fallback


_TABLES: dict = {}  # tree_type -> (key, table)


def _fast_table(tree_type: type | None) -> dict:
    """copyreg's table + the routes + refusing entries for Tracers (the cloudpickle path then
    names them). One per ``tree_type`` (a function is pickled without, a chunk with), rebuilt
    only when copyreg's table changes size or JAX gets imported."""
    loaded = jax_loaded()
    key = (len(copyreg.dispatch_table), loaded)
    cached = _TABLES.get(tree_type)
    if cached is not None and cached[0] == key:
        return cached[1]
    table = dict(copyreg.dispatch_table)
    if loaded:  # no Tracer exists before JAX is imported
        from ._tracers import tracer_types

        for t in tracer_types():
            table[t] = _refuse_fast
    table.update(_routes(tree_type))
    _TABLES[tree_type] = (key, table)
    return table


def _fast_pickle(obj: Any, router: _Router) -> bytes | None:
    """Plain C pickling (no Python call per object), or None when ``obj`` needs cloudpickle:
    something not picklable by reference (lambdas, closures, local classes) or anything
    referring to ``__main__`` (which a spawned worker may not be able to import)."""
    if _usercode.registered_by_value():
        return None
    data = _pickle_by_reference(obj, router)
    if data is None or _mentions_main(data):
        return None
    return data


# Note [plain data]
# ~~~~~~~~~~~~~~~~~
# An acknowledgement, an action, a step's rewards: most small messages are builtin scalars,
# strings, bytes and small numpy arrays, alone or in a short tuple or list. Nothing in them can
# be a Tracer, name the user's ``__main__``, hold a jax.Array or need shared memory, so
# ``pickle.dumps`` makes exactly the pickle the routed pickler would (an array under the
# threshold is reduced as numpy reduces it there too), without the router, the dispatch table
# and the scan for ``__main__`` (an int's prepare: 10 us before, 1 us with this path on 2 cores).
# Anything else, numpy subclasses and arrays of objects included, takes the general path.
_PLAIN = frozenset((int, float, bool, complex, str, bytes, type(None)))
_PLAIN_ITEMS = 16


def plain_pickle(obj: Any, threshold: int) -> bytes | None:
    """The pickle of ``obj`` if it is plain data (Note [plain data]), else None."""
    if _plain(obj, threshold) or (
        type(obj) in (tuple, list) and len(obj) <= _PLAIN_ITEMS and all(_plain(x, threshold) for x in obj)
    ):
        return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)
    return None


def _plain(x: Any, threshold: int) -> bool:
    """A builtin scalar, string or bytes, or a numpy array (no objects) under ``threshold``."""
    t = type(x)
    return t in _PLAIN or (t is np.ndarray and not x.dtype.hasobject and x.nbytes < threshold)


def _mentions_main(data: bytes) -> bool:
    """Whether ``data`` holds ``__main__`` or ``__mp_main__``. Led by ``find`` of one byte
    (memchr): several times faster than a search for the word on array bytes, where the
    underscore is rare; falls back to that search when underscores are common. A short pickle
    (a small task's) is searched in one go."""
    if len(data) < 4096:
        return b"_main__" in data
    find, i = data.find, data.find(b"_")
    for _ in range(64):
        if i < 0:
            return False
        if data.startswith(b"_main__", i):
            return True
        i = find(b"_", i + 1)
    return i >= 0 and data.find(b"_main__", i) >= 0


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


def _by_reference(fn: Any) -> bool:
    """Whether ``fn`` is a plain function or builtin that pickles as its importable name (a
    module other than ``__main__``): each chunk's C pickler writes that name, as cheaply as
    a blob, and the worker looks it up (no blob to unpickle per chunk)."""
    if type(fn) not in (types.FunctionType, types.BuiltinFunctionType) or _usercode.registered_by_value():
        return False
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str) or module in _usercode.MAIN_NAMES:
        return False
    obj: Any = sys.modules.get(module)
    for part in getattr(fn, "__qualname__", "<").split("."):
        obj = getattr(obj, part, None)
    return obj is fn


class _MainName:
    """A task's function that the main script binds at top level, as it travels: its name,
    which the receiver looks up in its own ``__main__`` (``_usercode.main_reference``, the
    reduction the user-code pickler writes for it). Standing in for the function, it lets the
    C pickler write the task (the fast path refuses anything naming ``__main__``), so a
    function of the user's script costs a task no more than an importable one."""

    __slots__ = ("ref",)

    def __init__(self, ref: tuple):
        self.ref = ref

    def __reduce__(self):
        return self.ref


def task_function(fn: Any) -> Any:
    """``fn`` as a task carries it: a function (or an alias such as ``step = jax.jit(f)``)
    bound at the top level of the main script as its name (:class:`_MainName`), anything else
    as itself. The name is looked up anew for every task, so a rebinding is seen as the
    user-code pickler would see it."""
    global _last_named
    if getattr(fn, "__module__", None) not in _usercode.MAIN_NAMES or _usercode.registered_by_value():
        return fn
    last = _last_named
    if last is not None and last[0] is fn and vars(sys.modules["__main__"]).get(last[1]) is fn:
        return last[2]  # the same function as the last task's, still bound to that name
    ref = _usercode.main_reference(fn)
    if ref is None:
        return fn
    named = _MainName(ref)
    _last_named = (fn, ref[1][0], named)
    return named


_last_named: tuple[Any, str, _MainName] | None = None  # task_function's last (fn, name, result)


def function_blob(fn: Any, *, threshold: int | None, locate: Callable | None = None) -> Any:
    """``fn`` pickled once for reuse across chunks, or ``fn`` itself when it carries large
    arrays (those must go through shared memory with each chunk) or travels by its name (an
    importable one, or the main script's: ``task_function``)."""
    if _by_reference(fn):
        return fn
    named = task_function(fn)
    if named is not fn:
        return named
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


def _pickle_by_reference(obj: Any, router: _Router) -> bytes | None:
    """Standard pickling (functions and classes by reference), with the array routes. None when
    ``obj`` needs the user-code pickler: it holds a Tracer (that path names it) or something it
    cannot pickle by reference (a lambda, a local function: they then travel by value)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)
    p.dispatch_table = _fast_table(router.tree_type)
    try:
        p.dump(obj)
    except _pickling.tracer_error_type():
        raise
    except Exception:
        return None
    return buf.getvalue()


def prefetch(obj: Any) -> None:
    """Start fetching ``obj``'s small accelerator arrays to the host, all at once, before it is
    pickled (Note [fetch every leaf at once] in ``_codec``); nothing before JAX is imported."""
    if jax_loaded():
        from . import _codec

        _codec.prefetch(obj)


def prepare(
    obj: Any,
    *,
    threshold: int | None,
    tree_type: type | None = None,
    locate: Callable | None = None,
    to_parent: bool = False,
) -> Prepared:
    """Pickle ``obj``, setting aside arrays of at least ``threshold`` bytes (None: none).
    Whatever pickles by reference travels by reference; the rest (lambdas, closures, local
    functions such as an optax optimizer's ``chain.<locals>.init_fn``) by value (Note [results
    travel as arguments do]). ``to_parent``: the receiver is the process that spawned the
    sender (a worker's results), whose ``__main__`` is the script a spawned worker runs as
    ``__mp_main__``, so a pickle naming it is sent as is (the C pickler's fast path).

    Raises TracerTransportError (with the key path ``locate()`` finds) or the pickling error,
    before any shared memory is touched.
    """
    limit = threshold if threshold is not None else 1 << 62
    prefetch(obj)
    outer = getattr(_encoding, "router", None)  # pickling can nest (a reducer that pickles)
    router = _encoding.router = _Router(limit, tree_type)
    try:
        data = _pickle_by_reference(obj, router) if to_parent else _fast_pickle(obj, router)
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


# Note [one head, many chunks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A map's chunk is the tuple ``(fn, mode, items)``. Pickled whole, every chunk pays again for
# ``fn``: the pickler looks its module up and checks the name for each one (about half of a
# small chunk's pickling). ``prepare_calls`` pickles ``(fn, mode)`` once and keeps its opcodes
# (the head), then pickles each chunk's ``items`` alone and writes
#
#     PROTO 5 | head | items' opcodes (their PROTO, first FRAME and STOP cut) | TUPLE3 | STOP
#
# which ``pickle.loads`` reads as the tuple the whole pickle would give. The head is used only
# if it stores nothing in the memo and reads nothing from it (its memo opcodes are dropped), so
# the items' memo indices, which count from 0, still mean what they meant. Items whose pickle
# is more than one frame (``_ONE_FRAME``), a head that carries arrays or mentions the main
# script, and items that do, go the way a single chunk goes.
_ONE_FRAME = 60 << 10  # the C pickler cuts frames at 64 KiB: below this, one frame at most
_MEMO_OPS = frozenset(("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"))
_REFUSED_OPS = frozenset(("GET", "BINGET", "LONG_BINGET", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"))


def _call_head(fn: Any, mode: str, tree_type: type | None, limit: int) -> bytes | None:
    """The opcodes that push ``fn`` and ``mode`` (Note [one head, many chunks]), or None."""
    import pickletools

    router = _Router(limit, tree_type)
    outer = getattr(_encoding, "router", None)
    _encoding.router = router
    try:
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)
        p.dispatch_table = _fast_table(tree_type)
        p.dump((fn, mode))
        data = buf.getvalue()
    except Exception:  # noqa: BLE001 - a Tracer or anything unpicklable: the general path names it
        return None
    finally:
        _encoding.router = outer
    if router.found or router.trees or _mentions_main(data):
        return None
    ops = list(pickletools.genops(data))
    names = [op.name for op, _arg, _pos in ops]
    # PROTO, [FRAME], the pushes of fn and mode, TUPLE2, [MEMOIZE], STOP
    if names[0] != "PROTO" or names[-1] != "STOP" or _REFUSED_OPS.intersection(names):
        return None
    head = []
    for k, (op, _arg, pos) in enumerate(ops[:-1]):
        if op.name in _MEMO_OPS or op.name in ("PROTO", "FRAME"):
            continue
        head.append((op.name, data[pos : ops[k + 1][2]]))
    if not head or head[-1][0] != "TUPLE2":
        return None
    return b"".join(raw for _name, raw in head[:-1])


def plain(prep: Prepared) -> Prepared | bytes:
    """``prep``, or its pickle alone when it sets nothing aside (see ``prepare_calls``)."""
    return prep if prep.found or prep.trees else prep.data


def prepare_calls(
    fn: Any, mode: str, parts: list, *, threshold: int | None, tree_type: type | None = None, locates: Any = None
) -> list[Prepared | bytes]:
    """``[prepare((fn, mode, items), ...) for items in parts]`` (``locates[i]`` for
    ``parts[i]``), with one pickler, ``fn`` and ``mode`` pickled once (Note [one head, many
    chunks]) and the checks that do not depend on the items done once: a map's chunks. A
    chunk that sets nothing aside for shared memory is its pickle alone (``bytes``: an object
    the garbage collector does not track, where a map may hold thousands of chunks at once)."""

    def alone(i: int, items: Any) -> Prepared | bytes:  # the way a single chunk goes
        locate = None if locates is None else locates[i]
        return plain(prepare((fn, mode, items), threshold=threshold, tree_type=tree_type, locate=locate))

    prefetch(parts)  # every chunk's small device arrays travel at once
    if len(parts) < 2 or _usercode.registered_by_value():
        return [alone(i, items) for i, items in enumerate(parts)]
    limit = threshold if threshold is not None else 1 << 62
    head = _call_head(fn, mode, tree_type, limit)
    start = b"\x80\x05" + head if head is not None else None  # PROTO 5, then the head
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)
    p.dispatch_table = _fast_table(tree_type)
    tracer_error = _pickling.tracer_error_type()
    out: list[Prepared | bytes] = []
    outer = getattr(_encoding, "router", None)
    router = _Router(limit, tree_type)
    try:
        for i, items in enumerate(parts):
            if router.found:  # one router serves every chunk until one sets something aside
                router = _Router(limit, tree_type)
            _encoding.router = router
            buf.seek(0)
            buf.truncate()
            p.clear_memo()
            data: bytes | None
            try:
                if start is None:
                    p.dump((fn, mode, items))
                    data = buf.getvalue()
                else:
                    p.dump(items)
                    data = buf.getvalue()
                    if len(data) < _ONE_FRAME:
                        # PROTO (2 bytes), FRAME and its length (9) when framed; STOP cut.
                        body = data[11:-1] if data[2] == 0x95 else data[2:-1]
                        data = start + body + b"\x87."  # TUPLE3, STOP
                    else:
                        buf.seek(0)
                        buf.truncate()
                        p.clear_memo()
                        router = _encoding.router = _Router(limit, tree_type)  # anew: whole
                        p.dump((fn, mode, items))
                        data = buf.getvalue()
            except tracer_error:
                raise
            except Exception:
                data = None
                p = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)  # a fresh one after a failure
                p.dispatch_table = _fast_table(tree_type)
            if data is None or _mentions_main(data):
                _encoding.router = outer
                out.append(alone(i, items))
                continue
            out.append(Prepared(data, router.found, router.trees) if router.found else data)
    finally:
        _encoding.router = outer
    return out


def commit(
    prep: Prepared,
    *,
    arena: Arena | None,
    borrower: Any,
    wait: Callable | None = None,
    peer: Mapper | None = None,
    adopt: Callable[[Any, Any], tuple[tuple, Handle | None] | None] | None = None,
    copied: Callable[[Any, tuple, Handle], None] | None = None,
    landing: Callable[[int, tuple, int], None] | None = None,
) -> Encoded:
    """Phase 2: copy each set-aside array once into a slot of ``arena`` (one reference held by
    ``borrower``), or name the peer's slot when it already lives there, or (``adopt``, a
    jax.Array only) send the ``(entry, handle)`` that ``adopt(x, borrower)`` gives for an array
    already in shared memory (None: copy it): ``handle`` a slot it booked in ``arena`` for
    ``borrower`` (Note [forwarded slots] in ``_shm``), released with the others on error, or
    None for memory whose books are the caller's (a queue's leases, given back by the caller).
    ``copied(x, entry, handle)`` is told of each jax.Array copied. ``landing(index, entry,
    upto)`` is told, as a one-buffer host array of ``_codec.LANDING_MIN`` bytes and up (of a
    type that goes to a device in pieces: ``_codec.PIECEWISE``) is copied
    in ``_codec.LANDING_GROUPS`` parts, that the first ``upto`` bytes of entry ``index`` have
    landed in its slot (Note [a result put while it lands] in ``_codec``). Cost: one memcpy per
    array copied. On error, every slot taken so far is released."""
    entries: list[tuple] = []
    handles: list[tuple] = []
    segs: set[int] = set()
    try:
        for kind, x in prep.found:
            if kind == "tree":
                entries.append(("tree", x.tree_id))
                continue
            if peer is not None:
                entry = _as_ref(kind, x, peer)
                if entry is not None:
                    entries.append(entry)
                    continue
            if adopt is not None and kind == "jax":
                got = adopt(x, borrower)
                if got is not None:
                    entry, booked = got
                    entries.append(entry)
                    if booked is not None:  # a slot of the arena's now, as one it made
                        handles.append(booked)
                        segs.add(booked.seg)
                    continue
            if kind == "np":
                src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
                handle, dst = arena.alloc(src.nbytes, borrower, wait)  # type: ignore[union-attr]
                handles.append(handle)
                handle = Handle._make(handle)  # an adapter's arena may hand out plain tuples
                _copies.copy_bytes(src.reshape(-1).view(np.uint8), dst)
                entries.append(("np", x.dtype, x.shape, tuple(handle)))
            else:
                from . import _codec

                meta, bufs = _codec.encode(x, host=False)  # off the CPU: straight into the slot
                layout, total = [], 0
                for b in bufs:
                    n = _codec.host_nbytes(b)
                    layout.append((total, n))
                    total += -(-n // ALIGN) * ALIGN
                handle, dst = arena.alloc(max(total, 1), borrower, wait)  # type: ignore[union-attr]
                handles.append(handle)
                handle = Handle._make(handle)
                entry = ("jax", tuple(meta), tuple(layout), tuple(handle))
                if (
                    landing is not None
                    and len(bufs) == 1
                    and isinstance(bufs[0], np.ndarray)
                    and bufs[0].flags.c_contiguous
                    and layout[0][1] >= _codec.LANDING_MIN
                    and str(bufs[0].dtype) in _codec.PIECEWISE  # the others go to a device whole
                ):
                    index, n = len(entries), layout[0][1]
                    _copies.copy_landing(
                        bufs[0].reshape(-1).view(np.uint8),
                        dst[:n],
                        _codec.LANDING_GROUPS,
                        lambda upto, index=index, entry=entry: landing(index, entry, upto),
                    )
                else:
                    for (off, n), b in zip(layout, bufs):
                        _codec.copy_into(b, dst[off : off + n])
                entries.append(entry)
                if copied is not None:
                    copied(x, entry, handle)
            segs.add(handle.seg)
    except BaseException:
        for h in handles:
            arena.release(h, borrower)  # type: ignore[union-attr,arg-type]
        raise
    return Encoded(prep.data, entries, handles, prep.trees, segs)


def _host_buffer(x: Any) -> tuple[int, int] | None:
    """``(address, nbytes)`` of an array's memory on the host, None when it has none there."""
    ptr = _pointer(x)
    if ptr is None:
        return None
    try:
        return ptr, int(x.nbytes)
    except Exception:
        return None


def _one_buffer_meta(x: Any) -> tuple[tuple, Any] | None:
    """``(meta, buffer)``: the codec's meta of a jax.Array held in one buffer, and that buffer;
    None for several buffers (a sharded array), or one the codec refuses."""
    from . import _codec

    try:
        meta, bufs = _codec.encode(x)
    except Exception:
        return None
    if meta.indices or len(bufs) != 1:
        return None
    return tuple(meta), bufs[0]


def forward_entry(x: Any, lookup: Callable[[int, int], Any], handle_of: Callable[[Any], Handle | None]) -> tuple | None:
    """The entry that sends a jax.Array ``x`` by handle when it is exactly one received slot:
    one buffer on the host at an address where ``found = lookup(address, nbytes)`` is not None,
    ``handle_of(found)`` the handle to name (None: copy it after all). None otherwise."""
    at = _host_buffer(x)
    if at is None:
        return None
    ptr, nbytes = at
    found = lookup(ptr, nbytes)
    got = None if found is None else _one_buffer_meta(x)
    if got is None or _pointer(got[1]) != ptr:
        return None
    handle = handle_of(found)
    if handle is None:
        return None
    return ("jax", got[0], ((0, nbytes),), tuple(handle)), handle


def _as_ref(kind: str, x: Any, peer: Mapper) -> tuple | None:
    """An entry naming the peer's own slot when ``x`` is exactly a live received slot."""
    at = _host_buffer(x)
    h = None if at is None else peer.find(*at)
    if h is None:
        return None
    if kind == "np":
        return ("ref", "np", (x.dtype, x.shape), tuple(h))
    got = _one_buffer_meta(x)
    return None if got is None else ("ref", "jax", got[0], tuple(h))


def materialize(
    entry: Any,  # a parsed entry: one of the records of ``_entries``
    holder: Any,
    placement: str,
    trees: Callable[[int], Any] | None = None,
    readonly: bool = False,
    *,
    again: bool = False,
) -> Any:
    """One parsed entry as the object it stands for, aliasing ``holder`` (no copy on CPU).
    ``again``: instead, a function returning such an object at each call, a new one over the
    same memory each time; what does not change between calls (validation, views, a
    jax.Array's abstract value) is done once, here, which raises for a bad entry."""
    if type(entry) is _entries.TreeEntry:
        if trees is None:
            raise CorruptTransferError("Corrupt message: a SharedTree reference where none can be")
        return functools.partial(trees, entry.tree_id) if again else trees(entry.tree_id)
    if type(entry) is _entries.RefEntry:
        if entry.sub == "np":
            return _build("np", entry.info, holder, entry.handle, placement, True, again)
        return _build("jax", (entry.info, ((0, entry.handle.nbytes),)), holder, entry.handle, placement, True, again)
    if type(entry) is _entries.NpEntry:
        return _build("np", (entry.dtype, entry.shape), holder, entry.handle, placement, readonly, again)
    return _build("jax", (entry.meta, entry.layout), holder, entry.handle, placement, True, again)


def _build(
    sub: str, info: Any, holder: Any, handle: Handle, placement: str, readonly: bool, again: bool = False
) -> Any:
    """The object (``again``: a function returning a new one at each call)."""
    raw = np.frombuffer(holder, np.uint8, count=handle.nbytes)
    if readonly:
        raw.flags.writeable = False
    if sub == "np":
        dtype, shape = info
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise CorruptTransferError(f"Corrupt message: {dtype!r} is not a numpy dtype ({e})") from None
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dtype.itemsize != handle.nbytes:
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: a {dtype} array of shape {shape} needs "
                f"{count * dtype.itemsize} bytes but the handle covers {handle.nbytes} (truncated)."
            )
        out = raw.view(dtype).reshape(shape)
        return out.view if again else out
    meta, layout = info
    bufs = []
    for off, n in layout:
        if off < 0 or n < 0 or off + n > handle.nbytes:
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: buffer [{off}, {off + n}) is outside it (truncated)"
            )
        bufs.append(raw[off : off + n])
    from . import _codec  # the first jax.Array to materialize imports JAX in a Pool worker

    try:
        if not again:
            return _codec.decode(meta, bufs, placement)
        return functools.partial(_decode_again, _codec.decoder(meta, bufs, placement), handle)
    except Exception as e:
        if isinstance(e, _codec.CorruptTransferError):
            raise ShmHandleError(f"Bad shared-memory handle {handle!r}: {e}") from None
        raise


def _decode_again(decode: Callable[[], Any], handle: Handle) -> Any:
    from . import _codec

    try:
        return decode()
    except Exception as e:
        if isinstance(e, _codec.CorruptTransferError):
            raise ShmHandleError(f"Bad shared-memory handle {handle!r}: {e}") from None
        raise


class Held:
    """A received message with its entries parsed, their slots held (one holder per entry,
    every handle validated) and everything that does not change between decodings done once
    (``materialize(..., again=True)``): ``rebuild()`` returns the object as if freshly received, each time.

    Each call unpickles new containers over new numpy views and new ``jax.Array`` objects over
    the same held memory: no copy of the bytes on CPU (an accelerator gets a host-to-device copy
    per call, as for any received array). So deleting one (``donate_argnums``) or changing its
    containers cannot reach another. The slots are released once this ``Held`` and every object
    built over it are gone. Cost per call: one ``device_put`` per jax.Array entry, one view per
    numpy entry, and unpickling the rest.

    Raises ShmHandleError / CorruptTransferError for a bad entry (nothing held then).
    """

    __slots__ = ("data", "holders", "makers", "placement")

    def __init__(
        self,
        data: bytes,
        entries: list,
        mapper: Mapper,
        placement: str,
        *,
        readonly: bool = False,
        own: Callable | None = None,
        trees: Callable | None = None,
    ):
        parsed, holders = _hold(entries, mapper, own, None)
        try:
            makers = [
                materialize(rec, holder, placement, trees, readonly, again=True) for rec, holder in zip(parsed, holders)
            ]
        except BaseException:
            holders.clear()
            makers = None
            raise
        self.data, self.holders, self.makers, self.placement = data, holders, makers, placement

    def rebuild(self) -> Any:
        return _unpickle(self.data, self.placement, (make() for make in self.makers))  # type: ignore[union-attr]


def _hold(
    entries: list, mapper: Mapper, own: Callable | None, unheld: list | None, made: dict | None = None
) -> tuple[list, list]:
    """Every entry parsed and its holder created (validating every handle), so a bad entry fails
    the whole object and the good slots are released with their holders. On failure the indices
    of entries whose slot this process never held (the sender still counts them) are appended to
    ``unheld``."""
    parsed: list = []
    holders: list = []
    try:
        for e in entries:
            rec = _entries.parse_entry(e)
            if type(rec) is _entries.TreeEntry:
                holder = None
            elif type(rec) is _entries.RefEntry:
                if own is None:
                    raise CorruptTransferError(
                        "Corrupt message: a reference to this process's own memory where none can be"
                    )
                holder = own(rec.handle)
            else:
                holder = made.pop(rec.handle, None) if made else None  # type: ignore[union-attr]
                if holder is None:
                    holder = mapper.holder(rec.handle)  # type: ignore[union-attr]
            parsed.append(rec)
            holders.append(holder)
    except BaseException:
        if unheld is not None:
            unheld.extend(range(len(parsed), len(entries)))
        parsed.clear()
        holders.clear()
        holder = None
        raise
    return parsed, holders


def _unpickle(data: bytes, placement: str, objects) -> Any:
    """Unpickle ``data``, its ``_entry(k)`` standing for the k-th of ``objects`` (an iterable
    making each entry's object, consumed here, under ``placement`` as are arrays inside the
    pickle). Nothing here refers to an entry after the call (a traceback must not hold slots)."""
    resolved: list = []
    token = _pickling.override_placement(placement)
    outer = getattr(_decoding, "resolved", None)
    try:
        resolved.extend(objects)
        _decoding.resolved = resolved
        return pickle.loads(data)
    finally:
        _decoding.resolved = outer
        _pickling.restore_placement(token)
        resolved.clear()  # the result refers to what it needs


def decode(
    data: bytes,
    entries: list,
    mapper: Mapper,
    placement: str,
    own: Callable | None = None,
    trees: Callable | None = None,
    readonly: bool = False,
    unheld: list | None = None,
    made: dict | None = None,
) -> Any:
    """Rebuild what ``prepare`` and ``commit`` made (once: ``Held`` rebuilds any number of times). Every entry
    is parsed and its holder created first (validating every handle), so a bad entry fails the
    whole object and the good slots are released with their holders. On failure the indices of
    entries whose slot this process never held (the sender still counts them) are appended to
    ``unheld``; nothing refers to a holder after the call, so the slots go back without waiting
    for the cyclic garbage collector. ``made``: holders already made for some of the slots, by
    handle (each used once: Note [a result put while it lands] in ``_codec``)."""
    parsed, holders = _hold(entries, mapper, own, unheld, made)
    try:
        return _unpickle(
            data,
            placement,
            (materialize(rec, holder, placement, trees, readonly) for rec, holder in zip(parsed, holders)),
        )
    finally:
        holders.clear()
        parsed.clear()


def loads(data: bytes, placement: str) -> Any:
    """Unpickle ``data``, a pickle without shared-memory entries (what :func:`standalone` or
    ``prepare`` made, or any other), its arrays placed under ``placement``. Raises what
    ``pickle.loads`` raises for bytes that are no pickle (``UnpicklingError``, ``EOFError``, ...)."""
    return _unpickle(data, placement, ())


def loads_each(datas: list, placement: str) -> list[tuple[bool, Any]]:
    """:func:`loads` of each of ``datas``: ``(True, the object)`` or ``(False, the exception
    it raised)`` each, under one placement override (a run of results)."""
    out: list[tuple[bool, Any]] = []
    append = out.append
    token = _pickling.override_placement(placement)
    outer = getattr(_decoding, "resolved", None)
    try:
        _decoding.resolved = []  # no entries: an ``_entry(k)`` in one is a corrupt message
        for data in datas:
            try:
                append((True, pickle.loads(data)))
            except BaseException as e:  # noqa: BLE001 - that message's failure only
                tb = e.__traceback__
                # Without this frame (it refers to ``out``, which refers to ``e``: no cycle).
                append((False, e.with_traceback(tb.tb_next if tb is not None else None)))
                del tb
    finally:
        _decoding.resolved = outer
        _pickling.restore_placement(token)
    return out


class _Standalone:
    """A message with its arrays copied in, on its way into a pickle (see :func:`standalone`)."""

    __slots__ = ("data", "objects")

    def __init__(self, data: bytes, objects: list):
        self.data, self.objects = data, objects

    def __reduce__(self):
        return _rebuild_standalone, (self.data, self.objects)


class _JaxBytes:
    """A jax.Array's metadata and buffers (views of a slot) pickled as ``jt.dumps`` pickles
    one, buffers in-band: ``_pickling``'s reducer format, so JAX is not needed to write it."""

    __slots__ = ("buffers", "meta")

    def __init__(self, meta: tuple, buffers: list):
        self.meta, self.buffers = meta, buffers

    def __reduce__(self):
        return _pickling.rebuild_array, (self.meta, *[_pickling.raw(b) for b in self.buffers])


def _rebuild_standalone(data: bytes, objects: list) -> Any:
    """Reconstructor written by :func:`standalone` (its import path is part of those bytes)."""
    return _unpickle(data, _pickling.current_placement(), objects)


def standalone(data: bytes, entries: list, view: Callable[[Handle], Any]) -> bytes:
    """The message ``data`` + ``entries`` as one pickle that needs no shared memory: each array's
    bytes copied in from ``view(handle)`` (a buffer over that slot). ``pickle.loads`` rebuilds
    the object from it wherever jaxtransport is importable (a jax.Array as ``jt.loads`` would,
    placed by the current placement: :func:`loads` sets it). JAX is not imported here. Cost: one
    copy of every array into the bytes. CorruptTransferError / ShmHandleError for a bad entry."""
    objects: list = []
    try:
        for e in entries:
            rec = _entries.parse_entry(e)
            if type(rec) is _entries.NpEntry:
                objects.append(_build("np", (rec.dtype, rec.shape), view(rec.handle), rec.handle, "host", False))
            elif type(rec) is _entries.JaxEntry:
                raw = np.frombuffer(view(rec.handle), np.uint8, count=rec.handle.nbytes)
                bufs = []
                for off, n in rec.layout:
                    if off < 0 or n < 0 or off + n > rec.handle.nbytes:
                        raise ShmHandleError(
                            f"Bad shared-memory handle {rec.handle!r}: buffer [{off}, {off + n}) is outside "
                            "it (truncated)"
                        )
                    bufs.append(raw[off : off + n])
                objects.append(_JaxBytes(tuple(rec.meta), bufs))
            else:
                raise CorruptTransferError(f"Corrupt message: a {type(rec).__name__} where only arrays can be")
        return pickle.dumps(_Standalone(data, objects), protocol=PICKLE_PROTOCOL)
    finally:
        objects.clear()  # no view of the slots outlives the call (the caller may unmap them)
