"""``jaxtransport.joblib.Memory``: ``joblib.Memory`` for functions of JAX pytrees.

What it changes in joblib's cache, and only that:

- keys: the arguments are hashed with :func:`jaxtransport.joblib.hash` (Note [array keys] in
  ``_hashing``) after a search for Tracers (Note [swallowed TypeError]): a Tracer anywhere in
  the arguments raises ``TracerTransportError`` naming the argument and its key path.
- values: every ``jax.Array`` leaf of the result's pytree is stored in jaxtransport's wire
  format, ``_rebuild_array(meta, *buffers)`` (the format ``jaxtransport.dumps`` writes, checked
  against golden files: data at rest stays readable by later releases), with its buffers as
  numpy arrays that joblib writes as it writes any array (and memory-maps with ``mmap_mode``).
  Loading rebuilds it with its dtype, weak type, PRNG key type and, under ``placement=
  "preserve"``, its sharding. Everything else is stored as ``joblib.Memory`` stores it.

Note [store wrapper]
~~~~~~~~~~~~~~~~~~~~
The Memory's store is joblib's local ``FileSystemStoreBackend`` made an :class:`_ArrayStore`
(its subclass: same state and files, ``dump_item`` encodes, ``load_item`` decodes under the
placement). Every function of the Memory and joblib's ``MemorizedResult``
(``call_and_shelve``) use that store, so ``get()`` decodes too. The memorized function is joblib's own
``MemorizedFunc`` (or ``AsyncMemorizedFunc``) with ``_get_args_id`` replaced: joblib's
constructor, cache layout and validation are untouched. It is made by ``joblib.Memory.cache``
(which checks the arguments) and then given a subclass of the same name, so that its repr reads
as joblib's (``MemorizedFunc(func=..., location=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import joblib
import joblib.memory
import numpy as np
from joblib._store_backends import FileSystemStoreBackend
from joblib.func_inspect import filter_args

from .._nojax import check_placement, find_tracer, jax_loaded
from ._hashing import ArrayHasher

__all__ = ["Memory"]


class _StoredArray:
    """A jax.Array on its way to the store: pickles as ``_rebuild_array(meta, *buffers)`` with
    each buffer a flat ``uint8`` numpy array (joblib writes those as arrays, aligned, mmap-able)."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        self.array = array

    def __reduce__(self) -> tuple:
        from .. import _codec
        from .._pickling import rebuild_array

        meta, buffers = _codec.encode(self.array)
        return rebuild_array, (tuple(meta), *[np.ascontiguousarray(b).reshape(-1).view(np.uint8) for b in buffers])


def _encode_tree(output: Any) -> Any:
    if not jax_loaded():
        return output
    import jax

    from .. import _compat

    kinds = tuple(_compat.concrete_array_types())
    try:
        return jax.tree_util.tree_map(lambda leaf: _StoredArray(leaf) if type(leaf) in kinds else leaf, output)
    except Exception:  # noqa: BLE001 - a pytree node whose unflatten validates its leaves
        # Stored as joblib stores anything: its arrays through the pickler's reducer (exact
        # after jaxtransport.register()). Loading never hands a _StoredArray to user code.
        return output


class _ArrayStore(FileSystemStoreBackend):
    """joblib's local store with JAX arrays encoded on the way in and decoded under the Memory's
    placement on the way out (Note [store wrapper])."""

    placement = "device"

    def dump_item(self, call_id: Any, item: Any, verbose: int = 1) -> Any:
        return super().dump_item(call_id, _encode_tree(item), verbose=verbose)

    def load_item(self, call_id: Any, verbose: int = 1, timestamp: Any = None, metadata: Any = None) -> Any:
        from .._pickling import override_placement, restore_placement

        token = override_placement(self.placement)
        try:
            return super().load_item(call_id, verbose=verbose, timestamp=timestamp, metadata=metadata)
        finally:
            restore_placement(token)


def _args_id(self: Any, *args: Any, **kwargs: Any) -> str:
    """The key of one call (``MemorizedFunc._get_args_id``): no Tracer, then the array hasher."""
    filtered = filter_args(self.func, self.ignore, args, kwargs)
    for name, value in filtered.items():
        found = find_tracer(value, name)
        if found is not None:
            from .._tracers import tracer_error

            func = getattr(self.func, "__qualname__", None) or repr(self.func)
            raise tracer_error(
                found[1],
                path=found[0] or name,
                where=(
                    f"argument {name!r} of {func}, cached by jaxtransport.joblib.Memory: a cached "
                    "function cannot be called inside jit/grad/vmap; call it outside the "
                    "transformation, or cache the transformed function's caller instead"
                ),
            )
    return ArrayHasher(hash_name="md5", coerce_mmap=self.mmap_mode is not None).hash(filtered)  # searched above


# Named as joblib's classes: their repr is joblib's ("MemorizedFunc(func=..., location=...)"),
# which formats the class's name; a private name would show in users' logs.
class MemorizedFunc(joblib.memory.MemorizedFunc):
    """joblib's ``MemorizedFunc`` with this Memory's keys (``_args_id``)."""

    _get_args_id = _args_id


class AsyncMemorizedFunc(joblib.memory.AsyncMemorizedFunc):
    """joblib's ``AsyncMemorizedFunc`` with this Memory's keys (``_args_id``)."""

    _get_args_id = _args_id


class Memory(joblib.Memory):
    """``joblib.Memory`` for functions that take and return JAX pytrees (a drop-in subclass).

    ``location``, ``backend`` (joblib's ``"local"`` store only), ``mmap_mode``, ``compress``,
    ``verbose`` and ``backend_options`` are ``joblib.Memory``'s.

    Args:
      placement: where loaded ``jax.Array`` results live: ``"device"`` (default device),
        ``"host"`` (numpy arrays; with ``mmap_mode`` memory-mapped from the cache file) or
        ``"preserve"`` (the stored sharding where these devices exist).

    Keys: ``jax.Array`` arguments are hashed by value, dtype, shape, weak type and PRNG key type
    (:func:`jaxtransport.joblib.hash`), the same in every process and run whether
    ``jaxtransport.register()`` is active or not; everything else as joblib hashes it. A Tracer
    anywhere in the arguments raises :class:`~jaxtransport.TracerTransportError` naming the
    argument's key path, never a silent uncached call.

    Values: each ``jax.Array`` leaf of the result pytree round-trips exactly (every dtype, weak
    types, typed PRNG keys, shardings under ``placement="preserve"``); numpy arrays and other
    objects are stored as joblib stores them (``mmap_mode`` applies to numpy arrays, and to
    ``jax.Array`` leaves loaded with ``placement="host"``). ``jax.Array`` objects below a leaf
    that is not a JAX pytree node (a plain object's attribute) are pickled by joblib as usual.
    """

    def __init__(
        self,
        location: Any = None,
        backend: str = "local",
        mmap_mode: str | None = None,
        compress: bool | int = False,
        verbose: int = 1,
        backend_options: dict | None = None,
        *,
        placement: str = "device",
    ) -> None:
        check_placement(placement)
        super().__init__(
            location=location,
            backend=backend,
            mmap_mode=mmap_mode,
            compress=compress,
            verbose=verbose,
            backend_options=backend_options,
        )
        self.placement = placement
        store = self.store_backend
        if store is not None:
            if type(store) is not FileSystemStoreBackend:
                raise ValueError(
                    f"jaxtransport.joblib.Memory stores JAX arrays in joblib's local store only; "
                    f"backend={backend!r} gives a {type(store).__name__}. Use joblib.Memory for "
                    "other stores (with jaxtransport.register() for exact arrays)."
                )
            store.__class__ = _ArrayStore  # Note [store wrapper]: same state, arrays encoded
            store.placement = placement

    def cache(
        self,
        func: Callable | None = None,
        ignore: list | None = None,
        verbose: int | None = None,
        mmap_mode: str | bool | None = False,
        cache_validation_callback: Callable | None = None,
    ) -> Any:
        """As ``joblib.Memory.cache``: the decorated function's keys and values are those of
        this class (above)."""
        # joblib.Memory.cache checks the arguments (a cache_validation_callback that is not callable
        # raises its ValueError here, with or without func) and, without func, returns a partial of
        # self.cache: this method again, once the decorated function is known.
        memorized = super().cache(
            func,
            ignore=ignore,
            verbose=verbose,
            mmap_mode=mmap_mode,
            cache_validation_callback=cache_validation_callback,
        )
        if isinstance(memorized, joblib.memory.AsyncMemorizedFunc):
            memorized.__class__ = AsyncMemorizedFunc
        elif isinstance(memorized, joblib.memory.MemorizedFunc):
            memorized.__class__ = MemorizedFunc
        # else: a partial (no func yet), or no location: joblib caches and hashes nothing
        return memorized
