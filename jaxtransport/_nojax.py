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

__all__ = ["PLACEMENTS", "check_placement", "find_tracer", "jax_loaded"]

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
