"""Cache keys for JAX pytrees: ``joblib.hash`` that understands ``jax.Array``.

Note [array keys]
~~~~~~~~~~~~~~~~~
joblib's hasher pickles its argument with a pure-Python ``Pickler`` that consults
``copyreg.dispatch_table``: a ``jax.Array`` is hashed through whatever reducer is registered
there (JAX's own, which copies the array into the pickle stream, or ``jaxtransport.register()``'s),
so ``jaxtransport.register()`` changes every array's key. :class:`ArrayHasher` takes concrete JAX
arrays before any dispatch table is consulted and hashes, as joblib does for numpy, the bytes
themselves (fed to the hash from a view: on CPU the device buffer itself, no copy; elsewhere the
one device-to-host copy the bytes need) plus a small record: a format tag and version, the dtype
name, the shape, the weak type and, for a typed PRNG key, its implementation's canonical name
(the key data's bytes are hashed). The sharding is not part of the key: the same values give the
same key however they are laid out. The record holds only strings, ints and bools, so the key is
the same in every process, run and release that keeps ``KEY_VERSION``.

Note [swallowed TypeError]
~~~~~~~~~~~~~~~~~~~~~~~~~~
joblib's ``Hasher._batch_setitems`` retries a dict's items after a ``TypeError`` (to sort
unorderable keys) and by then an inner dict is in the pickle memo, so an error raised while
hashing a value two dicts deep is lost: a Tracer there (JAX's own ``ConcretizationTypeError``
and ``TracerTransportError`` are ``TypeError``s) is hashed as a memo reference and the cached
call runs uncached. :func:`hash` therefore looks for Tracers before hashing (``find_tracer``,
which also names the key path).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from joblib.hashing import NumpyHasher

from .._nojax import find_tracer, jax_loaded

__all__ = ["KEY_VERSION", "ArrayHasher", "hash"]

# Part of every array's key: bump only with a deliberate, documented key change.
KEY_VERSION = 1
_TAG = "jaxtransport.Array"

_ARRAY_TYPES: frozenset | None = None


def _array_types() -> frozenset:
    global _ARRAY_TYPES
    if _ARRAY_TYPES is None:
        from .. import _compat

        _ARRAY_TYPES = frozenset(_compat.concrete_array_types())
    return _ARRAY_TYPES


def array_record(x: Any) -> tuple[tuple, np.ndarray]:
    """(the record that goes into the key, a host view of the bytes) for a concrete jax.Array."""
    import jax

    from .. import _compat

    prng_impl = None
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        prng_impl = _compat.prng_impl_name(x)
        data = jax.random.key_data(x)
    else:
        data = x
    host = np.asarray(data)  # CPU, one device: a view of the buffer; sharded: the global value
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    record = (
        _TAG,
        KEY_VERSION,
        str(data.dtype),
        tuple(int(d) for d in data.shape),
        bool(getattr(x, "weak_type", False)),
        prng_impl,
    )
    return record, host


class ArrayHasher(NumpyHasher):
    """joblib's ``NumpyHasher``, with concrete JAX arrays hashed by value (Note [array keys])."""

    def save(self, obj: Any) -> None:
        if jax_loaded() and type(obj) in _array_types():
            record, host = array_record(obj)
            self._hash.update(memoryview(host.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
            NumpyHasher.save(self, record)
            return
        NumpyHasher.save(self, obj)


def hash(obj: Any, hash_name: str = "md5", coerce_mmap: bool = False) -> str:
    """``joblib.hash`` for objects holding JAX arrays: the same key for the same values in every
    process and run, whether ``jaxtransport.register()`` is active or not (Note [array keys]).
    Numpy arrays and everything else hash as ``joblib.hash`` hashes them.

    Raises :class:`~jaxtransport.TracerTransportError` naming the key path when ``obj`` holds a
    Tracer anywhere (joblib's own hasher can lose that error: Note [swallowed TypeError]).
    Cost: the array bytes are read once by the hash function, from a view where the array lives
    on the CPU.
    """
    found = find_tracer(obj)
    if found is not None:
        from .._tracers import tracer_error

        raise tracer_error(found[1], path=found[0] or "<root>", where="while computing a cache key")
    return ArrayHasher(hash_name=hash_name, coerce_mmap=coerce_mmap).hash(obj)
