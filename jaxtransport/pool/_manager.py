"""The manager thread: reads every worker's messages, watches their sentinels, replaces the dead.

Its loop (``run``) waits on each worker's pipe and process sentinel and on the engine's wake
pipe; it reads without blocking (``FrameReader``) and never writes to a pipe itself (it posts to
the workers' senders), so no worker can stall it. Each message is validated
(``_protocol.loads``); one that is malformed retires the worker that sent it (the task it ran
fails with CorruptTransferError, the worker is replaced), and an unexpected error inside the
loop breaks the pool with that error instead of leaving its callers waiting.

Handlers, one per message kind: ``on_result``, ``on_release``, ``on_forget``, ``on_ready``,
``on_leaving``, ``on_garbled``; and ``worker_exited`` for a process that ended.

The manager does not know the engine that owns it: it is given a :class:`Books` (the books
it reads and changes under their lock, and the few actions it asks for), which the engine is.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np

from .. import _os, _shm, _wire
from .._errors import CorruptTransferError, PoolStateError, RemoteTraceback, TransportError, WorkerLostError
from .._shm import Handle
from . import _protocol
from ._lifecycle import MAX_EARLY_DEATHS, Lifecycle
from ._processes import WorkerRec, close_worker, diagnose_start, signal_name
from ._protocol import RELEASE_FLUSH_S
from ._scheduler import Chunk, Scheduler
from ._trees import TreeBook

INIT_EXIT_GRACE_S = 2.0  # how long a worker whose initializer failed may take to exit by itself


def rebuild_error(report: _protocol.ErrorReport) -> BaseException:
    """The exception an ErrorReport carries, with the remote traceback as ``__cause__``; a
    TransportError naming the original class and message when it does not unpickle here."""
    import pickle

    try:
        exc = pickle.loads(report.exc)
        if not isinstance(exc, BaseException):
            raise TypeError(f"not an exception: {type(exc).__name__}")
    except Exception as e:  # noqa: BLE001
        exc = TransportError(
            f"{report.type_name}: {report.message} (raised in a pool worker; the exception "
            f"could not be rebuilt in the parent: {type(e).__name__}: {e})"
        )
    exc.__cause__ = RemoteTraceback(report.traceback)
    return exc


class Books(Protocol):
    """What the manager reads and asks of the part that owns it (the engine, ``_engine``): the
    books under ``lock`` (the scheduler, the worker list, the tree book), the arena, the flags,
    the wake pipe, whether a caller asked for a dispatch, and the actions below. The
    manager never names the engine's type."""

    @property
    def lock(self) -> Any: ...  # the engine's RLock over the books
    @property
    def flags(self) -> Lifecycle: ...
    @property
    def workers(self) -> list[WorkerRec]: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def arena(self) -> _shm.Arena: ...
    @property
    def trees(self) -> TreeBook: ...
    @property
    def waker(self) -> _os.Wake: ...
    @property
    def placement(self) -> str: ...
    @property
    def start_method(self) -> str: ...  # "spawn" or "forkserver": what the workers are told

    dispatch_asked: bool  # a caller queued a chunk for the manager to dispatch (lock held to set or clear)

    def dispatch(self) -> None:
        """Lock held: hand pending chunks to the workers that may take them."""

    def finish_chunks(self, done: list) -> None:
        """Complete the result of each ``(chunk, ok, value)``, a result object's chunks
        together (no lock held)."""

    def fail_chunk(self, chunk: Chunk, exc: BaseException) -> None:
        """Release a chunk's slots and fail its result (no lock held)."""

    def break_pool(self, err: BaseException, cause: BaseException | None = None) -> None:
        """Fail every unfinished task and stop the workers."""

    def start_worker(self, index: int) -> WorkerRec:
        """A new worker process in place ``index`` (lock held)."""

    def worker_environ(self, index: int) -> dict:
        """The environment worker ``index`` starts with."""

    def stalled(self, now: float) -> bool:
        """A hint, without the lock: may chunks wait behind a stalled one while a worker idles?"""

    def take_back(self) -> int:
        """Move chunks a stalled worker has not started to idle workers (takes the lock)."""

    def resume(self, w: WorkerRec) -> None:
        """``w``, held back after a take-back, showed it runs (takes the lock)."""

    def own_holder(self, handle: Handle) -> Any:
        """A holder over one of the parent's own slots that a worker sent back."""


# How often the loop looks for stalled workers at most (a scan over all of them; a take-back
# waits STALL_S anyway).
STALL_CHECK_S = 0.01


class Landed:
    """What the manager put of one chunk's result while the worker copied it (Note [a result
    put while it lands] in ``_codec``): the holders of its slots, made early and kept until the
    result's decode takes them (dropped sooner, they would let the worker reuse a slot the
    result still names), the device pieces by host piece, and how far each entry's pieces are
    put."""

    __slots__ = ("cache", "failed", "holders", "parts")

    def __init__(self) -> None:
        self.holders: dict = {}  # Handle -> holder (``_wire.decode``'s ``made``)
        self.cache: dict = {}  # ``_codec.put_landed``'s
        self.parts: dict = {}  # entry position -> [host pieces, next piece, its first byte]
        self.failed = False

    def put(self, mapper, msg: _protocol.Landing) -> None:
        from .. import _codec, _entries

        part = self.parts.get(msg.position)
        if part is None:
            if _codec._default_platform() == "cpu":  # the decode aliases the slot: nothing to overlap
                self.failed = True
                return
            rec = _entries.parse_entry(msg.entry)
            if type(rec) is not _entries.JaxEntry or len(rec.layout) != 1:
                raise CorruptTransferError("Corrupt message: a landing names no one-buffer array")
            (off, n), handle = rec.layout[0], rec.handle
            if off < 0 or n < 0 or off + n > handle.nbytes:
                raise CorruptTransferError(f"Corrupt message: a landing's buffer lies outside {handle!r}")
            holder = self.holders.get(handle)
            if holder is None:
                holder = self.holders[handle] = mapper.holder(handle)
            raw = np.frombuffer(holder, np.uint8, count=handle.nbytes)
            part = self.parts[msg.position] = [_codec.landing_pieces(rec.meta, raw[off : off + n]), 0, 0]
        pieces, i, start = part
        j, end = i, start
        while j < len(pieces) and end + pieces[j].nbytes <= msg.upto:
            end += pieces[j].nbytes
            j += 1
        if j > i:
            _codec.put_landed(pieces[i:j], self.cache)
            part[1], part[2] = j, end


class Manager:
    def __init__(self, engine: Books):
        self.engine = engine
        self.thread = threading.Thread(target=self.run, name="jaxtransport-pool-manager", daemon=True)
        self.last_flush = 0.0
        self.finished_any = False
        # This round's runs of results, (worker, results) each: their chunks leave the books
        # under one acquisition of the engine's lock for every worker (flush_results).
        self.results: list[tuple[WorkerRec, list]] = []
        self.early_deaths = 0  # workers in a row that died before they were ready
        self.roster_changed = True  # a worker died or was replaced: the loop re-reads the list

    def start(self) -> None:
        self.thread.start()

    # -- the loop
    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:  # noqa: BLE001 - never leave callers waiting on a dead thread
            if not self.engine.flags.stopped:
                err = PoolStateError(
                    f"The jaxtransport.Pool's manager thread failed ({type(e).__name__}: {e}); the pool "
                    "is broken. Please report this with the traceback (its __cause__)."
                )
                self.engine.break_pool(err, cause=e)

    def loop(self) -> None:
        poller = _os.Poller()  # select.poll, or a selector and connection.wait (Note [pipe io] in _os)
        try:
            self._loop(poller)
        finally:
            poller.close()

    def _loop(self, poller: _os.Poller) -> None:
        engine = self.engine
        roster: list = []  # the workers as last registered (the poller is rebuilt when it changes)
        workers: list = []
        last_stall_check = 0.0
        while True:
            flags = engine.flags
            if flags.terminated:
                return
            current = engine.workers
            if flags.closed or flags.broken is not None or len(current) != len(roster) or self.roster_changed:
                # Something may have changed: read the books under the lock (else nothing
                # per worker is done here per message: its cost must not grow with workers).
                with engine.lock:
                    if flags.terminated:
                        return
                    # A generator, not a filtered list comprehension (Note [loops that end in a test]).
                    workers = list(w for w in engine.workers if not w.dead)  # noqa: C400
                    if flags.closed and not workers and not engine.scheduler.pending:
                        return
                    if flags.broken is not None and not workers:
                        return
                    changed = self.roster_changed or [id(w) for w in workers] != [id(w) for w in roster]
                    self.roster_changed = False
                if changed:
                    roster = workers
                    wanted: dict[Any, tuple] = {engine.waker.waitable: ("wake", None)}
                    for w in workers:
                        wanted[w.sock] = ("conn", w)
                        wanted[w.sentinel] = ("sentinel", w)
                    poller.set(wanted)
            events = poller.poll(RELEASE_FLUSH_S)
            if engine.trees.collected:
                engine.trees.drain_collected()
            for kind, w in events:
                if flags.terminated:
                    return
                if kind == "wake":
                    engine.waker.drain()
                elif kind == "conn" and not w.dead:
                    self.read_from(w)
                elif kind == "sentinel" and not w.dead:
                    self.read_from(w)
                    self.worker_exited(w)
            done: list = []
            try:
                self.flush_results(later=done)
                if self.finished_any or engine.dispatch_asked:  # once per round of events
                    self.finished_any = False
                    with engine.lock:
                        engine.dispatch_asked = False
                        engine.dispatch()
            finally:
                if done:  # Note [dispatch before waking]
                    self.deliver(done)
            now = time.monotonic()
            if now - last_stall_check >= STALL_CHECK_S:  # a scan over the workers: not per message
                last_stall_check = now
                if engine.stalled(now):
                    engine.take_back()
            if now - self.last_flush >= RELEASE_FLUSH_S:
                self.last_flush = now
                self.flush(roster)

    def read_from(self, w: WorkerRec) -> None:
        """Handle what ``w`` sent; the loop dispatches once after a round of these (the
        places that results freed, every worker's at once). Runs of results wait in
        ``self.results`` for the end of the round (``flush_results``); anything else ``w``
        sent after them is handled once they are done, in the order sent."""
        frames, eof = w.reader.read()
        if frames and w.held_back:
            self.engine.resume(w)
        msgs: list = []
        for raw in frames:
            try:
                msgs.append(_protocol.loads(raw, _protocol.TO_PARENT))
            except CorruptTransferError as e:
                msgs.append(e)  # nothing after it is read: the worker is retired there
                break
        i = 0
        while i < len(msgs) and not w.dead:
            msg = msgs[i]
            if type(msg) is _protocol.Result:
                # A run of results: their chunks leave the books under one acquisition of
                # the engine's lock, then each is decoded and completed with no lock held.
                j = i + 1
                while j < len(msgs) and type(msgs[j]) is _protocol.Result:
                    j += 1
                self.results.append((w, msgs[i:j]))
                i = j
            elif isinstance(msg, CorruptTransferError):
                self.flush_results()
                self.retire(w, f"it sent a malformed message ({msg})")
                break
            else:
                self.flush_results()
                self.HANDLERS[type(msg)](self, w, msg)
                i += 1
        del msgs
        if eof and not w.dead:
            self.flush_results()
            self.worker_exited(w)

    def flush_results(self, later: list | None = None) -> None:
        """Complete the round's runs of results: their chunks leave the books under one
        acquisition of the engine's lock, then the results are decoded and delivered with no
        lock held (one ``finish_chunks`` for all). With many workers, one acquisition per
        worker per round let a thread submitting tasks and this one hand the lock back and
        forth for every result. ``later``: the completions are appended there for the caller
        to deliver after its dispatch (Note [dispatch before waking]), unless one failed.

        Note [dispatch before waking]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        At the end of a round the loop first sends the tasks that the round's results made
        room for, then wakes the results' waiters. A waiter woken first (the caller's thread
        in ``Future.result()`` or ``AsyncResult.get()``) wants the GIL at once, while this
        thread still holds it for the dispatch; woken last, it gets it as this thread blocks
        in its poll. 8 workers of 1 ms tasks on 2 cores, A/B alternating: the parent's CPU
        per task 96-97 -> 91-95 us for ``Executor.submit``, 89-92 -> 78-84 us for
        ``apply_async``, the wall time within the runs' noise. Books and slots are settled
        before the dispatch either way; only the wakeups move, by the time of one dispatch."""
        runs = self.results
        if not runs:
            return
        self.results = []
        engine = self.engine
        with engine.lock:
            chunks = [engine.scheduler.finished_many(w, [m.chunk_id for m in group]) for w, group in runs]
        done: list = []
        error: BaseException | None = None
        for (w, group), got in zip(runs, chunks):
            try:
                self.complete_many(w, group, got, done)
            except BaseException as e:  # noqa: BLE001 - the other workers' results still go
                error = error or e
        if later is not None and error is None:
            later.extend(done)
            return
        self.deliver(done)
        if error is not None:
            raise error

    def deliver(self, done: list) -> None:
        """``Engine.finish_chunks(done)``, then ``done`` emptied: no value outlives the call
        here (slots go back when their arrays die)."""
        try:
            self.engine.finish_chunks(done)
        finally:
            done.clear()

    def on_frame(self, w: WorkerRec, raw: bytes) -> None:
        try:
            msg = _protocol.loads(raw, _protocol.TO_PARENT)
        except CorruptTransferError as e:
            self.retire(w, f"it sent a malformed message ({e})")
            return
        handler = self.HANDLERS[type(msg)]
        handler(self, w, msg)

    def flush(self, workers) -> None:
        """Pass on releases of worker slots and the parent segments that were unmapped."""
        engine = self.engine
        if any(w.mapper.live for w in workers):
            _shm.collect_deferred()  # see collect_deferred: lets dead results release
        # Arrays of the parent's own slots that workers sent back and that died since: a
        # forwarded slot among them holds a worker's slot until applied (Note [forwarded slots]).
        engine.arena.apply_deferred()
        forgotten = engine.arena.take_forgotten()
        with engine.lock:
            for w in workers:
                self._flush_one(w, forgotten)  # a call: no loop here ends in a test (Note [loops that end in a test])

    @staticmethod
    def _flush_one(w: WorkerRec, forgotten) -> None:
        """Engine lock held: tell ``w`` which of its segments were forgotten and which of
        its slots were released."""
        if w.dead:
            return
        if forgotten:
            gone = [s for s in forgotten if s in w.sent_segs]
            if gone:
                w.sent_segs.difference_update(gone)
                w.post(_protocol.dumps(_protocol.Forget(gone)))
        if w.mapper.pending:
            rel = w.mapper.take_releases()
            if rel:
                w.post(_protocol.dumps(_protocol.Release([tuple(h) for h in rel])))

    # -- handlers
    def on_result(self, w: WorkerRec, msg: _protocol.Result) -> None:
        with self.engine.lock:
            chunk = self.engine.scheduler.finished(w, msg.chunk_id)
        self.complete(w, msg, chunk)

    def complete(self, w: WorkerRec, msg: _protocol.Result, chunk: Chunk | None) -> None:
        """A result whose chunk (None: no longer in flight) left the books: decode it, release
        what it says, complete the chunk's result (no lock held)."""
        done: list = []
        self.complete_many(w, [msg], [chunk], done)
        self.deliver(done)

    def complete_many(self, w: WorkerRec, msgs: list, chunks: list, done: list) -> None:
        """``complete`` of each of a run of results from ``w`` (``chunks[i]``: the chunk of
        ``msgs[i]``), their values delivered together: the results that are a pickle alone (a
        small task's) are unpickled under one placement, and each result object gets its chunks
        in one call (one lock acquisition, one wakeup of its waiter: ``Engine.finish_chunks``).
        The completions are appended to ``done`` for the caller's ``deliver``."""
        engine = self.engine
        pace = w.pace
        for m in msgs:
            pace = m.seconds if pace is None else 0.7 * pace + 0.3 * m.seconds
        w.pace = pace
        light = [m.data for m in msgs if m.ok and not m.entries]  # nothing in shared memory
        loaded = iter(_wire.loads_each(light, engine.placement) if light else ())
        for m, chunk in zip(msgs, chunks):
            if m.ok and not m.entries:
                ok, value = next(loaded)
            else:
                ok, value = self.decode(w, m)
            if m.releases or m.unheld:
                self.release_slots(w, m, chunk)
            if chunk is not None:
                note = getattr(chunk.result, "note_result", None)  # imap's window (IMapIterator)
                if note is not None:
                    note(bool(m.entries))
                done.append((chunk, ok, value))
            del value
        del loaded
        self.finished_any = True  # the loop dispatches what the freed places allow

    def decode(self, w: WorkerRec, msg: _protocol.Result) -> tuple[bool, Any]:
        """(ok, the value or the exception) of a result with shared-memory entries or an error."""
        engine = self.engine
        landed = w.landing.pop(msg.chunk_id, None) if w.landing else None
        if landed is not None:
            w.landing.clear()  # (no other chunk's can be left: one runs at a time)
        if msg.ok:
            try:
                if msg.entries and landed is not None:
                    from .. import _codec  # imported by the landing already

                    with _codec.landed(landed.cache):
                        own, made = engine.own_holder, landed.holders
                        value = _wire.decode(msg.data, msg.entries, w.mapper, engine.placement, own=own, made=made)
                    return True, value
                if msg.entries:
                    return True, _wire.decode(msg.data, msg.entries, w.mapper, engine.placement, own=engine.own_holder)
                return True, _wire.loads(msg.data, engine.placement)  # nothing in shared memory: the pickle alone
            except BaseException as e:  # noqa: BLE001 - this task's failure only
                return False, e
        try:
            return False, rebuild_error(_protocol.ErrorReport.parse(msg.data))
        except CorruptTransferError as e:
            return False, e

    def release_slots(self, w: WorkerRec, msg: _protocol.Result, chunk: Chunk | None) -> None:
        """The slots a result says the worker dropped, and those of its chunk it never held."""
        engine = self.engine
        unheld = msg.unheld
        for h in msg.releases:
            engine.arena.release(h, w.key)
        if chunk is not None and unheld and chunk.enc is not None:  # slots it never held
            # The chunk's own slots, by entry index (what we sent, whatever arrived).
            enc = chunk.enc
            owned = [i for i, e in enumerate(enc.entries) if e[0] in ("np", "jax")]
            by_index = dict(zip(owned, enc.handles))
            for i in unheld:
                h = by_index.get(i)
                if h is not None:
                    engine.arena.release(h, w.key)

    def on_release(self, w: WorkerRec, msg: _protocol.Release) -> None:
        for h in msg.handles:
            self.engine.arena.release(h, w.key)

    def on_forget(self, w: WorkerRec, msg: _protocol.Forget) -> None:
        w.mapper.forget(msg.seg_ids)

    def on_landing(self, w: WorkerRec, msg: _protocol.Landing) -> None:
        """Part of a large result is in the worker's slot: put its pieces on this process's
        device now, while the worker copies the rest (Note [a result put while it lands] in
        ``_codec``). Nothing here fails a task: a landing that cannot be used (a bad entry, no
        accelerator, no device memory) only loses the overlap, and the result's decode does the
        rest and validates everything, as without a landing."""
        if self.engine.placement != "device":
            return
        landed = w.landing.get(msg.chunk_id)
        if landed is None:
            w.landing.clear()
            landed = w.landing[msg.chunk_id] = Landed()
        if landed.failed:
            return
        try:
            landed.put(w.mapper, msg)
        except Exception:  # noqa: BLE001 - the decode puts it all, and says what is wrong
            landed.failed = True
            landed.cache.clear()

    def on_ready(self, w: WorkerRec, msg: _protocol.Ready) -> None:
        engine = self.engine
        if msg.ok:
            w.ready = True
            self.early_deaths = 0
            return
        exc = rebuild_error(msg.error)
        # The worker exits by itself once it has said so: let it (bounded), so that what its
        # initializer logged or put on a queue is flushed (at exit, multiprocessing joins its
        # queues' feeder threads), as a concurrent.futures worker's exit is what breaks its pool.
        w.proc.join(INIT_EXIT_GRACE_S)
        engine.break_pool(
            PoolStateError(
                f"The pool's initializer raised {msg.error.type_name}: {msg.error.message} in worker pid "
                f"{w.pid}; the pool cannot start workers and is broken. Fix the initializer and create a "
                "new pool."
            ),
            cause=exc,
        )

    def on_leaving(self, w: WorkerRec, msg: _protocol.Leaving) -> None:
        w.retiring = True

    def on_garbled(self, w: WorkerRec, msg: _protocol.Garbled) -> None:
        # The worker exits after saying so, before it starts anything sent after the bad
        # message: its in-flight chunks never started and run elsewhere (a chunk it was running,
        # if the bad message came while it waited for memory, fails: Note [started]).
        self.retire(w, f"it received a malformed message from the parent ({msg.description})")

    HANDLERS: ClassVar[dict[type, Callable[..., None]]] = {
        _protocol.Result: on_result,
        _protocol.Release: on_release,
        _protocol.Forget: on_forget,
        _protocol.Ready: on_ready,
        _protocol.Leaving: on_leaving,
        _protocol.Garbled: on_garbled,
        _protocol.Landing: on_landing,
    }

    def retire(self, w: WorkerRec, why: str) -> None:
        """The conversation with ``w`` is corrupt: kill it; ``worker_exited`` fails the task it
        ran with CorruptTransferError and replaces it."""
        if w.fault is None:
            w.fault = why
        try:
            w.proc.kill()
            w.proc.join(5)
        except Exception:
            pass
        self.worker_exited(w)

    # -- a worker ended
    def worker_exited(self, w: WorkerRec) -> None:
        engine = self.engine
        if w.dead:
            return
        self.flush_results()  # its results read so far leave the books before it does
        if w.fault is None:
            self.read_from_quietly(w)  # results it sent before dying are still in the pipe
        if w.dead:
            return
        w.proc.join(1.0)
        code = w.proc.exitcode
        with engine.lock:
            w.dead = True
            self.roster_changed = True
            if w in engine.workers:
                engine.workers.remove(w)
            running, queued = engine.scheduler.lost(w)  # those never started run elsewhere
            for chunk in queued:
                engine.arena.transfer(chunk.handles, w.key, chunk.key)
            engine.scheduler.requeue(queued)
            engine.arena.release_all(w.key)
            engine.trees.forget_worker(w)
        if running is not None:
            if w.fault is not None:
                err: BaseException = CorruptTransferError(
                    f"A jaxtransport.Pool worker (pid {w.pid}) was replaced because {w.fault}; the "
                    "task it was running has no result. Other tasks go on."
                )
            else:
                err = WorkerLostError(
                    f"A jaxtransport.Pool worker (pid {w.pid}) {self.how(code)} while running this task, so "
                    "the task has no result. The pool replaced the worker and keeps running other tasks; "
                    "resubmit the task if it is safe to run again, or lower its memory use if it was "
                    "killed for that."
                )
            engine.fail_chunk(running, err)
        close_worker(w)
        spawn_error = None
        with engine.lock:
            if not w.ready and w.fault is None:
                self.early_deaths += 1
            if engine.flags.stopped:
                return
            if self.early_deaths < MAX_EARLY_DEATHS and not (
                engine.flags.closed and engine.scheduler.idle(engine.workers)
            ):
                try:
                    engine.workers.append(engine.start_worker(w.index))
                    self.roster_changed = True
                except Exception as e:  # noqa: BLE001
                    self.early_deaths = MAX_EARLY_DEATHS
                    spawn_error = e
                else:
                    engine.dispatch()
                    return
        if self.early_deaths >= MAX_EARLY_DEATHS:
            if spawn_error is None and not w.reached_worker_code():
                # It died running the main script as __mp_main__: show why (no lock held).
                why = "It died while starting up, before any jaxtransport code ran in it. " + diagnose_start(
                    engine.worker_environ(w.index), engine.start_method
                )
            else:
                why = (
                    "Check that the worker environment (worker_env, JAX_PLATFORMS, CUDA) and the "
                    "initializer work (their output is on the workers' stderr)."
                )
            engine.break_pool(
                WorkerLostError(
                    f"{MAX_EARLY_DEATHS} jaxtransport.Pool workers in a row died before they were ready "
                    f"(the last, pid {w.pid}, {self.how(code)}): the pool is broken. {why}"
                ),
                cause=spawn_error,
            )
        with engine.lock:
            engine.dispatch()

    def read_from_quietly(self, w: WorkerRec) -> None:
        try:
            frames, _eof = w.reader.read()
        except Exception:  # noqa: BLE001
            return
        for raw in frames:
            if w.dead:
                return
            self.on_frame(w, raw)  # worker_exited dispatches afterwards

    @staticmethod
    def how(code) -> str:
        if code is None:
            return "stopped responding (its pipe closed)"
        if code < 0:
            oom = code == -getattr(signal, "SIGKILL", 9)
            return f"was killed by {signal_name(code)}" + (
                " (the out-of-memory killer sends SIGKILL: check `dmesg`)" if oom else ""
            )
        return f"exited with code {code} (os._exit() or sys.exit() in the task, or a crash in native code)"
