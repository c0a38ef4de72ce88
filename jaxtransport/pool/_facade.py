"""``jaxtransport.Pool``: multiprocessing.Pool's API for JAX, with arrays through shared memory.

What it adds to ``multiprocessing.Pool`` (see each docstring for the costs):

- Functions, lambdas and closures travel with cloudpickle; ``__main__`` code keeps the stock
  pool's module semantics (one namespace per worker shared by the initializer and every task:
  Note [user code] in ``_usercode``). Workers are started with ``spawn`` (default) or ``forkserver``: ``fork`` deadlocks a
  process that has JAX initialised and is refused. Workers start with
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, the parent's ``JAX_PLATFORMS`` and, on multi-GPU
  hosts, their own ``CUDA_VISIBLE_DEVICES``.
- Every ``jax.Array``/``numpy.ndarray`` of at least ``shm_threshold`` bytes anywhere in the
  arguments or results is copied once into recycled shared memory (``_shm``, Note [shared memory
  design]); only a handle goes through the pipe, and a CPU receiver's array aliases it (Note
  [slot lifetime]). ``share(tree)`` broadcasts a tree once to any number of tasks and workers.
- A Tracer in the arguments raises TracerTransportError in the caller, naming its key path,
  before any shared memory is touched or any task is sent.
- A worker that dies mid-task (SIGKILL, OOM killer, ``os._exit``) fails that task with
  WorkerLostError instead of hanging (python/cpython#66587); the pool replaces the worker.
  Nothing is left behind: memfd segments have no name in /dev/shm, workers exit with their parent.

The parent runs two daemon threads per pool: a *manager* (reads results, watches worker
sentinels, schedules chunks, replaces dead workers) and a *feeder* (the only writer to worker
pipes, so a large message never blocks result reading). At most two chunks are in flight per
worker; when a worker dies, the chunk it was running fails and the one queued behind it is
requeued.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import weakref
from typing import Any, Callable, Iterable

from .. import _codec, _procenv, _shm
from . import _wire
from .._errors import PoolStateError
from ._results import AsyncResult, IMapIterator, MapResult
from ._state import _first_tracer, _locator, _State, _terminate_unreferenced, _TreeRec

__all__ = ["Pool", "SharedTree", "AsyncResult", "MapResult", "IMapIterator"]

class SharedTree:
    """A pytree whose arrays were copied once into a Pool's shared memory (``Pool.share``).

    Pass it anywhere inside task arguments, to any number of tasks: only a small id travels, and
    in the worker it unpickles as the tree itself (arrays aliasing the shared copy on CPU,
    read-only), materialized once per worker and cached until :meth:`release` or pool close.
    The memory is freed when it is released and every worker has dropped it. Also a context
    manager (releases on exit) and released automatically when garbage-collected.

    Attributes: ``tree`` (the parent's original tree), ``nbytes`` (bytes in shared memory).
    """

    def __init__(self, state: _State, rec: _TreeRec, tree: Any):
        self._state = state
        self._rec = rec
        self._tree_id = rec.tree_id
        self.tree = tree
        # Garbage collection only queues the release (it may run while this thread holds the
        # pool's locks); the manager thread applies it. release() applies it at once.
        self._finalizer = weakref.finalize(self, state.queue_tree_release, rec)

    @property
    def nbytes(self) -> int:
        return self._rec.nbytes

    @property
    def released(self) -> bool:
        return self._rec.released

    def release(self) -> None:
        """Stop using this tree: workers drop their cached copy, and the shared memory is freed
        once every worker has dropped its arrays. Tasks already submitted still see it.
        Calling it again is harmless."""
        if self._finalizer.detach() is not None:
            self._state.release_tree(self._rec)

    def __enter__(self) -> "SharedTree":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __reduce__(self):
        raise PoolStateError(
            "A SharedTree only travels as (part of) an argument of its own jaxtransport.Pool's "
            "tasks; it cannot be pickled otherwise. Pass shared.tree to send the tree itself."
        )

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"<jaxtransport.SharedTree {self._tree_id} ({_shm._fmt(self.nbytes)} shared, {state})>"


class Pool:
    """A process pool with ``multiprocessing.Pool``'s API for functions that take and return
    JAX arrays. See the module docstring for what it adds; costs below.

    Args:
      processes: number of workers (default: the CPUs this process may use).
      initializer, initargs: ``initializer(*initargs)`` runs in each worker at start (cloudpickled).
        If it raises, the pool is broken and pending calls raise PoolStateError.
      maxtasksperchild: a worker is replaced after this many task *chunks* (as multiprocessing).
      start_method: "spawn" (default) or "forkserver". "fork" is refused.
      shm_threshold: arrays (jax.Array, numpy.ndarray) of at least this many bytes travel through
        shared memory (one copy by the sender, none by a CPU receiver); smaller ones inline in the
        pickle.
      placement: how received jax arrays materialize, in workers and for results: "device"
        (default device), "host" (numpy) or "preserve" (the sender's sharding when available).
      worker_env: environment variables for the workers, overriding the defaults
        (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, the parent's ``JAX_PLATFORMS``, per-worker
        ``CUDA_VISIBLE_DEVICES`` on multi-GPU hosts); a value of None unsets a variable.
      shm_capacity: cap in bytes on the recycled shared memory of each sending process (the
        parent for arguments and shared trees, each worker for its results). Default: half the
        free memory. When reached, a sender waits for receivers to drop arrays, then raises
        ShmCapacityError.
      devices_per_worker: GPUs per worker on multi-GPU hosts (default 1), assigned round-robin.
      shm_reserve: bytes of shared memory to make ready while the workers start, so that the
        first large transfers pay no page faults: an int ``n`` reserves one slot for an array of
        up to ``n`` bytes in the parent (task arguments) and one in each worker (results); a
        pair ``(arguments, results)`` sizes them apart (0 skips a side). Arrays up to twice
        smaller use the same slot, larger ones grow it. Memory cost, held until the pool ends:
        ``arguments + processes * results`` bytes, rounded up to the next size class (at most
        25% more), allocated at once (a new 4 KiB page costs ~1 s/GiB to fault in, on threads
        off your call's path). Within shm_capacity, else ValueError; a system without the
        memory raises ShmCapacityError from the first call that needs memory.

    Received arrays alias shared memory that returns to the sender's pool only when the last
    reference to them (and to anything derived from their buffer) is gone. Numpy arrays received
    as task arguments are writeable private copies; jax arrays and SharedTree leaves are read-only.
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable | None = None,
        initargs: Iterable = (),
        maxtasksperchild: int | None = None,
        *,
        start_method: str = "spawn",
        shm_threshold: int = 1 << 20,
        placement: str = "device",
        worker_env: dict | None = None,
        shm_capacity: int | None = None,
        devices_per_worker: int | None = None,
        shm_reserve: int | tuple[int, int] | None = None,
    ):
        if start_method == "fork":
            raise ValueError(_procenv.fork_refused("jaxtransport.Pool"))
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start_method {start_method!r} is not available on this platform")
        if processes is None:
            try:
                processes = len(os.sched_getaffinity(0))
            except AttributeError:  # pragma: no cover
                processes = os.cpu_count() or 1
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"Number of processes must be at least 1, got {processes!r}")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild < 1):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if not isinstance(shm_threshold, int) or shm_threshold < 0:
            raise ValueError(f"shm_threshold must be a non-negative int (bytes), got {shm_threshold!r}")
        if shm_capacity is not None and (not isinstance(shm_capacity, int) or shm_capacity <= 0):
            raise ValueError(f"shm_capacity must be a positive int (bytes) or None, got {shm_capacity!r}")
        _codec.check_placement(placement)
        args_reserve, results_reserve = _reserve_sizes(shm_reserve)
        capacity = shm_capacity or _shm.default_capacity()
        for side, n in (("arguments", args_reserve), ("results", results_reserve)):
            if n and _shm.size_class(n) > capacity:
                raise ValueError(
                    f"shm_reserve asks for {n} bytes ({_shm._fmt(n)}) for {side}, more than "
                    f"shm_capacity={capacity} ({_shm._fmt(capacity)}) allows per process. Lower "
                    "shm_reserve or raise shm_capacity."
                )
        self._processes = processes
        self._state = _State(
            processes=processes, initializer=initializer, initargs=tuple(initargs),
            maxtasksperchild=maxtasksperchild, start_method=start_method,
            shm_threshold=shm_threshold, placement=placement, worker_env=worker_env,
            shm_capacity=capacity, devices_per_worker=devices_per_worker, tree_type=SharedTree,
            results_reserve=results_reserve,
        )
        if args_reserve:
            try:
                self._state.arena.reserve(args_reserve)
            except BaseException:
                self._state.terminate()
                raise
        self._finalizer = weakref.finalize(self, _terminate_unreferenced, self._state)
        self._finalizer.atexit = False  # at exit the atexit hook terminates it, silently

    # -- submitting
    def apply_async(self, func: Callable, args: tuple = (), kwds: dict | None = None,
                    callback: Callable | None = None, error_callback: Callable | None = None) -> AsyncResult:
        """``func(*args, **kwds)`` in a worker; returns an AsyncResult at once.

        Pickles and copies the arguments' large arrays into shared memory in this thread (may
        wait for memory, see shm_capacity); raises TracerTransportError / pickling errors here.
        """
        state = self._state
        state.check_running()
        kwds = {} if kwds is None else kwds
        args = tuple(args)

        def locate():
            return _first_tracer((args, "args"), (kwds, "kwds"), (func, "func"))

        prep = state.prepare_chunk(func, "apply", [(args, kwds)], locate)
        result = AsyncResult(self, callback, error_callback)
        state.submit(prep, result, 0)
        return result

    def apply(self, func: Callable, args: tuple = (), kwds: dict | None = None):
        """``apply_async(...).get()``."""
        return self.apply_async(func, args, kwds).get()

    def _map_async(self, func, iterable, chunksize, mode, callback, error_callback) -> MapResult:
        state = self._state
        state.check_running()
        items = list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            if extra:
                chunksize += 1
        if not isinstance(chunksize, int) or (chunksize < 1 and items):
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        chunksize = max(chunksize, 1)
        # Phase 1 for every chunk first: a Tracer or unpicklable item anywhere fails the call
        # before any shared memory is taken or any task sent.
        preps = []
        blob = state.function_blob(func) if len(items) > chunksize else func
        for start in range(0, len(items), chunksize):
            part = items[start : start + chunksize]
            preps.append(state.prepare_chunk(blob, mode, part, _locator(func, part, start)))
        result = MapResult(self, len(items), chunksize, callback, error_callback)
        for i, prep in enumerate(preps):
            try:
                state.submit(prep, result, i)
            except BaseException as e:
                result._chunk_done(i, False, e)
                raise
        return result

    def map_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                  callback: Callable | None = None, error_callback: Callable | None = None) -> MapResult:
        """``[func(x) for x in iterable]`` in chunks across the workers; returns a MapResult."""
        return self._map_async(func, iterable, chunksize, "map", callback, error_callback)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        """``map_async(...).get()``: results in order; the first failing chunk's error is raised."""
        return self._map_async(func, iterable, chunksize, "map", None, None).get()

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                      callback: Callable | None = None, error_callback: Callable | None = None) -> MapResult:
        """``[func(*args) for args in iterable]``; returns a MapResult."""
        return self._map_async(func, iterable, chunksize, "star", callback, error_callback)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        return self._map_async(func, iterable, chunksize, "star", None, None).get()

    def _imap(self, func, iterable, chunksize, ordered) -> IMapIterator:
        state = self._state
        state.check_running()
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        it = IMapIterator(self, ordered)
        if isinstance(iterable, (list, tuple, range)):
            preps = []
            blob = state.function_blob(func) if len(iterable) > chunksize else func
            for start in range(0, len(iterable), chunksize):
                part = list(iterable[start : start + chunksize])
                preps.append(state.prepare_chunk(blob, "map", part, _locator(func, part, start)))
            it._set_length(len(preps))
            for i, prep in enumerate(preps):
                state.submit(prep, it, i)
            return it
        threading.Thread(target=_feed_imap, args=(state, it, func, iter(iterable), chunksize),
                         name="jaxtransport-pool-imap", daemon=True).start()
        return it

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Lazy ``map``: an iterator of results in order. A non-sequence iterable is consumed
        by a background thread, a bounded number of chunks ahead of the workers."""
        return self._imap(func, iterable, chunksize, True)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Like ``imap`` but results come in completion order."""
        return self._imap(func, iterable, chunksize, False)

    # -- broadcast
    def share(self, tree: Any) -> SharedTree:
        """Copy ``tree``'s arrays into shared memory once and return a :class:`SharedTree`.

        Cost: one memcpy of the tree's large arrays (``shm_threshold``), whatever the number of
        tasks and workers; each worker maps it once (no copy on CPU). Raises
        TracerTransportError (path under ``tree``) before taking any memory.
        """
        state = self._state
        state.check_running()
        rec = _TreeRec(next(state.tree_ids))
        prep = _wire.prepare(tree, threshold=state.threshold, tree_type=None,
                                  locate=lambda: _first_tracer((tree, "tree")))
        state.tls.wait_start = None
        rec.enc = _wire.commit(prep, arena=state.arena, borrower=rec.key, wait=state.wait_for_space)
        rec.nbytes = sum(h[2] for h in rec.enc.handles)
        with state.lock:
            state.trees[rec.tree_id] = rec
        return SharedTree(state, rec, tree)

    # -- lifecycle
    def close(self) -> None:
        """No more tasks; workers exit once the submitted ones are done (``join`` waits)."""
        self._state.close()

    def join(self) -> None:
        """Wait for the workers to exit; call ``close()`` or ``terminate()`` first."""
        state = self._state
        if not (state.closed or state.terminated):
            raise PoolStateError("join() needs close() or terminate() first (as multiprocessing.Pool).")
        state.join()

    def terminate(self) -> None:
        """Kill the workers now; pending calls raise PoolTerminatedError. Received arrays stay
        valid (their memory lives while they do)."""
        self._state.terminate()

    def __enter__(self) -> "Pool":
        self._state.check_running()
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()

    def __repr__(self) -> str:
        s = self._state
        status = "terminated" if s.terminated else "broken" if s.broken else "closed" if s.closed else "running"
        return f"<jaxtransport.Pool state={status} processes={self._processes} start_method={s.start_method!r}>"

    def __reduce__(self):
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled (as multiprocessing.Pool)")


def _reserve_sizes(shm_reserve) -> tuple[int, int]:
    """``Pool(shm_reserve=...)`` as (argument bytes, result bytes per worker)."""
    if shm_reserve is None:
        return 0, 0
    pair = shm_reserve if isinstance(shm_reserve, tuple) else (shm_reserve, shm_reserve)
    if len(pair) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in pair):
        raise ValueError(
            "shm_reserve must be a non-negative int (bytes, for arguments and for each worker's "
            f"results) or a pair (argument bytes, result bytes), got {shm_reserve!r}"
        )
    return pair


def _feed_imap(state: _State, it: IMapIterator, func, source, chunksize: int) -> None:
    with state.space:
        state.imap_feeders += 1
    try:
        _feed_imap_chunks(state, it, func, source, chunksize)
    finally:
        with state.space:
            state.imap_feeders -= 1


def _feed_imap_chunks(state: _State, it: IMapIterator, func, source, chunksize: int) -> None:
    index = 0
    limit = 2 * state.processes + 2
    try:
        while True:
            part = list(itertools.islice(source, chunksize))
            if not part:
                break
            with state.space:
                while state.in_flight() >= limit and not (state.terminated or state.broken):
                    state.space.wait(0.1)
            if state.terminated or state.broken is not None:
                raise PoolStateError("Pool not running: it was terminated while imap was feeding it.")
            prep = state.prepare_chunk(func, "map", part, _locator(func, part, index * chunksize))
            state.submit(prep, it, index)
            index += 1
    except BaseException as e:  # noqa: BLE001 - surfaces where the iterator reaches it
        it._chunk_done(index, False, e)
        index += 1
    it._set_length(index)
