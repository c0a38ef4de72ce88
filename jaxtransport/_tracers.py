"""Finding Tracers in user data before they are sent, and describing them well.

``check_transportable`` walks a pytree with key paths (``jax.tree_util`` for everything JAX
knows as a pytree: dicts, lists, tuples, namedtuples, registered dataclasses, equinox modules)
and, below the leaves, plain Python containers and objects that pickle would walk too (sets,
``__dict__`` and ``__slots__`` attributes: flax.linen modules, plain dataclasses). It stops at
the first Tracer and raises :class:`TracerTransportError` naming its key path.

Cost: one pass over the tree's containers; arrays are not read.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from . import _compat
from ._errors import TracerTransportError

__all__ = ["check_transportable", "describe_tracer", "find_tracer", "tracer_error", "tracer_types"]


Tracer = _compat.tracer_base()


def tracer_types() -> list[type]:
    """Every Tracer class currently defined (jit, grad, vmap, shard_map, ... and user ones)."""
    _compat.import_tracer_modules()  # modules that define Tracer subclasses lazily
    seen: list[type] = []
    stack = [Tracer]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen


# Trace class name -> the user-facing transformation it implements.
_TRACE_NAMES = {
    "BatchTrace": "vmap",
    "JVPTrace": "jvp/grad",
    "LinearizeTrace": "grad/linearize",
    "JaxprTrace": "partial evaluation (grad, linearize or remat)",
    "ShardMapTrace": "shard_map",
    "RewriteTrace": "shard_map",  # shard_map's replication checker (jax < 0.5)
    "RematTrace": "remat/checkpoint",
    "CheckifyTrace": "checkify",
}


def _transformation(tracer: Any) -> str:
    name, traced_for, src = _compat.tracer_trace_info(tracer)
    if name == "DynamicJaxprTrace":
        if traced_for is None and src is None:
            return "jit (or another staging transformation: scan, cond, while_loop)"
        return f"{traced_for} of {src}" if src else str(traced_for)
    for key, label in _TRACE_NAMES.items():
        if name.startswith(key):
            return label
    return f"an unknown transformation ({name})"


def describe_tracer(tracer: Any) -> str:
    """``'f32[3,4] tracer (weak_type) from jit of f at x.py:12'``-style summary."""
    aval = getattr(tracer, "aval", None)
    try:
        shape = _compat.tracer_aval_str(aval)
    except Exception:
        shape = str(aval) if aval is not None else "<unknown shape>"
    weak = " (weak_type)" if getattr(aval, "weak_type", False) else ""
    return f"{type(tracer).__name__} {shape}{weak} traced by {_transformation(tracer)}"


def tracer_error(tracer: Any, path: str | None = None, where: str | None = None) -> Exception:
    return TracerTransportError(describe_tracer(tracer), path, where=where)


# --------------------------------------------------------------------------------------------
# The walk

_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _walk_object(obj: Any, path: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """Walk what JAX's pytree flattening leaves opaque; yields (path, tracer)."""
    if isinstance(obj, Tracer):
        yield path, obj
        return
    if isinstance(obj, _ATOMIC) or isinstance(obj, _OPAQUE) or isinstance(obj, jax.Array):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (set, frozenset)):
        for item in obj:
            yield from _walk_object(
                item, f"{path}{{{item!r}}}" if not isinstance(item, Tracer) else f"{path}{{...}}", seen
            )
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_object(v, f"{path}[{k!r}]", seen)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk_object(v, f"{path}[{i}]", seen)
        return
    # Below here: an object that pytree flattening treats as a leaf. Look at what pickle
    # would look at by default, its __dict__ and __slots__, without calling user code.
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _walk_pytree(v, f"{path}.{k}", seen)
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), (tuple, list)) else ():
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                v = object.__getattribute__(obj, slot)
            except Exception:
                continue
            yield from _walk_pytree(v, f"{path}.{slot}", seen)


def _walk_pytree(tree: Any, root: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Tracer):
        yield root, tree
        return
    if isinstance(tree, _ATOMIC) or isinstance(tree, jax.Array):
        return
    try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    except Exception:  # e.g. a dict with unsortable keys: fall back to the plain walk
        yield from _walk_object(tree, root, seen)
        return
    if len(leaves) == 1 and not leaves[0][0] and leaves[0][1] is tree:
        # ``tree`` is itself a leaf for JAX: look inside it as pickle would.
        yield from _walk_object(tree, root, seen)
        return
    for key_path, leaf in leaves:
        yield from _walk_pytree(leaf, root + jax.tree_util.keystr(key_path), seen)


def find_tracer(tree: Any, root: str = "") -> tuple[str, Any] | None:
    """The first ``(key_path, tracer)`` in ``tree``, or ``None`` when there is none."""
    for found in _walk_pytree(tree, root, set()):
        return found
    return None


def check_transportable(tree: Any, *, root: str = "") -> None:
    """Raise :class:`TracerTransportError` if ``tree`` holds a Tracer anywhere.

    The error names the tracer's key path (``"['params']['w']"``, prefixed with ``root``),
    its shape and dtype and the transformation that traced it. Returns ``None`` otherwise.
    """
    found = find_tracer(tree, root)
    if found is not None:
        path, tracer = found
        raise tracer_error(tracer, path or "<root>")
