"""What a sender checks before it knows whether JAX is in play, without importing JAX.

A process that never imported JAX holds no ``jax.Array`` and no Tracer, so a Pool, an Executor
or a ``jaxtransport.multiprocessing`` queue whose data is numpy and Python objects never needs
JAX in the parent: the placement names are plain strings, and the search for Tracers returns at
once while ``jax`` is not in ``sys.modules``. JAX is imported only where a JAX object is at
hand (encoding or decoding a ``jax.Array``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ._errors import PlacementError

__all__ = [
    "PICKLE_PROTOCOL",
    "PLACEMENTS",
    "check_placement",
    "find_tracer",
    "find_tracer_in",
    "first_tracer",
    "jax_loaded",
]

PLACEMENTS = ("device", "host", "preserve")
# Every pickle jaxtransport writes: protocol 5 is the one with out-of-band buffers (PEP 574).
# Here, below the codec, so that a Pool worker reads its messages without loading the codec.
PICKLE_PROTOCOL = 5


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise PlacementError(
            f"Unknown placement {placement!r}: use one of {', '.join(map(repr, PLACEMENTS))} "
            "('device': the receiver's default device; 'host': numpy arrays; 'preserve': the "
            "sender's sharding when the receiver has those devices)."
        )
    return placement


def jax_loaded() -> bool:
    """Whether JAX is imported in this process (else no JAX object exists in it). False while
    another thread is still importing it (a Pool worker's background import, ``preload_jax``):
    until that import is done, any code making a JAX object waits for it, so none exists, and
    a numpy-only task need not wait for it either."""
    mod = sys.modules.get("jax")
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


# Objects that hold no Tracer and that the search would only confirm so, by their exact type:
# plain scalars, and what the search treats as opaque (a function is pickled by reference or
# by cloudpickle, which finds a Tracer in its closure while pickling).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex})
_OPAQUE = frozenset({types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType})


def find_tracer(tree: Any, root: str = "") -> tuple[str, Any] | None:
    """``_tracers.find_tracer``: None at once while JAX is not imported (no Tracer exists), and
    for a plain scalar, a function, or a tuple, list or dict of plain scalars (a small task's
    arguments: no walk of JAX's pytrees, dozens of calls, per task)."""
    return find_tracer_in((tree, root))


def find_tracer_in(*pairs: tuple[Any, str]) -> tuple[str, Any] | None:
    """``find_tracer`` of each ``(object, root)`` in turn: the first found, or None (asking
    once whether JAX is imported)."""
    if not jax_loaded():
        return None
    for tree, root in pairs:
        if not _holds_none(tree):
            from ._tracers import find_tracer as find

            found = find(tree, root)
            if found is not None:
                return found[0] or root, found[1]
    return None


def _holds_none(tree: Any) -> bool:
    """True when ``tree`` holds no Tracer by its type alone (see ``_PLAIN``); False: look."""
    kind = type(tree)
    if kind in _PLAIN or kind in _OPAQUE:
        return True
    if kind is tuple or kind is list:
        return len(tree) <= 8 and all(type(x) in _PLAIN for x in tree)
    return kind is dict and len(tree) <= 8 and all(type(v) in _PLAIN for v in tree.values())


def first_tracer(*pairs: tuple[Any, str]) -> str | None:
    """The key path of the first Tracer in ``pairs`` (each an object and the name of its root),
    looking also into a callable's closure cells and defaults; None when there is none (at
    once while JAX is not imported)."""
    for obj, root in pairs:
        found = find_tracer(obj, root)
        if found is not None:
            return found[0] or root
        if callable(obj):  # a closure or defaults holding a tracer: name the captured variable
            code = getattr(obj, "__code__", None)
            cells = getattr(obj, "__closure__", None) or ()
            names = code.co_freevars if code is not None else ()
            for name, cell in zip(names, cells):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                found = find_tracer(value, f"{root}.<closure {name}>")
                if found is not None:
                    return found[0]
            for i, value in enumerate(getattr(obj, "__defaults__", None) or ()):
                found = find_tracer(value, f"{root}.__defaults__[{i}]")
                if found is not None:
                    return found[0]
    return None
