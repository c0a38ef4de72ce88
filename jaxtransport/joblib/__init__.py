"""``jaxtransport.joblib``: joblib with JAX arrays, a parallel backend and a cache.

- :func:`register` adds the ``"jaxtransport"`` parallel backend (``ray.util.joblib.register_ray``'s
  convention): ``joblib.Parallel`` on :class:`jaxtransport.Pool` workers, numpy and JAX arrays
  through shared memory, ``jax.Array`` results back as ``jax.Array``, workers kept warm between
  calls (:func:`shutdown` ends them).
- :class:`Memory`: ``joblib.Memory`` for functions that take and return JAX pytrees: keys that
  understand ``jax.Array`` (the same in every process and run, ``jaxtransport.register()`` or
  not), exact round trips of values, and a ``TracerTransportError`` for a Tracer in the arguments.

Importing :mod:`jaxtransport` never imports joblib; importing this module does (and registers
nothing: call :func:`register`).
"""

from ._backend import JaxTransportBackend, register, shutdown
from ._hashing import hash
from ._memory import Memory

__all__ = ["JaxTransportBackend", "Memory", "hash", "register", "shutdown"]
