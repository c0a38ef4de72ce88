"""``jaxtransport.Pool``: ``multiprocessing.Pool``'s API for JAX, with arrays through shared memory.

The package's files follow the engine's parts (see ``_facade`` for the overview):

- ``_facade``  -- the public ``Pool`` and ``SharedTree``
- ``_state``   -- worker records, scheduling, the manager and feeder threads, crash handling
- ``_wire``    -- what travels through the pipes (pickles + shared-memory entries)
- ``_worker``  -- the worker process's loop
- ``_results`` -- ``AsyncResult``/``MapResult``/``IMapIterator``
- ``_executor`` -- ``Executor``, the ``concurrent.futures`` face over a ``Pool``
"""

from ._executor import Executor as Executor
from ._executor import get_reusable_executor as get_reusable_executor
from ._executor import shutdown_reusable_executor as shutdown_reusable_executor
from ._facade import Pool as Pool
from ._facade import SharedTree as SharedTree
from ._results import AsyncResult as AsyncResult
from ._results import IMapIterator as IMapIterator
from ._results import MapResult as MapResult

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
