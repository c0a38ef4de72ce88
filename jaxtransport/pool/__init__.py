"""``jaxtransport.Pool``: ``multiprocessing.Pool``'s API for JAX, with arrays through shared memory.

The package's files follow the engine's parts (see ``_facade`` for the overview):

- ``_facade``  -- the public ``Pool`` and ``SharedTree``
- ``_state``   -- worker records, scheduling, the manager and feeder threads, crash handling
- ``_wire``    -- what travels through the pipes (pickles + shared-memory entries)
- ``_worker``  -- the worker process's loop
- ``_results`` -- ``AsyncResult``/``MapResult``/``IMapIterator``
- ``_executor`` -- ``Executor``, the ``concurrent.futures`` face over a ``Pool``
"""

import importlib
from typing import TYPE_CHECKING

# Imported on first access (PEP 562): a worker process imports ``jaxtransport.pool._worker``
# without the parent's machinery (and without JAX).
_PUBLIC = {
    "Executor": "._executor",
    "get_reusable_executor": "._executor",
    "shutdown_reusable_executor": "._executor",
    "Pool": "._facade",
    "SharedTree": "._facade",
    "AsyncResult": "._results",
    "IMapIterator": "._results",
    "MapResult": "._results",
}

if TYPE_CHECKING:
    from ._executor import Executor as Executor
    from ._executor import get_reusable_executor as get_reusable_executor
    from ._executor import shutdown_reusable_executor as shutdown_reusable_executor
    from ._facade import Pool as Pool
    from ._facade import SharedTree as SharedTree
    from ._results import AsyncResult as AsyncResult
    from ._results import IMapIterator as IMapIterator
    from ._results import MapResult as MapResult


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncResult",
    "Executor",
    "IMapIterator",
    "MapResult",
    "Pool",
    "SharedTree",
    "get_reusable_executor",
    "shutdown_reusable_executor",
]
