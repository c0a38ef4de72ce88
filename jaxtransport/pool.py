"""``jaxtransport.Pool``: multiprocessing.Pool's API for JAX, with arrays through shared memory.

What it adds to ``multiprocessing.Pool`` (see each docstring for the costs):

- Functions, lambdas and closures travel with cloudpickle (``__main__``/notebook code works under
  spawn). Workers are started with ``spawn`` (default) or ``forkserver``: ``fork`` deadlocks a
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

import atexit
import collections
import ctypes
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable

from . import _codec, _pool_env, _pool_wire, _shm
from ._errors import (
    PoolStateError,
    PoolTerminatedError,
    RemoteTraceback,
    ShmHandleError,
    WorkerLostError,
)
from ._pool_results import AsyncResult, IMapIterator, MapResult
from ._tracers import find_tracer

__all__ = ["Pool", "SharedTree", "AsyncResult", "MapResult", "IMapIterator"]

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
_ENV_LOCK = threading.Lock()
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

    from ._pickling import _Pickler

    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(obj)
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
                 shm_threshold, placement, worker_env, shm_capacity, devices_per_worker):
        self.ctx = multiprocessing.get_context(start_method)
        self.start_method = start_method
        self.processes = processes
        self.maxtasks = maxtasksperchild
        self.threshold = shm_threshold
        self.placement = placement
        self.worker_env_overrides = dict(worker_env or {})
        self.devices_per_worker = devices_per_worker
        self.gpus = _pool_env.gpu_ids()
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
        env = _pool_env.worker_env(index, devices_per_worker=self.devices_per_worker,
                                   overrides=self.worker_env_overrides, gpus=self.gpus)
        cfg = pickle.dumps({
            "env": env, "parent_pid": os.getpid(), "threshold": self.threshold,
            "placement": self.placement, "capacity": self.arena.capacity,
            "initializer": self.init_blob, "maxtasks": self.maxtasks, "grace": _CAPACITY_GRACE_S,
        })
        from ._pool_worker import worker_main

        conn, child_conn = self.ctx.Pipe(duplex=True)
        fdsock, child_sock = _shm.fd_socketpair()
        proc = self.ctx.Process(target=worker_main, args=(child_conn, child_sock, cfg), daemon=True,
                                name=f"jaxtransport-pool-worker-{index}")
        try:
            if self.start_method == "spawn":
                # The child's environment is os.environ at exec time: set it there so that even
                # code JAX runs while re-importing __main__ sees it (forkserver: set in the child).
                with _ENV_LOCK:
                    saved = {k: os.environ.get(k) for k in env}
                    try:
                        for k, v in env.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v
                        proc.start()
                    finally:
                        for k, v in saved.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v
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
        return _pool_wire.function_blob(fn, threshold=self.threshold, locate=lambda: _first_tracer((fn, "func")))

    def prepare_chunk(self, fn, mode, items, locate) -> _pool_wire.Prepared:
        return _pool_wire.prepare((fn, mode, items), threshold=self.threshold, tree_type=SharedTree, locate=locate)

    def submit(self, prep: _pool_wire.Prepared, result, index: int) -> None:
        """Copy a prepared chunk's arrays into shared memory and queue it."""
        for tree in prep.trees:
            if tree._state is not self:
                raise PoolStateError(f"{tree!r} belongs to another jaxtransport.Pool; share() it with this pool.")
            if tree._rec.released:
                raise PoolStateError(f"{tree!r} was released; share() the tree again to use it in new tasks.")
        chunk_id = next(self.chunk_ids)
        self.tls.wait_start = None
        enc = _pool_wire.commit(prep, arena=self.arena, borrower=("chunk", chunk_id), wait=self.wait_for_space)
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
        """Send a small chunk right away from this thread when nothing is queued for ``w`` on
        the feeder and its pipe is free; everything else goes through the feeder (which may
        block on a full pipe without stopping result reading)."""
        enc = chunk.enc
        if not enc.segs and not enc.trees and len(enc.data) < _DIRECT_SEND_MAX and not w.queued:
            if w.send_lock.acquire(blocking=False):
                try:
                    if not w.queued:
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
            SharedTree._release_rec(self, rec)

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
                value = _pool_wire.decode(data, entries, w.mapper, self.placement, own=self._own_holder)
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

    def _break(self, err: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            err.__cause__ = cause
        with self.lock:
            if self.broken is not None:
                return
            self.broken = err
            victims = list(self.pending)
            self.pending.clear()
            for w in self.workers:
                victims.extend(w.outstanding)
                w.outstanding.clear()
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
            victims = list(self.pending)
            self.pending.clear()
            for w in self.workers:
                victims.extend(w.outstanding)
                w.outstanding.clear()
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


# --------------------------------------------------------------------------------------------
# public classes


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

    @staticmethod
    def _release_rec(state: _State, rec: _TreeRec) -> None:
        with state.lock:
            if rec.released:
                return
            rec.released = True
            state._maybe_free_tree(rec)

    def release(self) -> None:
        """Stop using this tree: workers drop their cached copy, and the shared memory is freed
        once every worker has dropped its arrays. Tasks already submitted still see it.
        Calling it again is harmless."""
        if self._finalizer.detach() is not None:
            SharedTree._release_rec(self._state, self._rec)

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
    ):
        if start_method == "fork":
            raise ValueError(
                "jaxtransport.Pool refuses start_method='fork': JAX runs threads (XLA's thread "
                "pools, the runtime) that fork() does not copy, so a forked child that touches JAX "
                "can deadlock. Use start_method='spawn' (the default) or 'forkserver'; functions "
                "defined in __main__ or a notebook still work (they travel with cloudpickle)."
            )
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
        self._processes = processes
        self._state = _State(
            processes=processes, initializer=initializer, initargs=tuple(initargs),
            maxtasksperchild=maxtasksperchild, start_method=start_method,
            shm_threshold=shm_threshold, placement=placement, worker_env=worker_env,
            shm_capacity=shm_capacity, devices_per_worker=devices_per_worker,
        )
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
        prep = _pool_wire.prepare(tree, threshold=state.threshold, tree_type=None,
                                  locate=lambda: _first_tracer((tree, "tree")))
        state.tls.wait_start = None
        rec.enc = _pool_wire.commit(prep, arena=state.arena, borrower=rec.key, wait=state.wait_for_space)
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


def _feed_imap(state: _State, it: IMapIterator, func, source, chunksize: int) -> None:
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
