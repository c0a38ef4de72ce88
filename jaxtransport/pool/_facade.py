"""``jaxtransport.Pool``: multiprocessing.Pool's API for JAX, with arrays through shared memory.

What it adds to ``multiprocessing.Pool`` (see each docstring for the costs):

- Functions, lambdas and closures travel with cloudpickle; ``__main__`` code keeps the stock
  pool's module semantics (one namespace per worker shared by the initializer and every task:
  Note [user code] in ``_usercode``). Workers are started with ``spawn`` (default) or
  ``forkserver``: ``fork`` deadlocks a process that has JAX initialised and is refused. Workers start with
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

How the parts fit (threads, ownership, lock order) is drawn at the top of the package
(``jaxtransport/pool/__init__.py``).
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import _mainguard, _nojax, _os, _procenv, _shm
from .._errors import MainGuardError, PoolStateError
from .._nojax import find_tracer, first_tracer
from ._launch import Spec, abandon
from ._results import AsyncResult, IMapIterator, MapResult

if TYPE_CHECKING:
    from ._engine import Engine
    from ._trees import SharedTree

__all__ = ["AsyncResult", "IMapIterator", "MapResult", "Pool"]

RANGE_CHUNK = 32  # a map of a range keeps range chunks of at least this many items (_map_async)


class Pool:
    """A process pool with ``multiprocessing.Pool``'s API for functions that take and return
    JAX arrays. What it adds to ``multiprocessing.Pool`` is in the Pool guide; costs below.

    Args:
      processes: number of workers (default: the CPUs this process may use).
      initializer, initargs: ``initializer(*initargs)`` runs in each worker at start. They are
        pickled as each worker starts, as ``multiprocessing.Pool`` does, so objects shared only
        by inheritance (a ``multiprocessing.Queue``, ``Lock``, ``Value``) work; functions and
        lambdas travel by value (``__main__`` code as the stock pool treats it). If it raises,
        the pool is broken and pending calls raise PoolStateError.
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
        free memory for the pool as a whole (a half of it for the parent, the other half split
        among the workers; at least 256 MiB each). When reached, a sender waits for receivers
        to drop arrays (while tasks are in flight), then raises ShmCapacityError: a clear error,
        never the out-of-memory killer. ``imap`` submits only a bounded number of chunks ahead
        of its consumer, so a slow consumer makes workers wait instead of filling it.
      devices_per_worker: accelerators of its own for each worker: on multi-GPU hosts, GPUs
        round-robin (default 1); on a TPU host, chips the parent does not hold (default: none,
        the workers run JAX on the CPU while the parent holds or may take the chips; too few
        free chips raise ValueError here). See docs/accelerators.md.
      shm_reserve: bytes of shared memory to make ready while the workers start, so that the
        first large transfers pay no page faults: an int ``n`` reserves one slot for an array of
        up to ``n`` bytes in the parent (task arguments) and one in each worker (results); a
        pair ``(arguments, results)`` sizes them apart (0 skips a side). Arrays up to twice
        smaller use the same slot, larger ones grow it. Memory cost, held until the pool ends:
        ``arguments + processes * results`` bytes, rounded up to the next size class (at most
        25% more), allocated at once (a new 4 KiB page costs ~1 s/GiB to fault in, on threads
        off your call's path). Within shm_capacity, else ValueError; a system without the
        memory raises ShmCapacityError from the first call that needs memory.
      preload_jax: whether each worker imports JAX (and starts its backend) on a thread of its
        own as soon as it is ready (after the first task, when one is already waiting for it),
        so that the first task that needs JAX does not pay the import (1.5-3 s). Default
        (None): when this process has imported JAX; a numpy-only program that never imports
        JAX starts workers that never import it either. Costs each worker JAX's memory
        (~100-200 MB) and CPU while it imports, shared with any task already running there.

    Received arrays alias shared memory that returns to the sender's pool only when the last
    reference to them (and to anything derived from their buffer) is gone. Numpy arrays received
    as task arguments are writeable private copies; jax arrays and SharedTree leaves are read-only.
    """

    _futures = False  # an Executor's pool (its subclass): concurrent.futures' error contract

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable | None = None,
        initargs: Iterable = (),
        maxtasksperchild: int | None = None,
        *,
        start_method: str = "spawn",
        shm_threshold: int = _shm.DEFAULT_SHM_THRESHOLD,
        placement: str = "device",
        worker_env: dict | None = None,
        shm_capacity: int | None = None,
        devices_per_worker: int | None = None,
        shm_reserve: int | tuple[int, int] | None = None,
        preload_jax: bool | None = None,
    ):
        if start_method == "fork":
            raise ValueError(_procenv.fork_refused("jaxtransport.Pool"))
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start_method {start_method!r} is not available on this platform")
        if processes is None:
            processes = _os.cpu_count()
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
        _nojax.check_placement(placement)
        if multiprocessing.current_process().daemon:
            raise PoolStateError(
                "A jaxtransport.Pool cannot be created inside a daemonic process, such as a worker "
                "of another Pool (daemonic processes may not have children). Run the nested work "
                "in the task itself, or return it to the parent and submit it to the outer pool."
            )
        unguarded = _mainguard.unguarded_start("a jaxtransport.Pool")
        if unguarded is not None:
            raise MainGuardError(unguarded)
        args_reserve, results_reserve = _reserve_sizes(shm_reserve)
        if _os.in_band():  # no shared memory to pass: every array inside the pickles (Note [platforms])
            _os.warn_in_band("jaxtransport.Pool")
            shm_threshold, args_reserve, results_reserve = _os.IN_BAND_THRESHOLD, 0, 0
        # Default: half the free memory for the pool as a whole, half of that for the parent
        # (arguments, shared trees), the other half split among the workers (results).
        capacity = shm_capacity or _shm.default_capacity(0.5)
        worker_capacity = shm_capacity or _shm.default_capacity(0.5 / processes)
        for side, n, cap in (("arguments", args_reserve, capacity), ("results", results_reserve, worker_capacity)):
            if n and _shm.size_class(n) > cap:
                raise ValueError(
                    f"shm_reserve asks for {n} bytes ({_shm.format_bytes(n)}) for {side}, more than "
                    f"shm_capacity={cap} ({_shm.format_bytes(cap)}) allows per process. Lower "
                    "shm_reserve or raise shm_capacity."
                )
        self._processes = processes
        spec = Spec(
            _os.start_context(start_method),  # children told this method (Note [the child's start method])
            processes=processes,
            start_method=start_method,
            threshold=shm_threshold,
            placement=placement,
            capacity=worker_capacity,
            futures=self._futures,
            maxtasks=maxtasksperchild,
            reserve=results_reserve,
            preload_jax=_nojax.jax_loaded() if preload_jax is None else bool(preload_jax),
            worker_env=worker_env,
            devices_per_worker=devices_per_worker,
        )
        init_call = None
        if initializer is not None:
            from ._initargs import InitCall

            init_call = InitCall(initializer, initargs)
        started: list = []
        try:
            for i in range(processes):
                started.append(spec.launch(i, init_call))
            # Note [launch first] in _launch: the engine's modules are imported while the workers
            # boot (a module imported once; later pools find it loaded).
            from ._engine import Engine, terminate_unreferenced
            from ._trees import SharedTree

            self._state = Engine(
                spec=spec,
                processes=processes,
                init_call=init_call,
                shm_capacity=capacity,
                tree_type=SharedTree,
                started=started,
            )
        finally:
            abandon(started)  # started but not adopted: building the engine failed
        if args_reserve:
            try:
                self._state.arena.reserve(args_reserve)
            except BaseException:
                self._state.terminate()
                raise
        self._finalizer = weakref.finalize(self, terminate_unreferenced, self._state)
        self._finalizer.atexit = False  # at exit the atexit hook terminates it, silently

    # -- submitting
    def apply_async(
        self,
        func: Callable,
        args: tuple = (),
        kwds: dict | None = None,
        callback: Callable | None = None,
        error_callback: Callable | None = None,
    ) -> AsyncResult:
        """``func(*args, **kwds)`` in a worker; returns an AsyncResult at once.

        Pickles and copies the arguments' large arrays into shared memory in this thread (may
        wait for memory, see shm_capacity); raises TracerTransportError / pickling errors here.
        """
        result = AsyncResult(self, callback, error_callback)
        self._submit_apply(func, args, kwds, result)
        return result

    def _submit_apply(self, func: Callable, args: Iterable[Any], kwds: dict | None, result: AsyncResult) -> bool:
        """Send one call completing ``result`` (``apply_async``; the Executor passes results
        of its own); returns whether it used shared memory (an array or a SharedTree)."""
        state = self._state
        state.check_running()
        kwds = {} if kwds is None else kwds
        args = tuple(args)

        def locate() -> str | None:
            return first_tracer((args, "args"), (kwds, "kwds"), (func, "func"))

        prep = state.prepare_chunk(func, "apply", [(args, kwds)], locate)
        state.submit(prep, result, 0)
        return type(prep) is not bytes

    def _submit_applies(self, calls: Sequence[tuple[Callable, tuple, dict, AsyncResult]]) -> tuple[list, bool]:
        """Send many calls ``(func, args, kwds, result)`` at once (the Executor's dispatcher):
        those that need no shared memory in one go (one lock acquisition, one write per
        worker). Returns ``(result, exception)`` for each call that could not be sent (its
        arguments do not pickle, a Tracer) and whether any call used shared memory; raises
        PoolStateError, sending none of the rest, when the pool has stopped."""
        state = self._state
        state.check_running()
        failed: list = []
        plain: list = []
        heavy = False
        for func, args, kwds, result in calls:
            try:

                def locate(args: tuple = args, kwds: dict = kwds, func: Callable = func) -> str | None:
                    return first_tracer((args, "args"), (kwds, "kwds"), (func, "func"))

                prep = state.prepare_chunk(func, "apply", [(args, kwds)], locate)
            except Exception as e:  # noqa: BLE001 - this call's own failure
                failed.append((result, e))
                continue
            if type(prep) is not bytes:  # something of it in shared memory
                heavy = True
                if plain:
                    batch, plain = plain, []
                    state.submit_plain(batch)
                try:
                    state.submit(prep, result, 0)
                except PoolStateError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. ShmCapacityError: this call only
                    failed.append((result, e))
            else:
                plain.append((prep, result, 0))
        if plain:
            state.submit_plain(plain)
        return failed, heavy

    def apply(self, func: Callable, args: tuple = (), kwds: dict | None = None) -> Any:
        """``apply_async(...).get()``."""
        return self.apply_async(func, args, kwds).get()

    def _map_async(
        self,
        func: Callable,
        iterable: Iterable[Any],
        chunksize: int | None,
        mode: str,
        callback: Callable | None,
        error_callback: Callable | None,
    ) -> MapResult:
        state = self._state
        state.check_running()
        # Read once into a tuple (a list too) and sliced below, so each chunk is a tuple, as
        # multiprocessing's are, and a tuple of numbers or strings is one object less for the
        # garbage collector to track (Note [few objects per waiting chunk] in _engine). A range
        # stays a range for chunks of RANGE_CHUNK items or more (its slices are ranges: a few
        # bytes however long, where a tuple costs each item at both ends), and becomes a tuple
        # for smaller ones (a range pickles and unpickles by a global lookup: about 1 us more
        # per chunk at each end).
        items: Any = iterable if type(iterable) in (tuple, range) else tuple(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            if extra:
                chunksize += 1
        if not isinstance(chunksize, int) or (chunksize < 1 and items):
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        chunksize = max(chunksize, 1)
        if type(items) is range and chunksize < RANGE_CHUNK:
            items = tuple(items)
        # Phase 1 for every chunk first: a Tracer or unpicklable item anywhere fails the call
        # before any shared memory is taken or any task sent.
        blob = state.function_blob(func) if len(items) > chunksize else func
        starts = range(0, len(items), chunksize)
        parts = [items[start : start + chunksize] for start in starts]
        preps = state.prepare_chunks(blob, mode, parts, _Locators(func, parts, chunksize))
        result = MapResult(self, len(items), chunksize, callback, error_callback)
        if all(type(prep) is bytes for prep in preps):  # nothing of it in shared memory
            try:
                state.submit_run(preps, result, 0)
            except BaseException as e:
                result.chunk_done(0, False, e)
                raise
            return result
        for i, prep in enumerate(preps):
            try:
                state.submit(prep, result, i)
            except BaseException as e:
                result.chunk_done(i, False, e)
                raise
        return result

    def map_async(
        self,
        func: Callable,
        iterable: Iterable,
        chunksize: int | None = None,
        callback: Callable | None = None,
        error_callback: Callable | None = None,
    ) -> MapResult:
        """``[func(x) for x in iterable]`` in chunks across the workers; returns a MapResult."""
        return self._map_async(func, iterable, chunksize, "map", callback, error_callback)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        """``map_async(...).get()``: results in order; the first failing chunk's error is raised."""
        return self._map_async(func, iterable, chunksize, "map", None, None).get()

    def starmap_async(
        self,
        func: Callable,
        iterable: Iterable,
        chunksize: int | None = None,
        callback: Callable | None = None,
        error_callback: Callable | None = None,
    ) -> MapResult:
        """``[func(*args) for args in iterable]``; returns a MapResult."""
        return self._map_async(func, iterable, chunksize, "star", callback, error_callback)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        return self._map_async(func, iterable, chunksize, "star", None, None).get()

    def _imap(self, func: Callable, iterable: Iterable[Any], chunksize: int, ordered: bool) -> IMapIterator:
        state = self._state
        state.check_running()
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        it = IMapIterator(self, ordered, on_consumed=state.imap_progress)
        if isinstance(iterable, (list, tuple, range)):
            # Phase 1 here, so a Tracer or an unpicklable item fails the call itself.
            blob = state.function_blob(func) if len(iterable) > chunksize else func
            starts = range(0, len(iterable), chunksize)
            parts = [tuple(iterable[start : start + chunksize]) for start in starts]
            source = iter(state.prepare_chunks(blob, "map", parts, _Locators(func, parts, chunksize)))
        else:
            source = _prepare_lazily(state, func, iter(iterable), chunksize)
        threading.Thread(
            target=_feed_imap, args=(state, it, source), name="jaxtransport-pool-imap", daemon=True
        ).start()
        return it

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Lazy ``map``: an iterator of results in order. Chunks are submitted by a background
        thread, a bounded number ahead of the consumer: results not yet taken count, so a slow
        consumer makes the workers wait instead of piling results up in shared memory."""
        return self._imap(func, iterable, chunksize, True)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Like ``imap`` but results come in completion order."""
        return self._imap(func, iterable, chunksize, False)

    # -- broadcast
    def share(self, tree: Any) -> SharedTree:
        """Copy ``tree``'s arrays into shared memory once and return a :class:`SharedTree`.

        Cost: one memcpy of the tree's large arrays (``shm_threshold``), whatever the number of
        tasks and workers; each worker maps it once (no copy on CPU), and each task gets its own
        tree over that memory (new containers and arrays: see :class:`SharedTree`). Raises
        TracerTransportError (path under ``tree``) before taking any memory.
        """
        state = self._state
        state.check_running()
        from ._trees import SharedTree

        return SharedTree(state.trees, state.share(tree), tree)

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

    def __enter__(self) -> Pool:
        self._state.check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __repr__(self) -> str:
        s = self._state
        status = s.flags.describe()
        return f"<jaxtransport.Pool state={status} processes={self._processes} start_method={s.start_method!r}>"

    def __reduce__(self) -> tuple:
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled (as multiprocessing.Pool)"
        )


def _reserve_sizes(shm_reserve: Any) -> tuple[int, int]:
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


def _prepare_lazily(state: Engine, func: Callable, source: Iterator[Any], chunksize: int) -> Iterator[Any]:
    index = 0
    while True:
        part = list(itertools.islice(source, chunksize))
        if not part:
            return
        yield state.prepare_chunk(func, "map", part, _locator(func, part, index * chunksize))
        index += 1


def _feed_imap(state: Engine, it: IMapIterator, preps: Iterator[Any]) -> None:
    """Submit imap's chunks as the engine makes room for them (``Engine.wait_for_imap_room``:
    backpressure on both the workers and the results), a batch per wait: the chunks that need
    no shared memory together (one lock acquisition and one write per worker)."""
    index = 0
    light_args = True  # no argument needed shared memory so far (imap's window may widen more)
    try:
        while True:
            room = state.wait_for_imap_room(it.unconsumed, lambda: it.light_results, light_args)
            plain: list = []  # the pickles of plain chunks in a row, from ``index`` on
            try:
                for _ in range(room):
                    prep = next(preps, None)
                    if prep is None:
                        break
                    if type(prep) is not bytes:  # something of it in shared memory
                        light_args = False
                        if plain:
                            batch, plain = plain, []
                            state.submit_run(batch, it, index)
                            index += len(batch)
                        state.submit(prep, it, index)
                        index += 1
                    else:
                        plain.append(prep)
                    del prep
                else:
                    continue
                break  # the source is exhausted
            finally:
                if plain:  # what was prepared before the source ended or raised goes first
                    batch, plain = plain, []
                    state.submit_run(batch, it, index)
                    index += len(batch)
                del plain  # the round ends in a statement, not in a test (Note [loops that end in a test])
    except BaseException as e:  # noqa: BLE001 - surfaces where the iterator reaches it
        it.chunk_done(index, False, e)
        index += 1
    it.set_length(index)


class _Locators:
    """``_locator`` of each part of a map, made when asked for (only a chunk that fails to
    pickle by reference needs its own)."""

    __slots__ = ("chunksize", "func", "parts")

    def __init__(self, func: Callable, parts: list, chunksize: int):
        self.func, self.parts, self.chunksize = func, parts, chunksize

    def __getitem__(self, i: int) -> Callable[[], str | None]:
        return _locator(self.func, self.parts[i], i * self.chunksize)


def _locator(func: Callable, part: Any, start: int) -> Callable[[], str | None]:
    def locate() -> str | None:
        for j, item in enumerate(part):
            found = find_tracer(item, f"iterable[{start + j}]")
            if found is not None:
                return found[0]
        return first_tracer((func, "func"))

    return locate
