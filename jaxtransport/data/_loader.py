"""``Loader``: ordered batches from worker processes onto the device, for a training loop.

Note [the loader's stream]
One Loader owns one Pool and one thread, the *feeder*, which holds no reference to the Loader
(so a Loader nobody holds is collected, and its finalizer stops the feeder and the pool). The
feeder walks the batches in order, epoch after epoch (Note [the same batches whatever the
workers] in ``_order``): it keeps up to ``prefetch`` of them submitted to the pool
(``apply_async``, one task per batch; the pool hands each to an idle worker), waits for the
oldest, puts it on the device (``_placement.put``) and queues it for the loop, at most
``device_prefetch`` ahead. So the workers run ahead of the loop by a bounded number of batches,
across epoch boundaries too, and the loop finds the next batch already on the device.

The loop's side: ``iter(loader)`` is the next epoch, from its first batch: the epoch after the
last one a batch was taken from (or ``start_epoch``). An epoch left early (``break``) is not
resumed: its batches still queued are dropped, and the next ``iter()`` starts the next epoch, as
a new DataLoader iterator does. ``loader.batches(epochs=None)`` goes on across epochs (for a
loop counted in steps). One iterator at a time: starting one ends the one before.

Errors: a worker's exception (or one of the placement) ends the stream and is raised in the
loop, with the worker's traceback as ``__cause__`` and a note naming the batch; later calls
raise RuntimeError from it. ``timeout`` bounds each wait of the loop for a batch (TimeoutError;
the stream goes on). ``close()``, leaving ``with``, and garbage collection stop the feeder and
terminate the pool; a Ctrl-C in the loop leaves through ``with`` like any exception.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ._order import batches_per_epoch, epoch_order
from ._worker import Plan, install, make_batch

__all__ = ["Loader"]

POLL_S = 0.1  # how often the feeder looks at its stop flag while it waits
_RESERVED = ("initializer", "initargs", "placement")


class Loader:
    """Batches of ``source`` made in worker processes, in order, on the device.

    Args:
      source: the records, any sequence (``len`` and ``__getitem__``: a list of file names, a
        numpy array, a dataset object). It is pickled once per worker; ``source[i]`` runs there.
      transform: ``transform(record, rng) -> tree of arrays`` for each example, in a worker;
        ``rng`` is a ``numpy.random.Generator`` given by ``(seed, epoch, index)`` alone. The
        examples' trees are stacked into the batch. None: the records are the examples.
      batch_size: examples per batch.
      batch_transform: instead of ``transform``: ``batch_transform(records, rng) -> batch`` (a
        list of ``source[i]``, one generator per batch).
      seed: the order and every random number (an int >= 0); None draws one (``loader.seed``).
      shuffle: a new order each epoch, from ``(seed, epoch)``; False: ``source`` order.
      drop_remainder: leave out the last, shorter batch of each epoch (static shapes: one
        compilation of the step). Default False: it is kept.
      start_epoch: the epoch the first ``iter()`` starts at (to resume a run).
      workers: worker processes (default: the CPUs this process may use).
      prefetch: batches submitted ahead of the one the loop waits for (default ``2 * workers``).
      device_prefetch: batches already put on the device, waiting for the loop (default 2).
      sharding: None (the default device), a ``jax.sharding.Mesh`` (with ``data_axis``: the
        batch's first axis split over that axis, or a tuple of axes), or any
        ``jax.sharding.Sharding`` applied to every leaf.
      data_axis: the mesh axis (or axes) the batch is split over.
      timeout: seconds the loop waits for one batch before TimeoutError (None: no limit). The
        first batch waits for the workers to start too (seconds on a busy machine): a tight
        limit can be set after it (``loader.timeout = 2.0``). The iterator stays usable.
      pool_options: more ``jaxtransport.Pool`` arguments (``start_method``, ``worker_env``,
        ``shm_capacity``, ``devices_per_worker``, ``maxtasksperchild``, ``preload_jax``...).
        By default the workers do not preload JAX (``preload_jax=False``): they import it only if
        your functions do.
    """

    def __init__(
        self,
        source: Sequence[Any],
        transform: Callable[[Any, np.random.Generator], Any] | None = None,
        *,
        batch_size: int,
        batch_transform: Callable[[list, np.random.Generator], Any] | None = None,
        seed: int | None = None,
        shuffle: bool = False,
        drop_remainder: bool = False,
        start_epoch: int = 0,
        workers: int | None = None,
        prefetch: int | None = None,
        device_prefetch: int = 2,
        sharding: Any = None,
        data_axis: Any = None,
        timeout: float | None = None,
        pool_options: dict | None = None,
    ):
        try:
            n = len(source)
        except TypeError:
            raise TypeError(
                f"source must be a sequence (len and [i]), got {type(source).__name__}: for an iterable, "
                "make a list of its records (or of the file names they come from)."
            ) from None
        if not hasattr(source, "__getitem__"):
            raise TypeError(f"source must support source[i], got {type(source).__name__}")
        if transform is not None and batch_transform is not None:
            raise ValueError("Give transform= (per example) or batch_transform= (per batch), not both.")
        for name, fn in (("transform", transform), ("batch_transform", batch_transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(2, np.uint64)[0] >> np.uint64(1))
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0 (or None), got {seed!r}")
        if isinstance(start_epoch, bool) or not isinstance(start_epoch, int) or start_epoch < 0:
            raise ValueError(f"start_epoch must be an int >= 0, got {start_epoch!r}")
        count = batches_per_epoch(n, batch_size, drop_remainder)
        if count == 0:
            if n == 0:
                raise ValueError("The source is empty: an epoch would have no batch.")
            raise ValueError(
                f"An epoch has no batch: {n} records, batch_size={batch_size}, drop_remainder=True. "
                "Lower batch_size or set drop_remainder=False."
            )
        options = dict(pool_options or {})
        reserved = sorted(set(options) & set(_RESERVED))
        if reserved:
            raise TypeError(f"pool_options may not set {reserved}: the Loader sets them itself.")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if not isinstance(device_prefetch, int) or device_prefetch < 1:
            raise ValueError(f"device_prefetch must be a positive int, got {device_prefetch!r}")
        from ._placement import check, resolve

        self.sharding = resolve(sharding, data_axis)
        sizes = {batch_size}
        if not drop_remainder and n % batch_size:
            sizes.add(n % batch_size)
        check(self.sharding, sizes)
        from .. import _os
        from ..pool import Pool

        workers = _os.cpu_count() if workers is None else workers
        if prefetch is None:
            prefetch = 2 * workers if isinstance(workers, int) else 2
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        options.setdefault("preload_jax", False)
        self.seed = int(seed)
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_remainder = bool(drop_remainder)
        self.timeout = timeout
        self._len = count
        self._next_epoch = start_epoch
        self._last: tuple[int, int] | None = None
        plan = Plan(source, transform, batch_transform, self.seed)
        self._pool = Pool(workers, initializer=install, initargs=(plan,), placement="host", **options)
        self._stream = _Stream(
            self._pool,
            n,
            batch_size,
            self.seed,
            self.shuffle,
            count,
            prefetch,
            device_prefetch,
            self.sharding,
        )
        self._finalizer = weakref.finalize(self, _shut_later, self._stream, self._pool)
        self._finalizer.atexit = False  # at exit: _stop_all, then the Pool's own exit hook
        _watch(self._stream)
        self._stream.start(start_epoch)  # the workers start on the first batches at once

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._len

    @property
    def epoch(self) -> int | None:
        """The epoch of the last batch the loop took (None before the first)."""
        return None if self._last is None else self._last[0]

    @property
    def position(self) -> tuple[int, int] | None:
        """``(epoch, batch)`` of the last batch the loop took (None before the first)."""
        return self._last

    def __iter__(self) -> Iterator[Any]:
        """The next epoch's batches (Note [the loader's stream])."""
        return _Batches(self, 1)

    def batches(self, epochs: int | None = None) -> Iterator[Any]:
        """Batches across ``epochs`` epochs (None: without end), from the next epoch's first."""
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be a positive int or None, got {epochs!r}")
        return _Batches(self, epochs)

    def close(self) -> None:
        """Stop the feeder and terminate the workers (idempotent). Batches already taken stay
        valid."""
        if self._finalizer.detach() is not None:
            _shut(self._stream, self._pool)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._stream.stopping.is_set() else f"next epoch {self._next_epoch}"
        return f"<jaxtransport.data.Loader {self._len} batches of {self.batch_size} per epoch, {state}>"


class _Batches:
    """An iterator of a Loader's batches for ``epochs`` epochs (None: without end), from the first
    batch of the next epoch when its first ``next()`` runs. A class, not a generator: a
    TimeoutError raised by ``next()`` leaves it usable (an exception ends a generator)."""

    def __init__(self, loader: Loader, epochs: int | None):
        self.loader, self.epochs = loader, epochs
        self.end: int | None = None
        self.ticket: int | None = None
        self.done = False

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        loader = self.loader
        stream = loader._stream
        if self.ticket is None:
            first = loader._next_epoch
            self.end = None if self.epochs is None else first + self.epochs
            self.ticket = stream.begin(first)
        epoch, number, batch = stream.take(self.ticket, loader.timeout)
        loader._last = (epoch, number)
        loader._next_epoch = epoch + 1
        if number == loader._len - 1 and self.end is not None and epoch + 1 >= self.end:
            self.done = True
        return batch


def _shut(stream: _Stream, pool: Any) -> None:
    stream.stop()
    pool.terminate()
    stream.join()


def _shut_later(stream: _Stream, pool: Any) -> None:
    """The finalizer of a Loader nobody holds: it may run in any thread, even one holding the
    pool's locks (a garbage collection starts at any allocation), so the work is done by a
    thread of its own, as the Pool's own finalizer does."""
    stream.stop()
    threading.Thread(target=_shut, args=(stream, pool), name="jaxtransport-data-reaper", daemon=True).start()


_STREAMS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK: list = []  # registered with the first Loader, not at import


def _watch(stream: _Stream) -> None:
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(_stop_all))
    _STREAMS.add(stream)


def _stop_all() -> None:
    """At interpreter exit: stop every feeder still running (the pools end by their own hook)."""
    for stream in list(_STREAMS):
        stream.stop()
        stream.join()


class _Stream:
    """The feeder and the queue between it and the loop (Note [the loader's stream])."""

    def __init__(
        self,
        pool: Any,
        n: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        per_epoch: int,
        prefetch: int,
        device_prefetch: int,
        sharding: Any,
    ):
        self.pool = pool
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.per_epoch = per_epoch
        self.prefetch, self.sharding = prefetch, sharding
        self.ready: queue.Queue = queue.Queue(device_prefetch)
        self.lock = threading.Lock()
        self.cursor = (0, 0)  # the next batch to submit
        self.floor = 0  # batches of epochs before this one are dropped
        self.ticket = 0  # the iterator allowed to take
        self.stopping = threading.Event()
        self.failed: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.order: tuple[int, np.ndarray] | None = None

    def start(self, epoch: int) -> None:
        self.cursor = (epoch, 0)
        self.floor = epoch
        self.thread = threading.Thread(target=self.feed, name="jaxtransport-data-feeder", daemon=True)
        self.thread.start()

    # -- the loop's side
    def begin(self, epoch: int) -> int:
        """A new iterator from epoch ``epoch``'s first batch; returns its ticket."""
        with self.lock:
            self.ticket += 1
            self.floor = epoch
            if self.cursor < (epoch, 0):
                self.cursor = (epoch, 0)
            return self.ticket

    def take(self, ticket: int, timeout: float | None) -> tuple[int, int, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ticket != self.ticket:
                raise RuntimeError("Another iterator of this Loader started: one iterator at a time.")
            if self.failed is not None:
                raise RuntimeError("The Loader stopped after an error (raised earlier in the loop).") from self.failed
            if self.stopping.is_set():
                raise RuntimeError("The Loader is closed.")
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(
                    f"No batch came within timeout={timeout} s (batches sent to the workers so far: up to "
                    f"{self.sent()}). A worker may be stopped (SIGSTOP, a debugger) or the function too slow "
                    "for this timeout; the iterator stays usable, so the next call waits again."
                )
            try:
                item = self.ready.get(timeout=wait)
            except queue.Empty:
                continue
            kind, epoch, number, value = item
            if kind == "error":
                self.failed = value
                raise value
            if epoch < self.floor:
                continue  # an epoch left early: dropped
            return epoch, number, value

    def sent(self) -> str:
        epoch, number = self.cursor
        if number:
            return f"batch {number - 1} of epoch {epoch}"
        return f"the end of epoch {epoch - 1}" if epoch else "none yet"

    # -- the feeder
    def indices(self, epoch: int, number: int) -> list[int]:
        if self.order is None or self.order[0] != epoch:
            self.order = (epoch, epoch_order(self.n, self.seed, epoch, self.shuffle))
        start = number * self.batch_size
        return self.order[1][start : start + self.batch_size].tolist()

    def advance(self) -> tuple[int, int]:
        with self.lock:
            epoch, number = self.cursor
            self.cursor = (epoch, number + 1) if number + 1 < self.per_epoch else (epoch + 1, 0)
            return epoch, number

    def feed(self) -> None:
        from ._placement import put

        pending: collections.deque = collections.deque()
        stopping = self.stopping
        try:
            while True:  # not `while <test>:` (Note [loops that end in a test] in jaxtransport._lockorder)
                if stopping.is_set():
                    break
                while True:
                    if len(pending) >= self.prefetch:
                        break
                    epoch, number = self.advance()
                    if epoch < self.floor:
                        continue
                    indices = self.indices(epoch, number)
                    pending.append((epoch, number, self.pool.apply_async(make_batch, (epoch, number, indices))))
                epoch, number, result = pending[0]
                if not result.ready():
                    result.wait(POLL_S)
                    continue
                pending.popleft()
                if epoch < self.floor:
                    continue  # an epoch left early: not put on the device
                try:
                    batch = put(result.get(), self.sharding)
                except BaseException as e:  # noqa: BLE001 - raised in the loop, where it is seen
                    if stopping.is_set():
                        return
                    _note(e, f"in jaxtransport.data.Loader: batch {number} of epoch {epoch}")
                    self.offer(("error", epoch, number, e))
                    return
                del result
                self.offer(("batch", epoch, number, batch))
                del batch
        except BaseException as e:  # noqa: BLE001 - the pool was terminated, or a bug: the loop sees it
            if not stopping.is_set():
                _note(e, "in jaxtransport.data.Loader's feeder")
                self.offer(("error", -1, -1, e))

    def offer(self, item: tuple) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=POLL_S)
                return
            except queue.Full:
                if item[0] == "batch" and item[1] < self.floor:
                    return

    def stop(self) -> None:
        self.stopping.set()

    def join(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10 * POLL_S + 5)
        while True:  # the batches queued for nobody
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break


def _note(e: BaseException, text: str) -> None:
    add = getattr(e, "add_note", None)
    if add is not None:
        add(text)
