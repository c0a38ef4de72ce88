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
                                    (_processes), frees trees (_trees)
  callbacks  <--- callback thread (_results.CallbackRunner), for results with callbacks

Threads and what they own (parent process unless said):
- caller threads (any number, also a web handler's or an asyncio loop's executor): pickle and
  copy arguments into the parent's ``_shm.Arena`` (may wait for memory: the arena's wait hook
  runs with no lock held), then queue the chunk and dispatch it, under the engine's lock. A
  map's chunks that need no shared memory are queued together, as one run of pickles that
  become chunks as they are handed out (Note [few objects per waiting chunk]); dispatch sends each worker its
  tasks that need no segment or tree in one write (one wakeup of the worker, not one per chunk).
  A single small chunk on a busy pool is only queued: the manager dispatches it (Note [one task
  on a busy pool] in ``_engine``), so a burst of ``apply_async`` goes out a round at a time.
- the manager thread: reads every worker's pipe without blocking, watches process sentinels,
  decodes results, replaces dead workers, takes unstarted chunks back from a stalled worker
  (Note [taking back a chunk] in ``_worker``), passes on releases every ``RELEASE_FLUSH_S``.
  Per batch of messages it does nothing per worker (the poll set is rebuilt only when the
  workers change, stalls are looked for every ``STALL_CHECK_S``): its cost per task does not
  grow with the number of workers; a run of results leaves the books under one acquisition
  of the engine's lock, its small results are unpickled together, each result object gets
  its chunks of the run in one call (one acquisition of its lock, one wakeup of its waiter),
  and one dispatch follows each round of reads (every worker whose pipe was ready) and each
  wake a caller asked for with a queued chunk.
  It never writes to a pipe and never runs user code, so no worker and no callback can stall it.
- one sender thread per worker: the only thread that may block writing to that worker (a busy,
  slow or SIGSTOPped worker stalls only its own sender); ``Sender.post`` writes directly when
  the pipe has room and nothing is queued, else queues.
- the callback thread: completes results that have callbacks and runs those callbacks (an
  Executor future without done-callbacks is completed by the manager: setting it runs no user
  code). A worker records the chunk it starts in a shared cell, read when it dies (Note
  [started] in ``_worker``): no message per task for that.
- the imap feeder (one per ``imap`` call): submits imap chunks, a batch at a time, while fewer
  than ``2 * processes + 2`` are in flight or finished and unconsumed (8 times as many once the
  results show they need no shared memory, 64 times when no argument needed any either:
  ``Engine.imap_window``); woken when chunks finish
  or are consumed.
- the Executor's dispatcher (``_executor``): moves queued calls to the pool in batches as room
  frees up (one lock acquisition and one write per worker for calls without shared memory);
  after ``shutdown(wait=False)`` a closer thread waits for the calls, then closes the pool.
- the reaper: a pool collected while running is terminated from a thread of its own
  (``terminate_unreferenced``), never inside the finalizer.
- shared-memory threads (``_shm``): ``Arena.reserve`` makes a segment in a thread of its own
  (it takes only ``Arena.cond``, to install it); ``populate`` threads fault pages in for a
  segment being made and take no lock (they are joined under ``Arena.cond``).
- worker processes: the main loop (runs chunks; its arena's wait hook reads the pipe, with no
  lock held), a parent watchdog (no lock), and its arena's reserve/populate threads as above.
  Across processes: ``claim``, the per-worker lock of Note [taking back a chunk] (an unnamed
  process-shared semaphore in shared memory, ``_claim``), which the parent only tries (never
  waits for) and takes holding nothing but the engine's lock.

Locks, in the one order they may be nested (a thread holding one takes only locks further
down; same-rank locks are never held together). ``_lockorder.ORDER`` is this list; the test
suite runs with the lock-order checker on (``JAXTRANSPORT_CHECK_LOCKS``), which fails a test at
the first inversion::

  Executor._lock                      (the executor's queue and counts)
  -> Engine.space                     (imap backpressure: the feeder waits on it)
  -> Engine.lock (RLock)              (scheduler, worker list and records, tree book)
  -> Sender.cond | CallbackRunner.lock | MapResult._lock | IMapIterator._cond
  -> Lifecycle.lock | Pins.lock        (flags; arrays sent again by handle, taken alone)
  -> Arena.cond                       (slot counts)
  -> results._EVENTS_LOCK             (a result's Event)

The rule that keeps it true: no component calls out (a hook, a callback, another component's
locked method) while holding its own lock, except downwards in this list. ``Arena.alloc``
calls its wait hook with ``Arena.cond`` released (Note [no call out under Arena.cond] in
``_shm``); ``Engine.in_flight`` reads the books without the engine's lock (a snapshot for
backpressure), so the imap feeder may read it under ``space``; user callbacks and result
completion run with no pool lock held. Finalizers take none of them: they append to a deque
(``Arena.defer_release``, ``TreeBook.queue_release``) that a thread applies later.

The files, one concern each, are listed once, in the documentation's architecture page
(``docs/architecture.md``, "jaxtransport/pool/ splits the Pool by concern"); the encoder they
share with ``jaxtransport.multiprocessing`` is ``jaxtransport._wire``, one layer below.
"""

import importlib
from typing import TYPE_CHECKING, Any

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
    from ._results import AsyncResult as AsyncResult
    from ._results import IMapIterator as IMapIterator
    from ._results import MapResult as MapResult
    from ._trees import SharedTree as SharedTree


def __getattr__(name: str) -> Any:
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
