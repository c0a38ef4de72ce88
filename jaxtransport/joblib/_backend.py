"""The ``"jaxtransport"`` joblib parallel backend: ``joblib.Parallel`` on a ``jaxtransport.Pool``.

joblib hands the backend a ``BatchedCalls`` (a list of ``(func, args, kwargs)`` and the nested
backend); the Pool pickles it with cloudpickle and its array reducer, so every numpy array and
``jax.Array`` of at least ``shm_threshold`` bytes, in the arguments and in the results, travels
through shared memory, and a ``jax.Array`` result comes back as a ``jax.Array`` under the Pool's
placement. Functions defined in ``__main__`` travel as they do through the Pool.

Note [one warm pool]
~~~~~~~~~~~~~~~~~~~~
JAX workers take seconds to start, so the backend keeps one module-level Pool (as loky's
``get_reusable_executor``): every ``Parallel`` call with the same worker count and Pool options
reuses its warm workers. Asking for another count or other options closes the old pool (its
running tasks finish first) and starts a new one. ``abort_everything`` (the first error of a
call, or its ``timeout``) terminates the pool only when some of that call's tasks are still
pending or running, as loky kills its workers; the next call starts a fresh pool. The pool ends
with :func:`shutdown`, or at interpreter exit (the Pool's own exit hook terminates it).
The module lock ``_LOCK`` guards only that slot; nothing is called out while it is held except
creating the Pool.

Note [no polling]
~~~~~~~~~~~~~~~~~
For a backend that completes batches through callbacks (``supports_retrieve_callback``, loky's
way), joblib's result loop looks at the next batch in order and, while it is pending, sleeps
10 ms before looking again (``Parallel._retrieve``): a call ends up to 10 ms after its last
batch, and a short call on large arrays paid that on top of ``Pool.map``'s time. So for ordered
results (``return_as="list"`` and ``"generator"``, joblib's default) the backend says it does not
retrieve through callbacks: joblib's thread then waits in :meth:`JaxTransportBackend.retrieve_result`,
on the call's condition, and wakes when that batch ends. What joblib does for callback backends
is kept by hand:

- the first batch to fail ends the wait of whichever batch joblib waits for, and its error is
  raised (joblib then aborts the call), as loky's early error; a failed batch dispatches no more;
- a batch's completion callback (which dispatches the next batch) runs before the batch is
  marked done, so joblib never finds its list of jobs empty mid-call (it would sleep 10 ms);
- ``timeout`` bounds each wait, as joblib bounds a pending batch's.

``return_as="generator_unordered"`` needs joblib's callback path (batches join its list in the
order they end): for it the backend keeps retrieving through callbacks, and joblib's poll.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)
from joblib.parallel import cpu_count, register_parallel_backend

from .. import _lockorder
from .._errors import PoolStateError, PoolTerminatedError, TransportError
from .._nojax import find_tracer
from .._pickling import tracer_error_type
from ..pool import Pool

__all__ = ["JaxTransportBackend", "register", "shutdown"]

# The Pool's keyword arguments a backend accepts (``parallel_config(backend="jaxtransport",
# placement="host")``); anything else is refused with its name.
POOL_OPTIONS = (
    "start_method",
    "shm_threshold",
    "placement",
    "worker_env",
    "shm_capacity",
    "devices_per_worker",
    "shm_reserve",
    "preload_jax",
    "maxtasksperchild",
    "initializer",
    "initargs",
)

_LOCK = threading.Lock()
_shared: tuple[Pool, tuple] | None = None  # Note [one warm pool]


def _key(n_jobs: int, options: dict) -> tuple:
    return (n_jobs, tuple(sorted(options.items(), key=lambda kv: kv[0])))


def _same(a: Any, b: Any) -> bool:
    """Whether two option values ask for the same pool: plain values by equality, containers
    item by item, any other object (an initializer, a Manager proxy) by identity."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (str, bytes, int, float, bool, type(None))):
        return a == b
    return False


def _get_pool(n_jobs: int, options: dict) -> Pool:
    """The warm pool for ``n_jobs`` workers and these options (Note [one warm pool])."""
    global _shared
    key = _key(n_jobs, options)
    with _LOCK:
        if _shared is not None and _same(_shared[1], key):
            return _shared[0]
        old, _shared = (None if _shared is None else _shared[0]), None
    if old is not None:
        old.close()
        old.join()
    pool = Pool(n_jobs, **options)
    with _LOCK:
        if _shared is None:
            _shared = (pool, key)
            return pool
    # Another thread installed a pool meanwhile: use it if it fits, else ours replaces nothing.
    pool.terminate()
    return _get_pool(n_jobs, options)


def _drop_pool(pool: Pool, terminate: bool) -> None:
    global _shared
    with _LOCK:
        if _shared is not None and _shared[0] is pool:
            _shared = None
    if terminate:
        pool.terminate()
    else:
        pool.close()
    pool.join()


def _forget(pool: Pool) -> None:
    """A broken pool (its initializer failed) is never handed out again; the thread that
    noticed may be the Pool's callback thread, so it is terminated later, by
    ``abort_everything`` on the caller's thread (or, unreferenced, by the Pool's finalizer)."""
    global _shared
    with _LOCK:
        if _shared is not None and _shared[0] is pool:
            _shared = None


def shutdown(wait: bool = True) -> None:
    """End the backend's warm worker processes (Note [one warm pool]); the next
    ``Parallel(backend="jaxtransport")`` call starts new ones. ``wait``: let running tasks finish
    (else they are terminated)."""
    global _shared
    with _LOCK:
        pool, _shared = (None if _shared is None else _shared[0]), None
    if pool is not None:
        _drop_pool(pool, terminate=not wait)


class _Call:
    """One ``Parallel`` call's completions (Note [no polling]): the condition its result wait
    sleeps on and the first batch of the call that failed."""

    __slots__ = ("cond", "failed")

    def __init__(self) -> None:
        # retrieve_result parks on it (Note [waits a Ctrl-C cannot break] in _lockorder).
        self.cond = _lockorder.condition("joblib._Call.cond")
        self.failed: _Job | None = None


class _Job:
    """What ``submit`` returns and joblib's completion callback receives: the outcome of one
    batch, set by the Pool's callback thread."""

    __slots__ = ("call", "done", "error", "value")

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


# Argument types that are never a Tracer and hold none.
_PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None), np.ndarray})


def _check_batch(batch: Any) -> None:
    """A Tracer in any task of the batch raises here, at dispatch, naming the task's function
    and the argument's key path (``args[0]['params']['w']``)."""
    items = getattr(batch, "items", None)
    if not isinstance(items, list):
        return
    for func, args, kwargs in items:
        if all(type(a) in _PLAIN for a in args) and all(type(v) in _PLAIN for v in kwargs.values()):
            continue  # nothing that could hold a Tracer: skip the pytree walk (tiny tasks)
        for obj, root in ((args, "args"), (kwargs, "kwargs")):
            found = find_tracer(obj, root)
            if found is not None:
                from .._tracers import tracer_error

                name = getattr(func, "__qualname__", None) or repr(func)
                raise tracer_error(
                    found[1],
                    path=found[0] or root,
                    where=f"in joblib.Parallel, a call of {name} (jaxtransport backend)",
                )


class JaxTransportBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib's process backend on :class:`jaxtransport.Pool` workers (register with
    :func:`register`, select with ``joblib.parallel_config(backend="jaxtransport")``).

    Options (``parallel_config(backend="jaxtransport", placement="host", ...)``): the Pool's
    ``start_method``, ``shm_threshold``, ``placement``, ``worker_env``, ``shm_capacity``,
    ``devices_per_worker``, ``shm_reserve``, ``preload_jax``, ``maxtasksperchild``,
    ``initializer`` and ``initargs`` (workers are reused while these are the same objects).
    joblib's ``inner_max_num_threads`` sets the BLAS/OpenMP thread variables of the workers, as
    loky's.
    """

    supports_inner_max_num_threads = True
    supports_return_generator = True
    supports_timeout = True
    default_n_jobs = 1

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None, **options: Any):
        unknown = sorted(set(options) - set(POOL_OPTIONS))
        if unknown:
            raise TypeError(
                f"the jaxtransport joblib backend got unknown option(s) {unknown}; it accepts the "
                f"jaxtransport.Pool options {list(POOL_OPTIONS)}"
            )
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads, **options)
        self._pool: Pool | None = None
        self._pool_args: tuple[int, dict] | None = None  # (n_jobs, options) of the last configure
        self._broken = False  # the pool reported PoolStateError: terminate it at the abort
        self._jobs_lock = threading.Lock()
        self._jobs: set[_Job] = set()
        self._call = _Call()
        self.parallel: Any = None

    @property
    def supports_retrieve_callback(self) -> bool:
        """Callbacks only for unordered results; joblib waits in :meth:`retrieve_result` for
        ordered ones (Note [no polling])."""
        return self.parallel is not None and not getattr(self.parallel, "return_ordered", True)

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """The number of workers ``n_jobs`` asks for (negative: ``cpu_count() + 1 + n_jobs``), 1
        where processes cannot start (a daemonic process such as a worker, or a thread of a
        nested call), as for loky."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if multiprocessing.current_process().daemon:
            if n_jobs != 1:
                warnings.warn(
                    "jaxtransport-backed parallel loops cannot be called in a daemonic process "
                    "(such as a pool worker, which may not have children), setting n_jobs=1",
                    stacklevel=3,
                )
            return 1
        if not (self.in_main_thread() or self.nesting_level == 0):
            if n_jobs != 1:
                warnings.warn(
                    "jaxtransport-backed parallel loops cannot be nested below threads, setting n_jobs=1",
                    stacklevel=3,
                )
            return 1
        if n_jobs < 0:
            return max(cpu_count() + 1 + n_jobs, 1)
        return n_jobs

    def configure(
        self,
        n_jobs: int = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        **options: Any,
    ) -> int:
        """Take the warm pool for ``n_jobs`` workers (Note [one warm pool]); one worker runs
        sequentially in this process, as loky does."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        # ``Parallel`` passes its memmapping options (``max_nbytes``, ``mmap_mode``,
        # ``temp_folder``) and ``verbose``/``context`` to every backend: arrays travel through
        # shared memory here, so those are not used.
        merged = {**self.backend_kwargs, **{k: v for k, v in options.items() if k in POOL_OPTIONS}}
        env = dict(self._prepare_worker_env(n_jobs=n_jobs))
        env.update(merged.pop("worker_env", None) or {})
        merged["worker_env"] = env
        self._pool_args = (n_jobs, merged)
        self._pool = _get_pool(n_jobs, merged)
        self.parallel = parallel
        return n_jobs

    def submit(self, func: Callable, callback: Callable | None = None) -> Any:
        """Send one batch; ``callback(job)`` runs on the Pool's callback thread when it ends.

        A batch that cannot be sent (a Tracer in it: TracerTransportError naming its key path;
        an argument that does not pickle: PicklingError) fails as its job, at once: joblib
        raises that error from the ``Parallel`` call. (Raising here instead would hang joblib
        when the dispatch runs on the callback thread, after an earlier batch completed: joblib
        has registered the batch already and would wait for it forever.)
        """
        if self._pool is None:
            raise RuntimeError("the jaxtransport backend is not configured (joblib calls configure first)")
        call = self._call
        job = _Job(call)
        pool = self._pool
        by_callback = self.supports_retrieve_callback

        def finish(value: Any = None, error: BaseException | None = None) -> None:
            job.value, job.error = value, error
            if isinstance(error, PoolStateError):
                self._broken = True
                _forget(pool)
            with self._jobs_lock:
                self._jobs.discard(job)
            try:
                if callback is not None and (by_callback or error is None):
                    callback(job)  # joblib dispatches the next batch (Note [no polling])
            finally:
                with call.cond:
                    job.done = True
                    if error is not None and call.failed is None:
                        call.failed = job
                    call.cond.wake_all()

        with self._jobs_lock:
            self._jobs.add(job)
        try:
            _check_batch(func)
            pool.apply_async(func, callback=finish, error_callback=lambda e: finish(error=e))
        except Exception as e:
            if isinstance(e, PoolStateError):
                self._broken = True
                _forget(pool)
            error: Exception = e
            if not isinstance(e, (tracer_error_type(), TransportError)):
                # As loky: a task that cannot be pickled is a PicklingError naming the cause.
                error = pickle.PicklingError(f"Could not pickle the task to send it to the workers: {e!r}")
                error.__cause__ = e
            if callback is None:
                with self._jobs_lock:
                    self._jobs.discard(job)
                raise error from error.__cause__
            finish(error=error)
        except BaseException:  # KeyboardInterrupt while pickling: joblib aborts the call
            with self._jobs_lock:
                self._jobs.discard(job)
            raise
        return job

    def start_call(self) -> None:
        """Each ``Parallel`` call (a managed ``with Parallel(...)`` one configures once for many)
        waits on its own completions: a late batch of an earlier call cannot fail this one."""
        self._call = _Call()

    def retrieve_result(self, out: Any, timeout: float | None = None) -> Any:
        """Wait for the batch ``out`` on joblib's thread (Note [no polling]): its results, or
        the error of the call's first failed batch as soon as one fails, or TimeoutError
        after ``timeout`` seconds."""
        if out is None:  # joblib registered this batch's outcome itself (its input raised)
            return None
        call = out.call
        cond = call.cond
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with cond:
                if out.done or call.failed is not None:
                    failed = call.failed
                    break
                ticket = cond.park()
            if not _lockorder.sleep(ticket, None if deadline is None else deadline - time.monotonic()):
                with cond:
                    cond.unpark(ticket)
                    if not (out.done or call.failed is not None):
                        raise multiprocessing.TimeoutError()  # what joblib raises for every backend
                    failed = call.failed
                break
        return self.retrieve_result_callback(out if failed is None else failed)

    def retrieve_result_callback(self, out: Any) -> Any:
        """The batch's results, or its exception (with the worker's traceback as its cause)."""
        if isinstance(out.error, PoolTerminatedError):
            raise RuntimeError(
                "The executor underlying Parallel (the jaxtransport backend's pool) was terminated "
                "before this task's result arrived: a previous Parallel call aborted (an error, a "
                "timeout, or its return_as='generator' output garbage collected before it was "
                "exhausted), or jaxtransport.joblib.shutdown(wait=False) was called."
            ) from out.error
        return out.get()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """Drop this call's unfinished tasks: when any are pending or running, the pool is
        terminated (its workers killed, as loky does) and, with ``ensure_ready``, a new one
        started."""
        with self._jobs_lock:
            unfinished, self._jobs = bool(self._jobs), set()
        pool, self._pool = self._pool, None
        broken, self._broken = self._broken, False
        if pool is not None and (unfinished or broken):
            _drop_pool(pool, terminate=True)
        elif pool is not None and ensure_ready:
            self._pool = pool
            return
        if ensure_ready and self._pool_args is not None:
            self._pool = _get_pool(*self._pool_args)  # the same workers' options as the call had

    def terminate(self) -> None:
        """End of a ``Parallel`` call: the warm pool stays (Note [one warm pool])."""
        self._pool = None
        self.reset_batch_stats()


def register() -> None:
    """Register the ``"jaxtransport"`` joblib backend (``ray.util.joblib.register_ray``'s
    convention). Then::

        with joblib.parallel_config(backend="jaxtransport", n_jobs=4):
            results = joblib.Parallel()(joblib.delayed(f)(x) for x in xs)

    Idempotent; registers nothing else (``jaxtransport.register()`` is not needed)."""
    register_parallel_backend("jaxtransport", JaxTransportBackend)
