"""How user code (functions, classes, jitted functions) travels to and from spawned processes.

Note [user code]
~~~~~~~~~~~~~~~~
``multiprocessing`` with spawn or forkserver re-runs the parent's main script in each child as
``__mp_main__`` (its ``if __name__ == "__main__":`` block skipped) and pickles ``__main__.f`` by
reference, so an initializer, every task and the module's caches share one namespace that lives
as long as the worker. cloudpickle instead copies ``__main__`` functions *by value* with fresh
globals per pickle: an initializer's global is invisible to the tasks, a module-level counter or
cache restarts every task, and a module-level ``jax.jit`` function recompiles every task.
jaxtransport's process transports (the Pool, the Executor, ``jaxtransport.multiprocessing``) use
:class:`Pickler`, which keeps cloudpickle's reach (lambdas, closures, notebooks) with the stock
module semantics:

1. **By reference** when the receiver has the object: a function, class or other named object
   (a ``jax.jit`` wrapper) bound to a top-level name of the main script -- outside the
   ``if __name__ == "__main__":`` block, found by reading the script's syntax tree, since that is
   what the child runs -- travels as "``__main__``'s attribute *name*"
   (``_mainguard.main_attr``). Both ends resolve it in their own main module, as the stock pool
   does, results included.
2. **By value into one namespace** otherwise (``python -c``, notebooks, ``exec``, a lambda or a
   function defined under the main guard): a function whose globals are the main module's goes
   into one namespace per receiving process that persists for its life. In a child running the
   user's script that namespace *is* its script's globals, so by-value and by-reference code
   see the same globals. A global the sender ships is written into the namespace when the
   name is new there, or when the sender rebound it since it last shipped it (a new object);
   otherwise the receiver's value stays (its initializer or its own tasks may have set it).
   The same function object sent again is rebuilt into the *same* function object (a bounded
   cache keyed by a per-sender token that is never reused), so ``jax.jit`` caches keyed on it hit.
   What differs from a stock module: a global object the sender mutates in place is not sent
   again (as with the stock pool, a worker never sees the parent's later changes to its own
   module state).
"""

from __future__ import annotations

import ast
import builtins
import collections
import itertools
import os
import sys
import threading
import types
import weakref
from typing import Any

from ._mainguard import is_main_guard, main_attr, main_script, resolve, script_tree
from ._pickling import _Pickler

__all__ = [
    "MAIN_NAMES",
    "Pickler",
    "code_reduction",
    "importable_main_names",
    "main_reference",
    "registered_by_value",
]

MAIN_NAMES = ("__main__", "__mp_main__")  # what a main script is called: parent, spawned child

# --------------------------------------------------------------------------------------------
# What the receiver's __main__ has: the names the main script binds at top level


def _targets(node: ast.expr, out: set[str]) -> None:
    if isinstance(node, ast.Name):
        out.add(node.id)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            _targets(e, out)
    elif isinstance(node, ast.Starred):
        _targets(node.value, out)


def _bound_names(stmts: list[ast.stmt], out: set[str]) -> None:
    """Names the statements bind when run as a module (the main guard's body excluded)."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(s.name)
        elif isinstance(s, ast.Assign):
            for t in s.targets:
                _targets(t, out)
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            _targets(s.target, out)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for a in s.names:
                if a.name != "*":
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(s, ast.If):
            if not is_main_guard(s.test):
                _bound_names(s.body, out)
            _bound_names(s.orelse, out)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            _targets(s.target, out)
            _bound_names(s.body, out)
            _bound_names(s.orelse, out)
        elif isinstance(s, ast.While):
            _bound_names(s.body, out)
            _bound_names(s.orelse, out)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                if item.optional_vars is not None:
                    _targets(item.optional_vars, out)
            _bound_names(s.body, out)
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            _bound_names(s.body, out)  # type: ignore[attr-defined]
            for h in s.handlers:  # type: ignore[attr-defined]
                if h.name:
                    out.add(h.name)
                _bound_names(h.body, out)
            _bound_names(s.orelse, out)  # type: ignore[attr-defined]
            _bound_names(s.finalbody, out)  # type: ignore[attr-defined]


_names_lock = threading.Lock()
_names_cache: tuple[Any, frozenset[str] | None] = (None, None)


def importable_main_names() -> frozenset[str] | None:
    """The top-level names a spawned child's ``__mp_main__`` binds (None: it runs no script).
    Read once per main module from the script's syntax tree (``_mainguard.script_tree``: one
    parse per process, shared with the main-guard check)."""
    global _names_cache
    main = sys.modules.get("__main__")
    cached_main, names = _names_cache
    if cached_main is main and main is not None:
        return names
    with _names_lock:
        names = None
        path = main_script(main) if main is not None else None
        if path is not None:
            tree = script_tree(path)  # parsed once per process (Pool() read it already)
            if tree is not None:
                found: set[str] = set()
                _bound_names(tree.body, found)
                names = frozenset(found)
        _names_cache = (main, names)
    return names


# The reduction of a by-reference object names ``_mainguard.main_attr`` (a module a pool worker
# imports anyway); ``_main_attr`` is the name pickles written before it moved there use.
_main_attr = main_attr


def main_reference(obj: Any) -> tuple | None:
    """``(main_attr, (name,))`` for an object both ends' ``__main__`` bind under ``name``."""
    try:
        module = obj.__module__
        qualname = obj.__qualname__
    except Exception:
        return None
    if module not in MAIN_NAMES or not isinstance(qualname, str):
        return None
    names = importable_main_names()
    if names is None:
        return None
    main = sys.modules.get("__main__")
    if qualname.split(".", 1)[0] in names:
        try:
            if resolve(main, qualname) is obj:
                return (main_attr, (qualname,))
        except AttributeError:
            pass
    # An alias: `step = jax.jit(_step)` carries the wrapped function's name.
    ns = vars(main)
    for name in names:
        if ns.get(name) is obj:
            return (main_attr, (name,))
    return None


# --------------------------------------------------------------------------------------------
# By value into one namespace per receiving process (Note [user code], 2)

_token_lock = threading.Lock()
_token_counter = itertools.count(1)
_tokens: dict[int, tuple[Any, Any]] = {}  # id(obj) -> (weakref to obj, token)


_sender: tuple[int, bytes] | None = None


def _sender_id() -> tuple[int, bytes]:
    """This process among all senders a receiver hears from: a parent receives from every
    worker, a queue from every producer, and each one's counter starts at 1. The pid alone
    could be reused; the random part tells the processes a forkserver forks apart."""
    global _sender
    pid = os.getpid()
    if _sender is None or _sender[0] != pid:
        _sender = (pid, os.urandom(8))
    return _sender


def _identity_token(obj: Any) -> Any:
    """A token naming this object for as long as it lives, never reused for another object,
    unique across processes. Objects without weak references (dicts, lists) are named by id."""
    key = id(obj)
    with _token_lock:
        entry = _tokens.get(key)
        if entry is not None and entry[0]() is obj:
            return entry[1]
        try:
            ref = weakref.ref(obj, lambda r, key=key: _forget_token(key, r))  # type: ignore[misc]
        except TypeError:
            return ("id", _sender_id(), key)
        token = (_sender_id(), next(_token_counter))
        _tokens[key] = (ref, token)
        return token


def _forget_token(key: int, ref: Any) -> None:
    with _token_lock:
        entry = _tokens.get(key)
        if entry is not None and entry[0] is ref:
            del _tokens[key]


_VALUE_TYPES = (int, float, complex, str, bytes, bool, type(None))


def _value_token(v: Any) -> Any:
    if type(v) in _VALUE_TYPES:
        return (type(v).__name__, v if not isinstance(v, (str, bytes)) or len(v) <= 64 else hash(v))
    return _identity_token(v)


_NS_KEY = "__main__"
_namespaces: dict[str, dict] = {}
_shipped: dict[str, dict[str, Any]] = {}  # namespace -> name -> token of the value last received
_functions: collections.OrderedDict = collections.OrderedDict()  # (namespace, token) -> function
_FUNCTION_CACHE_SIZE = 1024
_receive_lock = threading.RLock()


def _namespace(key: str) -> dict:
    """This process's namespace for by-value code from the sender's ``key`` module."""
    ns = _namespaces.get(key)
    if ns is None:
        main = sys.modules.get("__main__")
        if key == _NS_KEY and main is not None and main.__name__ == "__mp_main__":
            ns = _script_globals(main)  # the user's script, run by spawn/forkserver
        else:
            ns = {"__name__": key, "__builtins__": builtins}
        _namespaces[key] = ns
    return ns


def _script_globals(main: types.ModuleType) -> dict:
    """The globals of the code in a spawned child's ``__mp_main__``. multiprocessing runs the
    script with ``runpy.run_path``, which runs it in a temporary module and copies the result into
    ``__mp_main__``: the script's functions keep the temporary module's dict, and that dict (not
    ``vars(__mp_main__)``) is what their ``global`` statements write to."""
    for v in vars(main).values():
        if isinstance(v, types.FunctionType) and v.__module__ == main.__name__:
            return v.__globals__
        if isinstance(v, type) and v.__module__ == main.__name__:
            for attr in vars(v).values():
                if isinstance(attr, types.FunctionType):
                    return attr.__globals__
    return vars(main)


def _make_function(key: str, token: Any, code: types.CodeType, name: Any, argdefs: Any, closure: Any):
    """The function the sender knows as ``token``: the one built last time when it is still
    the same code, else a new one over the shared namespace."""
    with _receive_lock:
        fn = _functions.get((key, token))
        if fn is not None and fn.__code__ == code and len(fn.__closure__ or ()) == len(closure or ()):
            _functions.move_to_end((key, token))
            return fn
        fn = types.FunctionType(code, _namespace(key), name, argdefs, closure)
        _functions[(key, token)] = fn
        while True:  # not `while len(...) > ...:` (Note [loops that end in a test])
            if len(_functions) <= _FUNCTION_CACHE_SIZE:
                break
            _functions.popitem(last=False)
        return fn


def _set_function_state(fn: types.FunctionType, state: tuple) -> None:
    """cloudpickle's ``_function_setstate`` with the globals merged (Note [user code], 2)."""
    key, tokens, (attrs, slots) = state
    slots = dict(slots)
    fn.__dict__.update(attrs)
    shipped_globals = slots.pop("__globals__", {}) or {}
    cells = slots.pop("__closure__", None)
    slots.pop("_cloudpickle_submodules", None)
    with _receive_lock:
        ns = fn.__globals__
        last = _shipped.setdefault(key, {})
        for k, v in shipped_globals.items():
            token = tokens.get(k)
            if k not in ns or (k in last and last[k] != token):
                ns[k] = v
            last[k] = token
        ns.setdefault("__builtins__", builtins)
    if cells is not None and fn.__closure__ is not None:
        for mine, theirs in zip(fn.__closure__, cells):
            try:
                mine.cell_contents = theirs.cell_contents
            except ValueError:  # an empty cell
                pass
    for k, v in slots.items():
        setattr(fn, k, v)


class Pickler(_Pickler):
    """cloudpickle + jaxtransport's reducers, with ``__main__`` code travelling as the stock
    ``multiprocessing`` module makes it behave (Note [user code])."""

    def reducer_override(self, obj):
        ref = main_reference(obj)
        if ref is not None:
            return ref
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func):
        rv = super()._dynamic_function_reduce(func)
        if func.__globals__.get("__name__") not in MAIN_NAMES:
            return rv
        try:
            _ctor, (code, _base, name, argdefs, closure), (attrs, slots), *_ = rv
        except (TypeError, ValueError):  # a cloudpickle whose reduction has another shape
            return rv
        shipped = slots.get("__globals__") or {}
        tokens = {k: _value_token(v) for k, v in shipped.items()}
        return (
            _make_function,
            (_NS_KEY, _identity_token(func), code, name, argdefs, closure),
            (_NS_KEY, tokens, (attrs, slots)),
            None,
            None,
            _set_function_state,
        )


# --------------------------------------------------------------------------------------------
# cloudpickle's private parts, each probed (``_compat`` holds JAX's and Ray's; these live here,
# beside the Pickler that already follows cloudpickle's reductions, because a Pool worker pickles
# without importing JAX, and ``_compat`` imports it). Upstream: cloudpickle/cloudpickle.py.


def code_reduction(code: types.CodeType) -> tuple | None:
    """cloudpickle's reduction of a code object (its private ``_code_reduce``), or None when this
    cloudpickle has none (the caller then lets cloudpickle reduce the code its own way)."""
    import cloudpickle

    reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)  # private: probe, else default
    return None if reduce is None else reduce(code)


def registered_by_value() -> bool:
    """Whether any module is registered with ``cloudpickle.register_pickle_by_value`` (its private
    ``_PICKLE_BY_VALUE_MODULES``; a cloudpickle without it has no such registration)."""
    import cloudpickle

    return bool(getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", None))
