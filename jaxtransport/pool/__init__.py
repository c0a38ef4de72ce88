"""``jaxtransport.Pool``: ``multiprocessing.Pool``'s API for JAX, with arrays through shared memory.

Note [pool engine]
The parts, one concern per module (the public API and what it adds are in ``_facade``)::

  caller threads                  parent: one Engine (_engine)                    worker processes
  --------------                  ----------------------------                    ----------------
  apply_async/map/share           Scheduler (_scheduler): pending chunks,
    prepare + commit  --submit--> each worker's in-flight chunks (pull-based)
    (arrays -> Arena)             dispatch: Task --post--> Sender (_senders) ====> _worker loop
                                                     one thread per worker,  pipe  runs chunks,
  imap feeder thread                                 never blocks the poster       results -> its
    (bounded: in flight                                                            own Arena
     + not consumed)              Manager thread (_manager) <== FrameReader ====== Result/Release/
                                    validates every message (_protocol),           Forget/Ready/..
  result.get() <----------------    completes chunks, replaces dead workers
                                    (_workers), frees trees (_trees)
  callbacks  <--- callback thread (_results.CallbackRunner), for results with callbacks

Threads and what they own:
- caller threads: pickle and copy arguments into the parent's ``_shm.Arena`` (may wait for
  memory), then queue the chunk and dispatch it, under the engine's lock. A map's chunks that
  need no shared memory are queued together; dispatch sends each worker its tasks that need
  no segment or tree in one write (one wakeup of the worker, not one per chunk).
- the manager thread: reads every worker's pipe without blocking, watches process sentinels,
  decodes results, replaces dead workers, passes on releases every ``RELEASE_FLUSH_S``. It never
  writes to a pipe and never runs user code, so no worker and no callback can stall it.
- one sender thread per worker: the only thread that may block writing to that worker (a busy,
  slow or SIGSTOPped worker stalls only its own sender); ``Sender.post`` writes directly when
  the pipe has room and nothing is queued, else queues.
- the callback thread: completes results that have callbacks and runs those callbacks (an
  Executor future without done-callbacks is completed by the manager: setting it runs no user
  code). A worker records the chunk it starts in a shared cell, read when it dies (Note
  [started] in ``_worker``): no message per task for that.
- the imap feeder: submits imap chunks while fewer than ``2 * processes + 2`` are in flight or
  finished and unconsumed.

Locks, in the order they may be taken (never the reverse):
  engine.lock (RLock: scheduler, worker list and records, tree book)
    -> Sender.cond (its queue) / engine.space (imap backpressure) / a result's lock
    -> Lifecycle.lock (flags) -> Arena.cond (slot counts)
Finalizers take none of them: they append to a deque (``Arena.defer_release``,
``TreeBook.queue_release``) that a thread applies later.

Files:
- ``_facade``    -- the public ``Pool``
- ``_engine``    -- the ``Engine``: owns the parts, submit/dispatch, fail/finish, shutdown
- ``_lifecycle`` -- closed/terminated/broken flags under one lock
- ``_scheduler`` -- pending and in-flight chunks, the pull-based assignment rule
- ``_workers``   -- worker records, starting and closing a worker process
- ``_senders``   -- the per-worker sender thread and the non-blocking frame reader
- ``_manager``   -- the manager loop and one handler per message kind
- ``_protocol``  -- every message and entry as a named record, and their validation
- ``_trees``     -- ``SharedTree`` and the lifetime of shared trees
- ``_wire``      -- pickles with large arrays moved to shared memory (encode/decode)
- ``_worker``    -- the worker process's loop
- ``_results``   -- ``AsyncResult``/``MapResult``/``IMapIterator`` and the callback thread
- ``_executor``  -- ``Executor``, the ``concurrent.futures`` face over a ``Pool``
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
    "SharedTree": "._trees",
    "AsyncResult": "._results",
    "IMapIterator": "._results",
    "MapResult": "._results",
}

if TYPE_CHECKING:
    from ._executor import Executor as Executor
    from ._executor import get_reusable_executor as get_reusable_executor
    from ._executor import shutdown_reusable_executor as shutdown_reusable_executor
    from ._facade import Pool as Pool
    from ._trees import SharedTree as SharedTree
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
