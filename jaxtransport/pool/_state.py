"""The machinery behind jaxtransport.Pool: worker records, scheduling, the manager and feeder
threads, crash handling and shutdown (see ``_facade.py`` for the public API and the overview).

The parent runs two daemon threads per pool: a *manager* (reads results, watches worker
sentinels, schedules chunks, replaces dead workers) and a *feeder* (writes large messages, so
that a full pipe never blocks result reading; small chunks are written directly). At most
``_PREFETCH`` chunks are in flight per worker (``_PREFETCH_TINY`` for tiny ones); when a worker
dies, the chunk it was running fails with WorkerLostError and those queued behind it are
requeued. Finalizers never take this module's locks (see ``queue_tree_release`` and
``_terminate_unreferenced``).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import warnings
import weakref
from typing import Any

from .. import _procenv, _shm
from . import _wire
from .._errors import (
    PoolStateError,
    PoolTerminatedError,
    RemoteTraceback,
    ShmHandleError,
    WorkerLostError,
)
from .._tracers import find_tracer

_PREFETCH = 2  # chunks in flight per worker
# A worker whose chunks take less than _TINY_TASK_S each gets up to _PREFETCH_TINY small chunks
# (no shared memory) in flight, so that per-message latency does not idle it; queueing a few
# tiny tasks behind one another costs little.
_PREFETCH_TINY = 8
_TINY_TASK_S = 0.001
_MAX_EARLY_DEATHS = 3  # consecutive workers dying before they are ready -> the pool is broken
_CAPACITY_GRACE_S = 5.0  # how long an allocation waits for releases when no task is in flight
_RELEASE_FLUSH_S = 0.05
# Chunks smaller than this are written directly by the thread that schedules them (no feeder
# hop). With at most _PREFETCH_TINY of them unread per worker they stay far below a Unix
# socket's buffer, so such a write never blocks (a blocked write in the manager thread could
# deadlock against a worker blocked writing a large result).
_DIRECT_SEND_MAX = 8 << 10
_LIVE: "weakref.WeakSet[_State]" = weakref.WeakSet()
_STOP = ("S",)


def _terminate_live_pools() -> None:
    for state in list(_LIVE):
        try:
            state.terminate()
        except Exception:
            pass


_atexit_registered = False


def _register_atexit() -> None:
    # Lazily, at the first Pool: importing jaxtransport has no side effects.
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_terminate_live_pools)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _dumps_in_band(obj: Any) -> bytes:
    import io

    from .._usercode import Pickler

    f = io.BytesIO()
    Pickler(f, protocol=5).dump(obj)
    return f.getvalue()


# --------------------------------------------------------------------------------------------
# bookkeeping records


class _WorkerRec:
    __slots__ = (
        "index", "serial", "key", "proc", "pid", "conn", "fdsock", "sentinel", "mapper",
        "outstanding", "sent_segs", "trees", "ready", "retiring", "sent", "dead", "stop_sent",
        "send_lock", "queued", "pace", "last_result",
    )

    def __init__(self, index, serial, proc, conn, fdsock):
        self.index, self.serial = index, serial
        self.key = ("worker", serial)
        self.proc, self.pid, self.conn, self.fdsock = proc, proc.pid, conn, fdsock
        self.sentinel = proc.sentinel
        self.mapper = _shm.Mapper(fdsock, label=f"pool worker {proc.pid}")
        self.outstanding: collections.deque = collections.deque()
        self.sent_segs: set[int] = set()
        self.trees: set[int] = set()
        self.ready = self.retiring = self.dead = self.stop_sent = False
        self.sent = 0
        self.send_lock = threading.Lock()
        self.queued = 0  # chunks waiting on the feeder for this worker
        self.pace = 1.0  # moving average of seconds between its results while busy
        self.last_result = 0.0


class _Chunk:
    __slots__ = ("chunk_id", "key", "result", "index", "enc", "trees")

    def __init__(self, chunk_id, result, index, enc):
        self.chunk_id, self.result, self.index, self.enc = chunk_id, result, index, enc
        self.key = ("chunk", chunk_id)
        self.trees = enc.trees


class _TreeRec:
    __slots__ = ("tree_id", "key", "enc", "users", "released", "freed", "workers", "nbytes")

    def __init__(self, tree_id):
        self.tree_id = tree_id
        self.key = ("tree", tree_id)
        self.enc = None
        self.users = 0
        self.released = self.freed = False
        self.workers: set = set()
        self.nbytes = 0


# --------------------------------------------------------------------------------------------
# the shared state and the two threads


class _State:
    def __init__(self, *, processes, initializer, initargs, maxtasksperchild, start_method,
                 shm_threshold, placement, worker_env, shm_capacity, devices_per_worker, tree_type,
                 results_reserve: int = 0):
        self.ctx = multiprocessing.get_context(start_method)
        self.tree_type = tree_type  # SharedTree: what travels as a broadcast handle
        self.start_method = start_method
        self.processes = processes
        self.maxtasks = maxtasksperchild
        self.threshold = shm_threshold
        self.placement = placement
        self.worker_env_overrides = dict(worker_env or {})
        self.devices_per_worker = devices_per_worker
        self.results_reserve = results_reserve  # bytes each worker reserves at start (shm_reserve)
        self.gpus = _procenv.gpu_ids()
        self.init_blob = None if initializer is None else _dumps_in_band((initializer, initargs))
        self.arena = _shm.Arena(shm_capacity, label="the pool's parent process")
        self.lock = threading.RLock()
        self.workers: list[_WorkerRec] = []
        self.pending: collections.deque = collections.deque()
        self.chunk_ids = itertools.count()
        self.tree_ids = itertools.count(1)
        self.serials = itertools.count()
        self.trees: dict[int, _TreeRec] = {}
        self.self_pending: collections.deque = collections.deque()
        self.gc_trees: collections.deque = collections.deque()  # SharedTrees collected unreleased
        self.feed: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = self.terminated = False
        self.broken: BaseException | None = None
        self.early_deaths = 0
        self.tls = threading.local()
        self.space = threading.Condition(threading.Lock())  # imap feeding backpressure
        self.imap_feeders = 0  # imap threads that may wait on self.space
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        try:
            for i in range(processes):
                self.workers.append(self._spawn(i))
        except BaseException:
            self.terminate()
            raise
        self.manager = threading.Thread(target=self._manage, name="jaxtransport-pool-manager", daemon=True)
        self.feeder = threading.Thread(target=self._feed, name="jaxtransport-pool-feeder", daemon=True)
        self.manager.start()
        self.feeder.start()
        _LIVE.add(self)
        _register_atexit()

    # -- workers
    def _spawn(self, index: int) -> _WorkerRec:
        env = _procenv.worker_env(index, devices_per_worker=self.devices_per_worker,
                                   overrides=self.worker_env_overrides, gpus=self.gpus)
        cfg = pickle.dumps({
            "env": env, "parent_pid": os.getpid(), "threshold": self.threshold,
            "placement": self.placement, "capacity": self.arena.capacity,
            "initializer": self.init_blob, "maxtasks": self.maxtasks, "grace": _CAPACITY_GRACE_S,
            "reserve": self.results_reserve,
        })
        from ._worker import worker_main

        conn, child_conn = self.ctx.Pipe(duplex=True)
        fdsock, child_sock = _shm.fd_socketpair()
        proc = self.ctx.Process(target=worker_main, args=(child_conn, child_sock, cfg), daemon=True,
                                name=f"jaxtransport-pool-worker-{index}")
        try:
            if self.start_method == "spawn":
                # The child's environment is os.environ at exec time: set it there so that even
                # code JAX runs while re-importing __main__ sees it (forkserver: set in the child).
                with _procenv.environ_overlay(env):
                    proc.start()
            else:
                proc.start()
        except BaseException:
            conn.close()
            fdsock.close()
            raise
        finally:
            child_conn.close()
            child_sock.close()
        return _WorkerRec(index, next(self.serials), proc, conn, fdsock)

    def _wake(self) -> None:
        fd = self.wake_w
        if fd < 0:
            return  # closed: never write to a number the OS may have reused
        try:
            os.write(fd, b"x")
        except OSError:
            pass

    # -- submitting
    def check_running(self) -> None:
        if self.broken is not None:
            raise PoolStateError(f"This jaxtransport.Pool is broken and accepts no tasks: {self.broken}") from self.broken
        if self.closed or self.terminated:
            raise PoolStateError("Pool not running: it was closed or terminated; create a new jaxtransport.Pool.")

    def wait_for_space(self, cond) -> bool:
        """Arena wait hook for the caller's thread (see Arena.alloc): wait while tasks that will
        release memory are in flight; give up after a grace period when none is."""
        if self.terminated or self.broken is not None:
            return False
        self.drain_self_releases(locked_cond=True)
        busy = bool(self.pending) or any(w.outstanding for w in list(self.workers))
        now = time.monotonic()
        start = getattr(self.tls, "wait_start", None)
        if busy or start is None:
            self.tls.wait_start = start = now if (start is None or busy) else start
        if not busy and now - start > _CAPACITY_GRACE_S:
            return False
        cond.wait(0.05)
        return True

    def function_blob(self, fn):
        return _wire.function_blob(fn, threshold=self.threshold, locate=lambda: _first_tracer((fn, "func")))

    def prepare_chunk(self, fn, mode, items, locate) -> _wire.Prepared:
        return _wire.prepare((fn, mode, items), threshold=self.threshold, tree_type=self.tree_type, locate=locate)

    def submit(self, prep: _wire.Prepared, result, index: int) -> None:
        """Copy a prepared chunk's arrays into shared memory and queue it."""
        for tree in prep.trees:
            if tree._state is not self:
                raise PoolStateError(f"{tree!r} belongs to another jaxtransport.Pool; share() it with this pool.")
            if tree._rec.released:
                raise PoolStateError(f"{tree!r} was released; share() the tree again to use it in new tasks.")
        chunk_id = next(self.chunk_ids)
        self.tls.wait_start = None
        enc = _wire.commit(prep, arena=self.arena, borrower=("chunk", chunk_id), wait=self.wait_for_space)
        chunk = _Chunk(chunk_id, result, index, enc)
        with self.lock:
            if self.terminated or self.broken is not None:
                self.arena.release_all(chunk.key)
                raise PoolStateError("Pool not running: it was terminated or broke while the task was being sent.")
            for tree in prep.trees:
                tree._rec.users += 1
            self.pending.append(chunk)
            self._dispatch()

    def _dispatch(self) -> None:
        # Called with self.lock held.
        while self.pending:
            best = None
            light = not self.pending[0].enc.handles and not self.pending[0].enc.trees
            for w in self.workers:
                limit = _PREFETCH_TINY if (light and w.pace < _TINY_TASK_S) else _PREFETCH
                if w.dead or w.retiring or len(w.outstanding) >= limit:
                    continue
                if self.maxtasks and w.sent >= self.maxtasks:
                    continue
                if best is None or len(w.outstanding) < len(best.outstanding):
                    best = w
            if best is None:
                return
            chunk = self.pending.popleft()
            best.outstanding.append(chunk)
            best.sent += 1
            self.arena.transfer(chunk.enc.handles, chunk.key, best.key)
            self._route(best, chunk)
        if self.closed:
            self._maybe_stop()

    def _route(self, w: _WorkerRec, chunk: _Chunk) -> None:
        """Send a small message right away from this thread when nothing is queued for ``w`` on
        the feeder, its pipe is free and it already maps every segment the chunk names (the
        steady state: the arrays went through shared memory, the message is small whatever
        their size); everything else goes through the feeder (which may block on a full pipe,
        or pass new segments, without stopping result reading)."""
        enc = chunk.enc
        if not enc.trees and len(enc.data) < _DIRECT_SEND_MAX and not w.queued:
            if w.send_lock.acquire(blocking=False):
                try:
                    if not w.queued and enc.segs.issubset(w.sent_segs):
                        try:
                            rel = w.mapper.take_releases(64)  # keeps the message small
                            self._send(w, ("T", chunk.chunk_id, enc.data, enc.entries, rel))
                        except (OSError, EOFError, ValueError):
                            pass  # the worker died: the manager handles its tasks
                        return
                finally:
                    w.send_lock.release()
        w.queued += 1
        self.feed.put((w, chunk))

    def _maybe_stop(self) -> None:
        if self.pending or any(w.outstanding for w in self.workers):
            return
        for w in self.workers:
            if not w.stop_sent:
                w.stop_sent = True
                self.feed.put((w, _STOP))

    def in_flight(self) -> int:
        with self.lock:
            return len(self.pending) + sum(len(w.outstanding) for w in self.workers)

    # -- completing
    def _finish_chunk(self, chunk: _Chunk, ok: bool, value) -> None:
        if chunk.trees:
            with self.lock:
                for tree in chunk.trees:
                    rec = tree._rec
                    rec.users -= 1
                    self._maybe_free_tree(rec)
        result, chunk.result = chunk.result, None
        try:
            if result is not None:
                result._chunk_done(chunk.index, ok, value)
        finally:
            if self.imap_feeders:
                with self.space:
                    self.space.notify_all()

    def _fail_chunk(self, chunk: _Chunk, exc: BaseException) -> None:
        self.arena.release_all(chunk.key)
        self._finish_chunk(chunk, False, exc)

    def _maybe_free_tree(self, rec: _TreeRec) -> None:
        # Called with self.lock held.
        if rec.released and rec.users <= 0 and not rec.freed:
            rec.freed = True
            self.trees.pop(rec.tree_id, None)
            for w in self.workers:
                if rec.tree_id in w.trees:
                    w.trees.discard(rec.tree_id)
                    self.feed.put((w, ("X", rec.tree_id)))
            self.arena.release_all(rec.key)

    def queue_tree_release(self, rec: _TreeRec) -> None:
        self.gc_trees.append(rec)
        self._wake()

    def _drain_tree_releases(self) -> None:
        while self.gc_trees:
            try:
                rec = self.gc_trees.popleft()
            except IndexError:
                return
            self.release_tree(rec)

    def release_tree(self, rec: _TreeRec) -> None:
        with self.lock:
            if rec.released:
                return
            rec.released = True
            self._maybe_free_tree(rec)

    def drain_self_releases(self, locked_cond: bool = False) -> None:
        pend = self.self_pending
        while pend:
            try:
                h = pend.popleft()
            except IndexError:
                break
            if locked_cond:
                # Arena.cond is held by this thread (we are its wait hook): count down directly.
                slot = self.arena._slot(h)
                if slot is not None and "self" in slot.refs:
                    slot.refs["self"] -= 1
                    if not slot.refs["self"]:
                        del slot.refs["self"]
                        if not slot.refs:
                            self.arena._free_slot(h, slot)
            else:
                self.arena.release(h, "self")

    def _own_holder(self, handle: tuple):
        """A holder over this process's own slot (a worker sent back one of our arrays)."""
        try:
            seg_id, off, nbytes, gen = (int(v) for v in handle)
        except (TypeError, ValueError):
            raise ShmHandleError(f"Bad shared-memory handle {handle!r}") from None
        seg = self.arena.segment(seg_id)
        if seg is None or off < 0 or off + nbytes > seg.size or not self.arena.acquire(handle, "self"):
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: a worker referred to memory of this process "
                "that is not live (freed, truncated or out of bounds)."
            )
        holder = (ctypes.c_char * max(nbytes, 1)).from_buffer(seg.mm, off)
        weakref.finalize(holder, self.self_pending.append, handle)
        return holder

    def _on_message(self, w: _WorkerRec, raw: bytes) -> None:
        msg = pickle.loads(raw)
        kind = msg[0]
        if kind == "R":
            _, chunk_id, ok, data, entries, releases, unheld = msg
            now = time.monotonic()
            if w.last_result and len(w.outstanding) > 1:
                w.pace = 0.8 * w.pace + 0.2 * (now - w.last_result)
            elif len(w.outstanding) <= 1:
                w.pace = max(w.pace, 0.2 * _TINY_TASK_S)  # idle gaps say nothing about task length
            w.last_result = now
            with self.lock:
                chunk = None
                for i, c in enumerate(w.outstanding):
                    if c.chunk_id == chunk_id:
                        chunk = c
                        del w.outstanding[i]
                        break
            try:
                value = _wire.decode(data, entries, w.mapper, self.placement, own=self._own_holder)
            except BaseException as e:  # noqa: BLE001 - this task's failure only
                ok, value = False, e
                for i in getattr(e, "unheld", ()):
                    if entries[i][0] in ("np", "jax"):
                        w.mapper.pending.append(entries[i][3])  # never held here: give back
            else:
                if not ok:
                    exc, tb = value
                    exc.__cause__ = RemoteTraceback(tb)
                    value = exc
            del data, entries
            for h in releases:
                self.arena.release(h, w.key)
            if chunk is not None and unheld:  # the worker could not take these arguments
                ours = [e for e in chunk.enc.entries if e[0] in ("np", "jax")]
                slots = dict(zip(map(id, ours), chunk.enc.handles))
                for i in unheld:
                    h = slots.get(id(chunk.enc.entries[i])) if i < len(chunk.enc.entries) else None
                    if h is not None:
                        self.arena.release(h, w.key)
            if chunk is not None:
                self._finish_chunk(chunk, ok, value)
            del value
            with self.lock:
                self._dispatch()
        elif kind == "L":
            for h in msg[1]:
                self.arena.release(h, w.key)
        elif kind == "F":
            w.mapper.forget(msg[1])
        elif kind == "I":
            if msg[1]:
                w.ready = True
                self.early_deaths = 0
            else:
                exc, tb = msg[2]
                exc.__cause__ = RemoteTraceback(tb)
                self._break(PoolStateError(
                    f"The pool's initializer raised {type(exc).__name__}: {exc} in worker pid {w.pid}; "
                    "the pool cannot start workers and is broken. Fix the initializer and create a new pool."
                ), cause=exc)
        elif kind == "Q":
            w.retiring = True

    def _take_in_flight(self) -> list:
        """Every chunk not yet finished (queued, or sent to a worker), removed from the pool's
        books. Called with self.lock held."""
        victims = list(self.pending)
        self.pending.clear()
        for w in self.workers:
            victims.extend(w.outstanding)
            w.outstanding.clear()
        return victims

    def _break(self, err: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            err.__cause__ = cause
        with self.lock:
            if self.broken is not None:
                return
            self.broken = err
            victims = self._take_in_flight()
        for chunk in victims:
            self._fail_chunk(chunk, err)
        self._kill_workers()

    def _worker_exited(self, w: _WorkerRec) -> None:
        if w.dead:
            return
        # Results it sent before dying are still in the pipe: read them first.
        try:
            while w.conn.poll(0):
                self._on_message(w, w.conn.recv_bytes())
        except (EOFError, OSError):
            pass
        w.proc.join(1.0)
        code = w.proc.exitcode
        with self.lock:
            w.dead = True
            if w in self.workers:
                self.workers.remove(w)
            lost = list(w.outstanding)
            w.outstanding.clear()
            if w.ready:
                running, queued = (lost[0], lost[1:]) if lost else (None, [])
            else:  # it died before it could start any task: they all run elsewhere
                running, queued = None, lost
            for chunk in reversed(queued):  # never started: run them elsewhere
                self.arena.transfer(chunk.enc.handles, w.key, chunk.key)
                self.pending.appendleft(chunk)
            self.arena.release_all(w.key)
            for rec in self.trees.values():
                rec.workers.discard(w.key)
        if running is not None:
            if code is None:
                how = "stopped responding (its pipe closed)"
            elif code < 0:
                how = f"was killed by {_signal_name(code)}" + (
                    " (the out-of-memory killer sends SIGKILL: check `dmesg`)" if code == -signal.SIGKILL else "")
            else:
                how = f"exited with code {code} (os._exit() or sys.exit() in the task, or a crash in native code)"
            self._fail_chunk(running, WorkerLostError(
                f"A jaxtransport.Pool worker (pid {w.pid}) {how} while running this task, so the task "
                "has no result. The pool replaced the worker and keeps running other tasks; resubmit "
                "the task if it is safe to run again, or lower its memory use if it was killed for that."
            ))
        _close_quietly(w)
        with self.lock:
            if not w.ready:
                self.early_deaths += 1
            if self.terminated or self.broken is not None:
                return
            if self.early_deaths >= _MAX_EARLY_DEATHS:
                pass
            elif not (self.closed and not self.pending and not any(x.outstanding for x in self.workers)):
                try:
                    self.workers.append(self._spawn(w.index))
                except Exception as e:  # noqa: BLE001
                    self.early_deaths = _MAX_EARLY_DEATHS
                    spawn_error = e
                else:
                    spawn_error = None
                if spawn_error is None:
                    self._dispatch()
                    return
        if self.early_deaths >= _MAX_EARLY_DEATHS:
            self._break(WorkerLostError(
                f"{_MAX_EARLY_DEATHS} jaxtransport.Pool workers in a row died before they were ready "
                f"(the last, pid {w.pid}, exit code {code}): the pool is broken. Check that the "
                "worker environment (worker_env, JAX_PLATFORMS, CUDA) and the initializer work."
            ))
        with self.lock:
            self._dispatch()

    def _manage(self) -> None:
        import select

        poller = select.poll()
        registered: dict[int, tuple] = {}
        last_collect = 0.0
        while True:
            with self.lock:
                if self.terminated:
                    return
                workers = list(self.workers)
                if self.closed and not workers and not self.pending:
                    return
                if self.broken is not None and not workers:
                    return
            wanted = {self.wake_r: ("wake", None)}
            for w in workers:
                if not w.dead:
                    wanted[w.conn.fileno()] = ("conn", w)
                    wanted[w.sentinel] = ("sentinel", w)
            if wanted.keys() != registered.keys() or any(registered[k][1] is not v[1] for k, v in wanted.items()):
                for fd in registered:
                    try:
                        poller.unregister(fd)
                    except (KeyError, ValueError, OSError):
                        pass
                for fd in wanted:
                    poller.register(fd, select.POLLIN)
                registered = wanted
            try:
                events = poller.poll(200)
            except InterruptedError:
                events = []
            now = time.monotonic()
            if now - last_collect > 0.02 and any(w.mapper.live for w in workers):
                last_collect = now
                _shm.collect_deferred()  # see collect_deferred: lets dead results release
            self.drain_self_releases()
            self._drain_tree_releases()
            for fd, _ev in events:
                if self.terminated:
                    return
                kind, w = registered.get(fd, (None, None))
                if kind == "wake":
                    try:
                        os.read(self.wake_r, 4096)
                    except OSError:
                        pass
                elif kind == "conn" and not w.dead:
                    try:
                        while True:
                            self._on_message(w, w.conn.recv_bytes())
                            if not w.conn.poll(0):
                                break
                    except (EOFError, OSError):
                        self._worker_exited(w)
                elif kind == "sentinel" and not w.dead:
                    self._worker_exited(w)

    def _feed(self) -> None:
        get = self.feed.get
        while True:
            try:
                item = get(timeout=_RELEASE_FLUSH_S)
            except queue.Empty:
                if self.terminated:
                    return
                self._flush_all()
                continue
            if item is None:
                return
            w, what = item
            is_chunk = isinstance(what, _Chunk)
            if w.dead or self.terminated:
                if is_chunk:
                    w.queued -= 1
                continue
            with w.send_lock:
                try:
                    if is_chunk:
                        self._send_chunk(w, what)
                    else:
                        self._send(w, what)
                except (OSError, EOFError, ValueError):
                    pass  # the worker died: the manager sees its sentinel and handles its tasks
                finally:
                    if is_chunk:
                        w.queued -= 1
            del item, w, what  # hold no chunk (nor, through it, a result) while idle

    def _send(self, w: _WorkerRec, msg) -> None:
        w.conn.send_bytes(pickle.dumps(msg, protocol=5))

    def _send_segs(self, w: _WorkerRec, segs) -> None:
        for seg_id in segs:
            if seg_id in w.sent_segs:
                continue
            seg = self.arena.segment(seg_id)
            if seg is None or seg.fd is None:
                continue
            _shm.send_segment(w.fdsock, seg_id, seg.size, seg.fd)
            w.sent_segs.add(seg_id)

    def _send_chunk(self, w: _WorkerRec, chunk: _Chunk) -> None:
        for tree in chunk.trees:
            rec = tree._rec
            if rec.tree_id in w.trees or rec.enc is None:
                continue
            self._send_segs(w, rec.enc.segs)
            self.arena.lend(rec.enc.handles, w.key)
            w.trees.add(rec.tree_id)
            rec.workers.add(w.key)
            self._send(w, ("D", rec.tree_id, rec.enc.data, rec.enc.entries))
        self._send_segs(w, chunk.enc.segs)
        self._send(w, ("T", chunk.chunk_id, chunk.enc.data, chunk.enc.entries, w.mapper.take_releases()))

    def _flush_all(self) -> None:
        forgotten = self.arena.take_forgotten()
        for w in list(self.workers):
            if w.dead:
                continue
            if not w.send_lock.acquire(timeout=0.01):
                if forgotten:  # busy: everything again next time (duplicates are ignored)
                    with self.arena.cond:
                        self.arena._forgotten.extend(forgotten)
                    forgotten = []
                continue
            try:
                if forgotten:
                    gone = [s for s in forgotten if s in w.sent_segs]
                    if gone:
                        w.sent_segs.difference_update(gone)
                        self._send(w, ("F", gone))
                rel = w.mapper.take_releases()
                if rel:
                    self._send(w, ("L", rel))
            except (OSError, EOFError, ValueError):
                pass
            finally:
                w.send_lock.release()

    # -- shutting down
    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._maybe_stop()
        self._wake()

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() in (self.manager, self.feeder):
            raise PoolStateError("Cannot join a jaxtransport.Pool from one of its own callbacks.")
        self.manager.join(timeout)
        for w in list(self.workers):
            w.proc.join(timeout)
        self._release_resources()

    def _kill_workers(self) -> None:
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
        with self.lock:
            if self.terminated:
                return
            self.terminated = True
            self.closed = True
            victims = self._take_in_flight()
        self._kill_workers()
        self._wake()
        err = PoolTerminatedError(
            "The jaxtransport.Pool was terminated (terminate(), the end of its `with` block, garbage "
            "collection or interpreter exit) before this task's result arrived."
        )
        for chunk in victims:
            try:
                self._fail_chunk(chunk, err)
            except Exception:
                pass
        me = threading.current_thread()
        for t in (getattr(self, "manager", None), getattr(self, "feeder", None)):
            if t is not None and t is not me and t.is_alive():
                if t is self.feeder:
                    self.feed.put(None)
                t.join(5)
        self._release_resources()

    def _release_resources(self) -> None:
        with self.lock:
            if getattr(self, "_released", False):
                return
            if any(w.proc.is_alive() for w in self.workers):
                return
            self._released = True
            workers = list(self.workers)
            self.workers.clear()
        self.feed.put(None)
        if getattr(self, "feeder", None) is not None and self.feeder is not threading.current_thread():
            self.feeder.join(5)
        for w in workers:
            w.dead = True
            _close_quietly(w)
        self.arena.close()
        fds, self.wake_r, self.wake_w = (self.wake_r, self.wake_w), -1, -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _LIVE.discard(self)


def _close_quietly(w: _WorkerRec) -> None:
    try:
        w.mapper.close()
    except Exception:
        pass
    for c in (w.conn, w.fdsock):
        try:
            c.close()
        except Exception:
            pass
    try:
        w.proc.close()
    except Exception:
        pass


def _terminate_unreferenced(state: _State) -> None:
    if not state.terminated and not getattr(state, "_released", False):
        warnings.warn(
            "a jaxtransport.Pool was garbage-collected while running: it was terminated. Use it "
            "as a context manager or call close() and join() (or terminate()).",
            ResourceWarning,
            stacklevel=2,
        )
    # A finalizer may run inside any thread, even one holding this pool's locks (a garbage
    # collection can start at any allocation): terminate from a thread of its own.
    threading.Thread(target=state.terminate, name="jaxtransport-pool-reaper", daemon=True).start()


def _first_tracer(*pairs) -> str | None:
    for obj, root in pairs:
        found = find_tracer(obj, root)
        if found is not None:
            return found[0] or root
        if callable(obj):  # a closure or defaults holding a tracer: name the captured variable
            code = getattr(obj, "__code__", None)
            cells = getattr(obj, "__closure__", None) or ()
            names = code.co_freevars if code is not None else ()
            for name, cell in zip(names, cells):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                found = find_tracer(value, f"{root}.<closure {name}>")
                if found is not None:
                    return found[0]
            for i, value in enumerate(getattr(obj, "__defaults__", None) or ()):
                found = find_tracer(value, f"{root}.__defaults__[{i}]")
                if found is not None:
                    return found[0]
    return None


def _locator(func, part, start):
    def locate():
        for j, item in enumerate(part):
            found = find_tracer(item, f"iterable[{start + j}]")
            if found is not None:
                return found[0]
        return _first_tracer((func, "func"))

    return locate
