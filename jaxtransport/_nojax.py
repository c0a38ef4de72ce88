"""What a sender checks before it knows whether JAX is in play, without importing JAX.

A process that never imported JAX holds no ``jax.Array`` and no Tracer, so a Pool, an Executor
or a ``jaxtransport.multiprocessing`` queue whose data is numpy and Python objects never needs
JAX in the parent: the placement names are plain strings, and the search for Tracers returns at
once while ``jax`` is not in ``sys.modules``. JAX is imported only where a JAX object is at
hand (encoding or decoding a ``jax.Array``).
"""

from __future__ import annotations

import sys
from typing import Any

from ._errors import PlacementError

__all__ = ["PLACEMENTS", "check_placement", "find_tracer", "first_tracer", "jax_loaded"]

PLACEMENTS = ("device", "host", "preserve")


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


def find_tracer(tree: Any, root: str = "") -> tuple[str, Any] | None:
    """``_tracers.find_tracer``: None at once while JAX is not imported (no Tracer exists)."""
    if not jax_loaded():
        return None
    from ._tracers import find_tracer as find

    return find(tree, root)


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
