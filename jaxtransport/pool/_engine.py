"""The engine behind jaxtransport.Pool: it owns the parts and the one lock over their books.

Its parts, their threads and the lock order are drawn in the package docstring (Note [pool
engine]). Finalizers never take the engine's lock (see
``TreeBook.queue_release`` and ``terminate_unreferenced``).

Note [one task on a busy pool]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A single small chunk (``apply_async``, ``submit``, an imap chunk fed one at a time) sent to a
pool where any chunk is in flight is queued, and the manager thread dispatches what is queued
at its next wake (``dispatch_asked``, set under the lock; one write to the wake pipe when it
goes from False to True). Sending it from the calling thread, as before, made a burst of
``apply_async`` on many workers hand the GIL and the engine's lock back and forth with the
manager for every task (each ``sendmsg`` releases the GIL; each woke a worker that had just gone
idle): bimodal runs, 60-80 us per task in the bad ones at 16 workers. Queued, a burst is sent by
the manager in one write per worker per round, as ``multiprocessing.Pool``'s task thread sends
it. On an idle pool the caller still sends at once (a lone ``apply`` pays no thread hop); a
chunk with shared memory or a tree, and a map's chunks, are dispatched at once as before.

Note [a result sent on]
~~~~~~~~~~~~~~~~~~~~~~
A worker's result arrives as a jax.Array over the worker's own slot (Note [slot lifetime] in
``_shm``). Fed into a later task (map after map, a result passed to ``apply_async``, put in a
SharedTree), it is not copied into the parent's arena: ``_adopt`` books that slot as a
forwarded slot of the parent's arena (Note [forwarded slots] in ``_shm``), keeping the parent's
holder of it, and the task names it by handle. The target worker receives the segment's fd as
it receives the parent's own (the parent keeps its workers' segment fds while mapped, a few per
worker), and its release, its death, a take-back or a requeue move and drop the reference
as for any slot of the parent's. The owner's slot is held by the parent's holder, so it cannot
be reused while any task or worker holds the forwarded one, and the owner's death takes
nothing away: its memory lives while any fd or mapping of it does. What still copies: an array
that is not exactly one whole result slot (a slice, several buffers, a sharded array), a result
of a worker that has exited, numpy results, a worker whose segment fds went over its share, and
a pool in in-band mode.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .. import _lockorder, _os, _shm, _wire
from .._errors import PoolStateError, PoolTerminatedError, ShmCapacityError, ShmHandleError
from .._nojax import first_tracer
from .._shm import Handle
from . import _launch, _protocol
from ._lifecycle import Lifecycle
from ._manager import Manager
from ._pins import Pins
from ._processes import WorkerRec, adopt, close_worker
from ._results import CallbackRunner
from ._scheduler import Chunk, ChunkRun, Scheduler
from ._trees import TreeBook, TreeRec

IMAP_WIDE = 8  # how much wider imap's window gets for results that need no shared memory
IMAP_WIDER = 64  # ... when its arguments needed none either (nothing of it in shared memory)
# Note [few objects per waiting chunk]
# A map of many small chunks keeps every chunk in the books until its result is back. Each
# object of a chunk that the garbage collector tracks and that outlives a young collection is
# promoted, and promotions start full collections, whose cost grows with everything the
# process holds (with JAX imported, one 10,000-chunk map cost a 50 ms full collection: 5 us a
# task). So a chunk with nothing in shared memory is its pickle alone (``bytes``, which the
# collector does not track) from ``prepare_calls`` on; a map's or an imap batch's such chunks
# wait as one ``ChunkRun``, each made a ``Chunk`` (with no ``Encoded``: the pickle is its
# ``data``) only when the scheduler hands it out; and the wire's empty entries are one shared
# list, ``NO_ENTRIES``, which nothing ever changes. What a 10,000-chunk map keeps alive is then
# its chunks in flight, not all of them.
NO_ENTRIES: list = []
IMAP_TOLD = 1 << 62  # imap_need once waiting feeders were woken (no second notify)
SPACE_POLL_S = 0.02  # how often a caller waiting for space (memory, imap's backpressure) looks again
# A worker's chunks it has not started go to an idle worker once its running chunk has run this
# long (10x the scheduler's QUICK_S: only chunks of quick workers wait behind a running one).
STALL_S = 0.05

_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()
_atexit_registered = False


def _terminate_live_pools() -> None:
    for engine in list(_LIVE):
        try:
            engine.terminate()
        except Exception:
            pass


def _register_atexit() -> None:
    # Lazily, at the first Pool: importing jaxtransport has no side effects.
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_terminate_live_pools)


class Engine:
    def __init__(
        self,
        *,
        spec: _launch.Spec,
        processes,
        init_call,
        shm_capacity,
        tree_type,
        started: list | None = None,
    ):
        """``spec``: what the workers start with; ``init_call``: the pool's ``InitCall`` (or
        None); ``started``: workers ``spec`` already started for places 0, 1, ... (Note [launch
        first] in ``_launch``): each is adopted and removed from the list, and the rest are
        started here. What is left in ``started`` when this raises is the caller's."""
        self.spec = spec
        self.ctx = spec.ctx
        self.tree_type = tree_type  # SharedTree: what travels as a broadcast handle
        self.start_method = spec.start_method
        self.processes = processes
        self.maxtasks = spec.maxtasks
        self.threshold = spec.threshold
        self.placement = spec.placement
        # Pickled anew as each worker starts, like the stock pools' initargs (Note [initargs]).
        # Note [initargs dropped]: once the pool can start no worker again (broken, terminated,
        # or joined), it lets go of the initializer and its arguments, under the lock that the
        # manager holds while it checks the flags and starts a replacement. They are the
        # caller's objects: a multiprocessing.Queue among them owns three named semaphores,
        # unlinked only when the last reference goes, and the engine may live on in a cycle
        # (its manager, its tree book) until the cyclic collector runs (python/cpython#104090).
        self.init_call = init_call
        self.futures = spec.futures  # an Executor's pool: concurrent.futures' error contract in workers
        self.arena = _shm.Arena(shm_capacity, label="the pool's parent process")
        self.pins = Pins(self.arena)  # jax.Arrays copied once, sent again by handle
        self.flags = Lifecycle()
        # The engine's lock: the scheduler, the worker list and records, the tree book.
        self.lock = _lockorder.rlock("Engine.lock")
        self.scheduler = Scheduler()
        self.workers: list[WorkerRec] = []
        self.trees = TreeBook(self)
        self.chunk_ids = itertools.count()
        self.serials = itertools.count()
        self.tls = threading.local()
        self.space = _lockorder.condition("Engine.space")  # imap feeding backpressure
        self.imap_waiting = 0  # imap feeders waiting on space (a hint for imap_progress)
        self.imap_need = 0  # chunks to finish or be consumed before a waiting feeder has room
        self.callbacks = CallbackRunner()
        self.waker = _os.Wake()  # the manager's self-pipe
        self.dispatch_asked = False  # the manager dispatches at its next wake (Note [one task on a busy pool])
        self._released = False
        self.manager = None
        try:
            for i in range(processes):
                if started:
                    self.workers.append(adopt(started[0], i, next(self.serials), self.maxtasks))
                    del started[0]  # the engine's now (while adopt may raise, the caller's)
                else:
                    self.workers.append(self.start_worker(i))
        except BaseException:
            self.terminate()
            raise
        self.manager = Manager(self)
        self.manager.start()
        _LIVE.add(self)
        _register_atexit()

    # -- flags, read by the facade
    @property
    def closed(self) -> bool:
        return self.flags.closed

    @property
    def terminated(self) -> bool:
        return self.flags.terminated

    @property
    def broken(self) -> BaseException | None:
        return self.flags.broken

    def check_running(self) -> None:
        self.flags.check_running()

    # -- workers
    def worker_environ(self, index: int) -> dict:
        """The variables worker ``index`` starts with (``_procenv.worker_env``)."""
        return self.spec.environ(index)

    def start_worker(self, index: int) -> WorkerRec:
        return adopt(self.spec.launch(index, self.init_call), index, next(self.serials), self.maxtasks)

    def wake(self) -> None:
        self.waker.set()

    def new_segments(self, w: WorkerRec, seg_ids) -> list:
        """Lock held: (seg_id, size, fd) of the segments ``w`` has not received yet, now marked
        as sent (its sender passes them before the message that needs them)."""
        out = []
        for seg_id in seg_ids:
            if seg_id in w.sent_segs:
                continue
            seg = self.arena.segment(seg_id)
            if seg is None or seg.fd is None:
                continue
            out.append((seg_id, seg.size, seg.fd))
            w.sent_segs.add(seg_id)
        return out

    # -- submitting (caller threads)
    def wait_for_space(self) -> float | bool:
        """Arena wait hook for the caller's thread (see Arena.alloc; called with no lock held):
        wait while tasks that will release memory are in flight; give up after a grace period
        when none is, or at once when the pool has stopped (``_commit`` then says so)."""
        if self.flags.stopped:
            return False
        self.pins.drop_all()  # memory is short: arrays sent again are copied again
        busy = self.in_flight() > 0
        now = time.monotonic()
        start = getattr(self.tls, "wait_start", None)
        if busy or start is None:
            self.tls.wait_start = start = now
        if not busy and now - start > _launch.CAPACITY_GRACE_S:
            return False
        return SPACE_POLL_S

    def share(self, tree: Any) -> TreeRec:
        """``Pool.share``: ``tree`` pickled with its large arrays copied once into the arena,
        booked as a shared tree (TracerTransportError, with the path under ``tree``, before any
        memory is taken)."""
        rec = self.trees.new()
        prep = _wire.prepare(
            tree, threshold=self.threshold, tree_type=None, locate=lambda: first_tracer((tree, "tree"))
        )
        rec.enc = self._commit(prep, rec.key, pin=False)  # release() gives its memory back
        rec.nbytes = sum(h.nbytes for h in rec.enc.handles)
        self.trees.add(rec)
        return rec

    # -- imap's backpressure (its feeder threads)
    def imap_window(self, light_results: int, light_args: bool = False) -> int:
        """How many of an imap's chunks may be in flight or finished and not consumed:
        ``2 * processes + 2``, and ``IMAP_WIDE`` times that once as many results in a row came
        back without shared memory (small results: piling them up costs only the parent's
        memory, as for multiprocessing.Pool, which does not bound imap at all; a deeper queue
        keeps tiny tasks' workers busy), ``IMAP_WIDER`` times when no argument sent so far
        needed shared memory either (``light_args``): the feeder is woken once half the window
        is free, and the rest must keep the workers busy until it has run (a thread woken on a
        busy machine may wait milliseconds for a core). Never widened once a result used
        shared memory."""
        limit = 2 * self.processes + 2
        if light_results < limit:
            return limit
        return limit * (IMAP_WIDER if light_args else IMAP_WIDE)

    def wait_for_imap_room(
        self, unconsumed: Callable[[], int], light_results: Callable[[], int], light_args: bool = False
    ) -> int:
        """Wait until at least half of ``imap_window`` chunks may be sent: that many less are
        in flight or finished and not consumed (``unconsumed()``: the iterator's). Returns how
        many may be sent now (so a feeder sends a batch per wait, not a chunk); raises
        PoolStateError once the pool has stopped. Woken by ``imap_progress`` once enough chunks
        finished or were consumed, and looks again every ``SPACE_POLL_S`` anyway."""
        space = self.space
        while True:  # parks on ``space`` (Note [waits a Ctrl-C cannot break] in _lockorder)
            with space:
                if self.flags.stopped:
                    break
                limit = self.imap_window(light_results(), light_args)
                want = max(1, limit // 2)
                busy = self.in_flight()
                room = limit - busy - unconsumed()
                if room >= want or (room > 0 and busy == 0):
                    return room
                self.imap_need = max(1, want - room)
                self.imap_waiting += 1
                ticket = space.park()
            woken = _lockorder.sleep(ticket, SPACE_POLL_S)
            with space:
                self.imap_waiting -= 1
                if not woken:
                    space.unpark(ticket)
        raise PoolStateError("Pool not running: it was terminated while imap was feeding it.")

    def imap_progress(self, chunks: int = 1) -> None:
        """``chunks`` finished or an imap result was consumed: wake a waiting feeder once enough
        did (a hint read without a lock; the feeder also looks again on its own)."""
        if self.imap_waiting:
            self.imap_need -= chunks
            if self.imap_need <= 0:
                with self.space:
                    # Once: until the woken feeder runs, every result and every item taken
                    # would notify again (thousands of lock round trips in a tiny-task imap).
                    # A feeder that waits again sets its need anew, under this lock.
                    if self.imap_need <= 0:
                        self.imap_need = IMAP_TOLD
                        self.space.wake_all()

    def function_blob(self, fn):
        return _wire.function_blob(fn, threshold=self.threshold, locate=lambda: first_tracer((fn, "func")))

    def prepare_chunks(self, fn, mode, parts: list, locates: Any) -> list[_wire.Prepared | bytes]:
        """``prepare_chunk`` of each part (with its ``locates[i]``), one pickler for all."""
        return _wire.prepare_calls(
            _wire.task_function(fn), mode, parts, threshold=self.threshold, tree_type=self.tree_type, locates=locates
        )

    def prepare_chunk(self, fn, mode, items, locate) -> _wire.Prepared | bytes:
        """One chunk prepared, in the form ``prepare_chunks`` gives (``bytes``: a plain chunk)."""
        return _wire.plain(
            _wire.prepare(
                (_wire.task_function(fn), mode, items),
                threshold=self.threshold,
                tree_type=self.tree_type,
                locate=locate,
            )
        )

    def submit(self, prep: _wire.Prepared | bytes, result, index: int) -> None:
        """Copy a prepared chunk's arrays into shared memory and queue it (``bytes``: a plain
        chunk's pickle, as ``prepare_chunks`` gives it)."""
        chunk_id = next(self.chunk_ids)
        enc: Any
        if isinstance(prep, bytes):  # nothing to copy (the common small task)
            enc = prep
        else:
            self.trees.check_usable(prep.trees)
            enc = self._commit(prep, ("chunk", chunk_id))
        self._enqueue([Chunk(chunk_id, result, index, enc)])

    def _commit(self, prep: _wire.Prepared, borrower: Any, pin: bool = True) -> _wire.Encoded:
        """``_wire.commit`` into the parent's arena, waiting for memory (``wait_for_space``).
        A pool terminated or broken meanwhile raises its PoolStateError, whether the wait hook
        gave up or the arena was closed under the waiting caller: the ShmCapacityError either
        raises would blame memory for a stopped pool."""
        self.tls.wait_start = None
        try:
            return _wire.commit(
                prep,
                arena=self.arena,
                borrower=borrower,
                wait=self.wait_for_space,
                adopt=self._adopt,
                copied=self.pins.pin if pin else None,
            )
        except ShmCapacityError:
            if self.flags.stopped:
                self.flags.check_running()
            raise

    def _adopt(self, x: Any, borrower: Any) -> tuple | None:
        """``_wire.commit``'s ``adopt``: ``(entry, handle)`` naming a slot already in shared
        memory, with a reference for ``borrower``, when the jax.Array ``x`` was copied into the
        parent's arena before and lives (Note [the same array again] in ``_pins``), or is
        exactly a live result slot of a running worker whose segment fd the parent kept, the
        slot then booked in the parent's arena (Note [a result sent on]); else None."""
        got = self.pins.find(x, borrower)
        if got is not None:
            return got
        workers = self.workers

        def lookup(ptr: int, nbytes: int):
            for w in list(workers):
                if w.mapper.live and w.mapper.held_at(ptr, nbytes) is not None:
                    return w, ptr, nbytes
            return None

        def book(found) -> Handle | None:
            w, ptr, nbytes = found
            with self.lock:  # a worker's fds close only once it left ``workers`` under this lock
                got = None if w.dead or w not in workers else w.mapper.held_at(ptr, nbytes)
                if got is None or got[2] is None:
                    return None
                h, holder, fd, size = got
                return self.arena.adopt((w.serial, h.seg), fd, size, h, holder, borrower)

        return _wire.forward_entry(x, lookup, book)

    def submit_plain(self, items: list) -> None:
        """Queue chunks that hold no large array and no SharedTree (nothing to copy) in one go,
        ``items`` being (the chunk's pickle, result, index) each: one lock acquisition and one
        dispatch, so each worker gets its share of them in one write. All or none are queued."""
        ids = self.chunk_ids
        self._enqueue([Chunk(next(ids), result, index, data) for data, result, index in items])

    def submit_run(self, datas: list, result, index: int) -> None:
        """``submit_plain`` of the chunks of ``result`` whose pickles are ``datas``, the first
        of index ``index``: they wait as one ChunkRun, each made a Chunk only when the
        scheduler reaches it (Note [few objects per waiting chunk]). ``datas`` is the run's."""
        self._enqueue([], ChunkRun(datas, result, index, self.chunk_ids))

    def _enqueue(self, chunks: list, run: ChunkRun | None = None) -> None:
        """Queue committed chunks (then ``run``'s) and dispatch them, or have the manager
        dispatch them (Note [one task on a busy pool]); their slots are released if the pool
        stopped meanwhile."""
        wake = False
        try:
            with self.lock:
                # No loop here ends in a test: a Ctrl-C there would leave this lock held for ever
                # (Note [loops that end in a test]).
                if self.flags.stopped:
                    for chunk in chunks:
                        if not chunk.handles:
                            continue
                        self.arena.release_all(chunk.key)
                    raise PoolStateError("Pool not running: it was terminated or broke while the task was being sent.")
                for chunk in chunks:
                    if not chunk.trees:
                        continue
                    self.trees.use(chunk.trees)
                self.scheduler.add_many(chunks)
                if run is not None:
                    self.scheduler.add_run(run)
                if run is None and (
                    len(chunks) == 1
                    and chunks[0].small
                    and (self.dispatch_asked or any(w.outstanding for w in self.workers))
                ):
                    wake, self.dispatch_asked = not self.dispatch_asked, True
                else:
                    try:
                        self.dispatch()
                    except BaseException:
                        # Note [a Ctrl-C while dispatching]: what is still pending, the manager sends.
                        wake, self.dispatch_asked = not self.dispatch_asked, True
                        raise
        finally:
            if wake:
                self.wake()

    def dispatch(self) -> None:
        """Lock held: hand pending chunks to workers that may take them and post them."""
        # Tasks that need no segment or tree first go to a worker in one write (a map's chunks:
        # one send and one wakeup of the worker instead of one per chunk); order per worker kept.
        batches: dict = {}
        for w, chunk in self.scheduler.assign(self.workers):
            w.sent += 1
            chunk.seq = w.sent
            enc = chunk.enc
            segs = None
            if enc is None:  # a plain chunk: its pickle alone
                entries = NO_ENTRIES
            else:
                entries = enc.entries
                if enc.handles:
                    self.arena.transfer(enc.handles, chunk.key, w.key)
                if chunk.trees or enc.segs:
                    batch = batches.pop(w, None)
                    if batch:
                        w.post(batch)
                    if chunk.trees:
                        self.trees.define_in(w, chunk.trees)
                    segs = self.new_segments(w, enc.segs)
            mapper = w.mapper
            releases = mapper.take_releases(64) if (mapper.pending or mapper.live) else []
            task = _protocol.task(chunk.chunk_id, chunk.data, entries, releases)
            if segs:
                w.post(task, segs)
            else:
                batches.setdefault(w, []).append(task)
        # Note [a Ctrl-C while dispatching]
        # A caller's thread dispatches (the main thread, in a Ctrl-C's way): a KeyboardInterrupt
        # that lands in one worker's post (most often just after its write) must not keep the
        # other workers' batches, already counted as theirs, from going out: they would never
        # run, pool.join() would wait for them for ever, and a worker whose tasks never came is
        # taken out of the rotation once they are taken back. So every batch is posted, one
        # whose post was interrupted before it wrote or queued anything (``Sender.committed``
        # still False: the interrupt came at the call's start) is posted again, then the
        # interrupt is raised again; and ``_enqueue`` has the manager dispatch what an
        # interrupted dispatch left pending. An interrupt between handing a chunk to a worker
        # and staging its task can still lose it (a narrower window, CHANGELOG).
        interrupted: BaseException | None = None
        for w, batch in batches.items():
            sender = w.sender
            sender.committed = False
            try:
                sender.post(batch)
            except BaseException as e:  # noqa: BLE001 - raised again below
                interrupted = interrupted or e
                if not sender.committed:
                    sender.post(batch)
        if interrupted is not None:
            raise interrupted
        if self.flags.closed:
            self.maybe_stop()

    def stalled(self, now: float) -> bool:
        """Manager thread, without the lock (a hint): may a worker hold chunks it has not
        started behind one that runs longer than ``STALL_S``, while another worker is idle?"""
        workers = list(self.workers)
        idle = False
        stalled = False
        for w in workers:
            if w.held_back and w.cell[3] >= w.held_back:
                self.resume(w)  # it read and skipped what was taken back: it runs again
            out = w.outstanding
            try:
                first = out[0]
            except IndexError:
                idle = idle or w.can_take()
                continue
            if now - first.began > STALL_S and w.claim is not None and (len(out) > 1 or w.cell[1] < first.seq):
                stalled = True
        return idle and stalled

    def resume(self, w: WorkerRec) -> None:
        """Manager thread: ``w``, held back after a take-back, showed it runs: it may take
        chunks again."""
        if w.held_back:
            with self.lock:
                w.held_back = 0
                self.dispatch()

    def take_back(self) -> int:
        """Manager thread: chunks waiting on a worker whose running chunk has run longer than
        ``STALL_S`` (a long task, a stopped or descheduled process), or that has not started
        its first one in that time, go back to the front of the queue and to an idle worker.
        A chunk the worker started stays with it; none ever runs twice (Note [taking back a
        chunk] in ``_worker``). Returns how many moved."""
        now = time.monotonic()
        with self.lock:
            if self.flags.stopped:
                return 0
            if not any(not w.outstanding and w.can_take() and w.alive() for w in self.workers):
                return 0
            moved = []
            for w in self.workers:
                if w.dead or not w.outstanding or now - w.outstanding[0].began <= STALL_S:
                    continue
                back = w.take_back_unstarted()
                for chunk in back:
                    self.arena.transfer(chunk.handles, w.key, chunk.key)
                moved.extend(back)
            if moved:
                self.scheduler.requeue(moved)
                self.dispatch()
        return len(moved)

    def maybe_stop(self) -> None:
        """Lock held: when closed and nothing is left, tell the workers to exit."""
        if not self.scheduler.idle(self.workers):
            return
        stop = _protocol.dumps(_protocol.Stop())
        for w in self.workers:
            if not w.stop_sent:
                w.stop_sent = True
                w.post(stop)

    def in_flight(self) -> int:
        """Chunks pending or in flight, read without the engine's lock (a snapshot that may be
        one event old: callers use it for backpressure and look again). Lock-free so that a
        thread holding another lock (a waiting imap feeder holds ``space``) may read it."""
        return self.scheduler.in_flight(list(self.workers))

    # -- completing (manager thread, or any thread that fails chunks)
    def finish_chunk(self, chunk: Chunk, ok: bool, value) -> None:
        if chunk.trees:
            with self.lock:
                self.trees.done(chunk.trees)
        result, chunk.result = chunk.result, None
        try:
            if result is not None:
                self.callbacks.deliver(result, chunk.index, ok, value)
        finally:
            if self.imap_waiting:
                self.imap_progress()

    def finish_chunks(self, done: list) -> None:
        """``finish_chunk`` of each ``(chunk, ok, value)`` of a run of results (the manager):
        a result object's chunks in a row go to it in one call (``CallbackRunner.deliver_many``:
        one acquisition of its lock, one wakeup of whoever waits on it)."""
        with_trees = [chunk for chunk, _ok, _value in done if chunk.trees]
        if with_trees:
            with self.lock:
                for chunk in with_trees:
                    self.trees.done(chunk.trees)
        deliver_many = self.callbacks.deliver_many
        try:
            current = None
            run: list = []
            for chunk, ok, value in done:
                result, chunk.result = chunk.result, None
                if result is None:
                    continue
                if result is not current:
                    if run:
                        deliver_many(current, run)
                    current, run = result, []
                run.append((chunk.index, ok, value))
            if run:
                deliver_many(current, run)
        finally:
            if self.imap_waiting:
                self.imap_progress(len(done))

    def fail_chunk(self, chunk: Chunk, exc: BaseException) -> None:
        if chunk.handles:
            self.arena.release_all(chunk.key)
        self.finish_chunk(chunk, False, exc)

    def own_holder(self, handle: Handle):
        """A holder over this process's own slot (a worker sent back one of our arrays)."""
        seg = self.arena.segment(handle.seg)
        off, nbytes = handle.offset, handle.nbytes
        mm = None if seg is None or off + nbytes > seg.size else self.arena.mapping(handle.seg)
        if mm is None or not self.arena.acquire(handle, "self"):
            raise ShmHandleError(
                f"Bad shared-memory handle {tuple(handle)!r}: a worker referred to memory of this "
                "process that is not live (freed, truncated or out of bounds)."
            )
        holder = (ctypes.c_char * max(nbytes, 1)).from_buffer(mm, off)
        weakref.finalize(holder, self.arena.defer_release, handle, "self")
        return holder

    def break_pool(self, err: BaseException, cause: BaseException | None = None) -> None:
        """The pool cannot go on: fail every unfinished task with ``err`` and stop the workers."""
        if cause is not None:
            err.__cause__ = cause
        if not self.flags.set_broken(err):
            return
        with self.lock:
            victims = self.scheduler.take_all(self.workers)
            self.init_call = None  # Note [initargs dropped]
        for chunk in victims:
            # A copy for the callers: the instance the pool keeps is never raised, so a caller's
            # frames (which raising adds to an exception's traceback) never hang off the pool.
            self.fail_chunk(chunk, _own_copy(err))
        self.kill_workers()
        self.wake()

    # -- shutting down
    def close(self) -> None:
        self.flags.close()
        with self.lock:
            self.maybe_stop()
        self.wake()

    def own_threads(self) -> tuple:
        return tuple(t for t in (getattr(self.manager, "thread", None), self.callbacks.thread) if t is not None)

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() in self.own_threads():
            raise PoolStateError("Cannot join a jaxtransport.Pool from one of its own callbacks.")
        if self.manager is not None:
            self.manager.thread.join(timeout)
        for w in list(self.workers):
            w.proc.join(timeout)
        self.release_resources()

    def kill_workers(self) -> None:
        with self.lock:
            workers = list(self.workers)
        for w in workers:
            try:
                w.proc.kill()
            except Exception:
                pass
        for w in workers:
            try:
                w.proc.join(5)
            except Exception:
                pass

    def terminate(self) -> None:
        if not self.flags.terminate():
            return
        with self.lock:
            victims = self.scheduler.take_all(self.workers)
            self.init_call = None  # Note [initargs dropped]
        self.kill_workers()
        self.wake()
        err = PoolTerminatedError(
            "The jaxtransport.Pool was terminated (terminate(), the end of its `with` block, garbage "
            "collection or interpreter exit) before this task's result arrived."
        )
        for chunk in victims:
            try:
                self.fail_chunk(chunk, _own_copy(err))
            except Exception:
                pass
        me = threading.current_thread()
        if self.manager is not None and self.manager.thread is not me and self.manager.thread.is_alive():
            self.manager.thread.join(5)
        self.release_resources()

    def release_resources(self) -> None:
        with self.lock:
            if self._released:
                return
            if any(w.proc.is_alive() for w in self.workers):
                return
            self._released = True
            workers = list(self.workers)
            self.workers.clear()
            self.init_call = None  # Note [initargs dropped]
        for w in workers:
            close_worker(w)
        self.callbacks.close()
        self.arena.close()
        self.waker.close()
        _LIVE.discard(self)


def _own_copy(err: BaseException) -> BaseException:
    """``err`` anew (same class, arguments and cause; jaxtransport's errors pickle, so they copy),
    or ``err`` itself when it cannot be copied."""
    import copy

    try:
        dup = copy.copy(err)
    except Exception:  # noqa: BLE001 - a class that does not copy: the original, as before
        return err
    dup.__traceback__ = None
    dup.__cause__ = err.__cause__
    return dup


def terminate_unreferenced(engine: Engine) -> None:
    if not engine.terminated and not engine._released:
        warnings.warn(
            "a jaxtransport.Pool was garbage-collected while running: it was terminated. Use it "
            "as a context manager or call close() and join() (or terminate()).",
            ResourceWarning,
            stacklevel=2,
        )
    # A finalizer may run inside any thread, even one holding this pool's locks (a garbage
    # collection can start at any allocation): terminate from a thread of its own.
    threading.Thread(target=engine.terminate, name="jaxtransport-pool-reaper", daemon=True).start()
