"""The worker process of jaxtransport.Pool.

A worker receives messages from its parent on one pipe and segment fds on a Unix socket
(see ``_shm``; Note [message framing] in ``_os``), runs task chunks one at a time, and sends
each chunk's results back, large arrays through its own :class:`~jaxtransport._shm.Arena`.
The messages are the records of ``_protocol``; each one is validated on arrival. A malformed
task fails that task (its chunk id is readable) with CorruptTransferError; a message that
cannot be read at all is reported to the parent (``Garbled``), which replaces the worker,
since whatever it carried is lost.

The worker exits when told to, when its pipe closes, or when its parent process dies (a
watchdog thread, ``_os.wait_for_exit``: the parent may have been SIGKILLed). SIGINT is ignored:
Ctrl-C is the parent's to handle.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

from .. import _os, _procenv
from .._errors import CorruptTransferError
from ._config import WorkerConfig


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the parent process is gone."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None

    def run():
        # A pidfd on Linux, kill(pid, 0) polls on other POSIX hosts, the parent's process
        # handle on Windows (Note [pipe io] in _os).
        _os.wait_for_exit(parent_pid, sentinel=sentinel)
        os._exit(3)

    if os.getppid() != parent_pid and parent_pid == 1:
        os._exit(3)
    threading.Thread(target=run, name="jaxtransport-parent-watch", daemon=True).start()


def worker_main(conn, fdsock, config: bytes, block=None, init: tuple | None = None) -> None:
    """Entry point of a pool worker (a spawn/forkserver ``Process`` target). ``block``: shared
    int64s where it records the chunk it starts and the parent marks chunks it took back, and
    the cross-process lock over them (``_claim``; Note [started], Note [taking back a chunk]);
    ``init``: the pickled ``(initializer, initargs)``, unpickled once the environment is set
    (Note [initargs] in ``_initargs``); ``config``: a pickled :class:`WorkerConfig`."""
    from ._claim import STARTED_ID, Cells

    cell = None if block is None else Cells(block)
    claim = None if cell is None else cell.lock
    if cell is not None:
        cell[STARTED_ID] = -2  # _processes.RUNNING: it got past bootstrapping (reached_worker_code)
    cfg: WorkerConfig = pickle.loads(config)
    _procenv.apply_environ(cfg.env)
    # Large buffers recycled warm, handed back when idle (Note [a warm heap in workers] in
    # _os._heap): before any task allocates.
    heap_warm = _os.keep_heap_warm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(cfg.parent_pid)
    global CURRENT
    CURRENT = worker = _Worker(conn, fdsock, cfg, cell, claim, init)
    if heap_warm:
        worker.heap_idle_s = _os.idle_trim_seconds()
    worker.run()


CURRENT: _Worker | None = None  # the running worker (for introspection and tests)
# Results of only these exact types pickle the same with any pickler (no reducer, no array,
# no name to look up): encode_results pickles them in one call.
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})
# In every pickle that refers to anything of jaxtransport's (a reducer, an entry, by-value code,
# the main script's names): its module names are spelled out in the pickle. A name of the main
# script travels as ``_mainguard.main_attr`` (a small module, which imports nothing of ours): a
# pickle naming nothing else of jaxtransport's needs no encoder either.
_OURS = b"jaxtransport"
_MAIN_NAME = b"jaxtransport._mainguard"


class _Worker:
    def __init__(self, conn, fdsock, cfg: WorkerConfig, cell=None, claim=None, init: tuple | None = None):
        from . import _protocol

        self.protocol = _protocol
        self._wire: Any = None  # the encoder, imported at first use (the ``wire`` property)
        self.conn = conn
        self.fdsock = fdsock
        self.cfg = cfg
        self.init = init  # the pickled (initializer, initargs), or None
        from ._framing import BufferedFrames, write_frame

        self.write_frame = write_frame
        self.write = _os.worker_writer(conn)  # whole buffers, in order (Note [pipe io] in _os)

        # Buffered reads (Connection.poll builds a selector per call and recv_bytes makes two
        # system calls per message: tens of microseconds per task on the tiny-task path).
        self.frames = BufferedFrames(conn)
        self.placement = cfg.placement
        self.threshold = cfg.threshold
        # Its own arena (results through shared memory) and its view of the parent's segments
        # are made at first use: a worker whose tasks need no shared memory never imports them
        # (Note [launch first] in _launch).
        self._arena: Any = None
        self._mapper: Any = None
        if cfg.reserve:
            # Pool(shm_reserve=...): segments for results, made while this worker starts.
            try:
                self.arena.reserve(cfg.reserve)
            except BaseException as e:  # noqa: BLE001 - the first result that needs memory raises it
                self.arena.reserve_error = e
        self.sent_segs: set[int] = set()
        self.trees: dict[int, tuple] = {}  # id -> (data, entries), as defined by the parent
        self.held_trees: dict[int, Any] = {}  # id -> _wire.Held: its slots held, mapped once
        self.backlog: list = []
        self.cell = cell
        self.claim = claim
        self.tasks_read = 0  # Task messages read so far: a task's place in this worker's stream
        self.parent_gone = False
        self._wait_start: float | None = None
        # Note [a warm heap in workers]: after how many seconds without a task this worker hands
        # back the large buffers glibc keeps for it (None: it keeps none), and when
        # (time.monotonic()) that is next due (None: nothing to hand back).
        self.heap_idle_s: float | None = None
        self.trim_at: float | None = None

    @property
    def wire(self):
        """``jaxtransport._wire``, imported at first use: a task whose pickle names nothing of
        jaxtransport's is read with ``pickle.loads``, and scalar results are pickled directly,
        so a worker running such tasks never loads the encoder (Note [launch first])."""
        if self._wire is None:
            from .. import _wire

            self._wire = _wire
        return self._wire

    @property
    def arena(self):
        """This worker's arena (its results' shared memory), made at first use."""
        if self._arena is None:
            from .. import _shm

            self._arena = _shm.Arena(self.cfg.capacity, label=f"pool worker {os.getpid()}")
        return self._arena

    @property
    def mapper(self):
        """The parent's segments as this worker maps them, made at first use."""
        if self._mapper is None:
            from .. import _shm

            self._mapper = _shm.Mapper(self.fdsock, label="the pool's parent")
        return self._mapper

    # -- sending
    def send(self, msg) -> None:
        self.send_raw(self.protocol.dumps(msg))

    def send_raw(self, raw) -> None:
        """Send a message already in its wire form (``_protocol.dumps``)."""
        try:
            self.write_frame(self.write, raw)
        except (OSError, EOFError):
            self.parent_gone = True
            raise SystemExit(0) from None

    def send_fds(self, segs) -> None:
        from .. import _shm

        for seg_id in segs:
            if seg_id in self.sent_segs:
                continue
            seg = self.arena.segment(seg_id)
            if seg is None:
                continue
            try:
                _shm.send_segment(self.fdsock, seg_id, seg.size, seg.fd)
            except OSError:
                raise SystemExit(0) from None
            self.sent_segs.add(seg_id)

    def flush_releases(self) -> None:
        rel = self._mapper.take_releases() if self._mapper is not None else None
        forgotten = self._arena.take_forgotten() if self._arena is not None else None
        if forgotten:
            self.sent_segs.difference_update(forgotten)
            self.send(self.protocol.Forget(forgotten))
        if rel:
            self.send(self.protocol.Release([tuple(h) for h in rel]))

    # -- receiving
    def recv(self, timeout: float | None):
        """The next valid message (None: none within ``timeout``). A malformed one is reported
        (a task whose chunk id is readable fails alone; anything else: ``Garbled``)."""
        P = self.protocol
        while True:
            try:
                raw = self.frames.next(timeout)
            except (EOFError, OSError):
                raise SystemExit(0) from None
            if raw is None:
                return None
            try:
                msg = P.loads(raw, P.TO_WORKER)
            except CorruptTransferError as e:
                self.report_garbled(raw, e)
                continue
            if type(msg) is P.Task:
                self.tasks_read += 1
                return msg, self.tasks_read
            return msg

    def report_garbled(self, raw: bytes | bytearray, err: BaseException) -> None:
        P = self.protocol
        try:
            msg = pickle.loads(raw)
            chunk_id = msg[1] if msg[0] == P.KIND_OF[P.Task] and type(msg[1]) is int else None
        except Exception:  # noqa: BLE001
            chunk_id = None
        if chunk_id is not None:
            self.tasks_read += 1  # the parent counted it (Note [taking back a chunk])
        if chunk_id is None:
            # Whatever it carried is lost: say so and exit before starting anything sent after
            # it (the parent reruns that elsewhere and replaces this worker).
            self.flush_releases()
            self.send(P.Garbled(str(err)))
            raise SystemExit(0)
        # Its slots were never held here: the parent releases them (every entry unheld).
        n = len(msg[3]) if len(msg) > 3 and isinstance(msg[3], (list, tuple)) else 0
        self.send(P.Result(chunk_id, False, _pack_error(err), [], [], list(range(n)), 0.0))

    def handle_control(self, msg) -> bool:
        """Apply a non-task message; False when ``msg`` is a task or stop (for the caller)."""
        P = self.protocol
        kind = type(msg)
        if kind is P.Release:
            for h in msg.handles:
                self.arena.release(h, "parent")
        elif kind is P.DefineTree:
            self.trees[msg.tree_id] = (msg.data, msg.entries)
        elif kind is P.DropTree:
            self.trees.pop(msg.tree_id, None)
            self.held_trees.pop(msg.tree_id, None)
        elif kind is P.Forget:
            self.mapper.forget(msg.seg_ids)
        else:
            return False
        return True

    def wait_for_release(self) -> bool:
        """Arena wait hook (called with no lock held): pump the pipe for releases (queueing
        tasks), up to a grace period per result; False (-> ShmCapacityError for this task)
        when it runs out."""
        now = time.monotonic()
        if self._wait_start is None:
            self._wait_start = now
        if now - self._wait_start > self.cfg.grace:
            return False
        self.flush_releases()
        msg = self.recv(self.protocol.RELEASE_FLUSH_S)
        if msg is not None and not self.handle_control(msg):
            self.backlog.append(msg)
        return True

    def tree(self, tree_id: int):
        """Shared tree ``tree_id`` as if freshly received (Note [a shared tree per task])."""
        held = self.held_trees.get(tree_id)
        if held is None:
            if tree_id not in self.trees:
                from .._errors import ShmHandleError

                raise ShmHandleError(
                    f"SharedTree {tree_id} is not defined in this worker (it was released before the "
                    "task ran?). Keep a SharedTree alive and unreleased while tasks using it run."
                )
            data, entries = self.trees[tree_id]
            held = self.held_trees[tree_id] = self.wire.Held(data, entries, self.mapper, self.placement, readonly=True)
        return held.rebuild()

    # Note [a shared tree per task]
    # A SharedTree's slots are held (and their segments mapped) once per worker, in a
    # ``_wire.Held``; every message that refers to the tree rebuilds it from there: new
    # containers, new numpy views, new jax.Arrays, over the same memory (no copy on CPU). So a
    # task that donates a leaf (jit donate_argnums deletes the jax.Array it was given) or
    # changes the tree's dicts and lists leaves every other task's tree as it was: each sees what
    # a freshly received argument would be. Within one message (a chunk of tasks) the tree is
    # one object wherever it appears, as pickle makes of one object referenced twice. Leaves
    # stay read-only: numpy views are not writeable, and XLA:CPU does not reuse a donated
    # buffer it does not own (one that aliases host memory), so donation cannot write into the
    # shared bytes (checked on jax 0.4.30, 0.10.2 and 0.12; tests/test_pool_memory.py checks
    # both). What does not change is done once in ``Held`` (mapping, validation, each leaf's
    # abstract value); a message costs one device_put per jax.Array leaf (``SharedTree``'s
    # docstring gives the figure).

    # -- the loop
    def run(self) -> None:
        cfg = self.cfg
        try:
            if self.init is not None:
                from ._initargs import loads_in_child

                init, initargs = loads_in_child(self.init)
                init(*initargs)
        except BaseException as e:
            if cfg.futures:
                # An Executor's worker logs it where concurrent.futures' workers do.
                import logging

                logging.getLogger("concurrent.futures").critical("Exception in initializer:", exc_info=True)
            self.send(self.protocol.Ready(False, _pack_error(e)))
            return
        self.send(self.protocol.Ready(True, None))
        preload = cfg.preload_jax and "jax" not in sys.modules
        done = 0
        maxtasks = cfg.maxtasks
        while True:
            if self.backlog:
                msg = self.backlog.pop(0)  # one queued by wait_for_release
            else:
                m, a = self._mapper, self._arena  # None until shared memory is used
                busy = (m is not None and m.pending) or (a is not None and a.has_forgotten())
                timeout = self.protocol.RELEASE_FLUSH_S if busy else (0.2 if m is not None and m.live else None)
                if self.trim_at is not None:  # wake up when the heap is due back
                    due = max(0.0, self.trim_at - time.monotonic())
                    timeout = due if timeout is None else min(timeout, due)
                msg = self.recv(0 if preload else timeout)
                if preload and (msg is None or done):
                    # Once nothing waits to run, or the first chunk is done (Note [JAX imported
                    # in the background]).
                    preload = False
                    import numpy  # noqa: F401  (on this thread first: the same Note)

                    _start_jax_import()
                    if msg is None:
                        msg = self.recv(timeout)
                if msg is None:
                    self.flush_releases()
                    if self.trim_at is not None and time.monotonic() >= self.trim_at:
                        self.trim_at = None  # idle: the heap goes back (Note [a warm heap in workers])
                        _os.trim_heap()
                    continue
            if self.handle_control(msg):
                continue
            if type(msg) is self.protocol.Stop:
                self.flush_releases()
                return
            msg, seq = msg  # a task and its place in this worker's stream (recv)
            if not self.claim_chunk(msg.chunk_id, seq):
                # Taken back by the parent (Note [taking back a chunk]): it runs elsewhere.
                # Only the releases it carried apply here.
                for h in msg.releases:
                    self.arena.release(h, "parent")
                continue
            self.run_chunk(msg)
            if self.heap_idle_s is not None:
                self.trim_at = time.monotonic() + self.heap_idle_s
            done += 1
            if maxtasks and done >= maxtasks:
                import gc

                gc.collect()
                self.flush_releases()
                self.send(self.protocol.Leaving())
                return

    def claim_chunk(self, chunk_id: int, seq: int) -> bool:
        """Record that this worker starts chunk ``chunk_id`` (the ``seq``-th task it read),
        unless the parent took it back first: False then (skip it)."""
        cell = self.cell
        if cell is None:
            return True
        if self.claim is None:
            cell[0], cell[1] = chunk_id, seq
            return True
        # Note [started]
        # ~~~~~~~~~~~~~~
        # When a worker dies, the parent must tell the chunk it was running (it fails with
        # WorkerLostError) from the chunks queued behind it (they never ran: they run on the
        # replacement). Chunks run in the order sent, so the id of the chunk started last
        # decides: we store it in a cell of shared memory before starting the chunk, and the
        # parent reads it once the process is gone and every Result it sent has been read.
        # A plain store: no message, no wakeup of the parent per task.
        #
        # Note [taking back a chunk]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~
        # A chunk may wait in this worker's pipe behind a running one. When the running one
        # stalls (a long task, SIGSTOP), the parent takes the waiting chunks back and runs
        # them on an idle worker (``Engine.take_back``). Both ends count the tasks on this
        # pipe (the parent as it sends, the worker as it reads: ``seq``), and three shared
        # int64s say who has what: [0] the id of the chunk started last, [1] its seq,
        # [2] the last seq the parent took back ([3]: the last seq skipped for that). Starting a
        # chunk and taking chunks back are one step each under ``claim``, a process-shared lock: the worker starts the
        # chunk only if its seq is past [2]; the parent takes back only the chunks past [1]
        # and then raises [2] to the last seq it sent. So a chunk runs here or there, never
        # both, whoever comes first. The parent only tries the lock (never waits on a
        # stopped worker); the worker holds it for a few stores. A worker the parent took
        # chunks from gets nothing new until it shows it runs again: a message, or [3]
        # reaching the last seq taken back (it read and skipped them).
        claim, block = self.claim, cell.block  # the cells themselves (no call per access)
        claim.acquire()
        try:
            if seq <= block[2]:
                block[3] = seq  # read and skipped: the parent sees this worker is back
                return False
            block[0], block[1] = chunk_id, seq
        finally:
            claim.release()
        return True

    def run_chunk(self, msg) -> None:
        chunk_id, data, entries = msg.chunk_id, msg.data, msg.entries
        for h in msg.releases:
            self.arena.release(h, "parent")
        ok = True
        unheld: list = []
        start = time.perf_counter()
        try:
            if entries:
                fn, mode, items = self.wire.decode(
                    data, entries, self.mapper, self.placement, trees=self.tree, unheld=unheld
                )
            elif type(data) is bytes and data.count(_OURS) == data.count(_MAIN_NAME):
                # Nothing of jaxtransport's in it but the main script's names (no array of
                # ours, no entry, no by-value code): no placement applies, plain pickle reads
                # it as the encoder would.
                fn, mode, items = pickle.loads(data)
            else:  # nothing in shared memory: only the pickle (under the placement, as decode)
                fn, mode, items = self.wire.loads(data, self.placement)
            del data, entries, msg
            if mode == "apply":
                out = [fn(*a, **k) for a, k in items]
            elif mode == "star":
                out = [fn(*a) for a in items]
            elif mode == "map":
                out = [fn(a) for a in items]
            else:
                raise CorruptTransferError(f"Corrupt task: unknown mode {mode!r}")
            del fn, items
        except BaseException as e:
            if isinstance(e, (SystemExit,)) and self.parent_gone:
                raise
            ok = False
            out = _pack_error(e)
            e = None  # type: ignore[assignment]
        seconds = time.perf_counter() - start
        self._wait_start = None
        if ok:
            ok, data, entries, segs = self.encode_results(out, chunk_id)
        else:
            data, entries, segs = out, [], ()
        del out
        if segs:
            self.send_fds(segs)
        m, a = self._mapper, self._arena
        rel = m.take_releases() if m is not None and (m.pending or m.live) else []
        forgotten = a.take_forgotten() if a is not None and a.has_forgotten() else None
        if forgotten:
            self.sent_segs.difference_update(forgotten)
            self.send(self.protocol.Forget(forgotten))
        releases = [tuple(h) for h in rel] if rel else []
        self.send_raw(self.protocol.result(chunk_id, ok, data, entries, releases, unheld, seconds))

    def encode_results(self, out: list, chunk_id: int):
        """(ok, data, entries, segments) of a chunk's results (Note [results travel as arguments
        do]): one that cloudpickle cannot pickle either fails with MaybeEncodingError (a Pool's),
        or with the pickling error itself (an Executor's, as concurrent.futures). Under placement
        "device", a large array says how far it has landed as it is copied (``_landing``)."""
        if {type(r) for r in out} <= _SCALARS:  # a small task's: nothing to route or to look up
            return True, pickle.dumps(out, protocol=self.protocol.PICKLE_PROTOCOL), [], ()
        try:
            prep = self.wire.prepare(out, threshold=self.threshold, to_parent=True)
        except BaseException as e:  # noqa: BLE001
            from multiprocessing.pool import MaybeEncodingError  # type: ignore[attr-defined]

            if self.cfg.futures:
                return False, _pack_error(e, note="while pickling the result"), [], ()
            bad = next((r for r in out if not _picklable(r)), out)
            return False, _pack_error(MaybeEncodingError(e, bad)), [], ()
        if not prep.found:  # nothing to copy into shared memory
            return True, prep.data, [], ()
        try:
            enc = self.wire.commit(
                prep,
                arena=self.arena,
                borrower="parent",
                wait=self.wait_for_release,
                peer=self.mapper,
                landing=self._landing(chunk_id) if self.cfg.placement == "device" else None,
            )
        except BaseException as e:  # noqa: BLE001
            return False, _pack_error(e, note="while sending the task's result back to the parent"), [], ()
        return True, enc.data, enc.entries, enc.segs

    def _landing(self, chunk_id: int):
        """``commit``'s ``landing``: tell the parent that part of a result's array is in its
        slot (the segment's fd first), so that it starts putting that part on its device while
        the rest is copied (Note [a result put while it lands] in ``_codec``)."""

        def landed(index: int, entry: tuple, upto: int) -> None:
            self.send_fds((entry[3][0],))
            self.send(self.protocol.Landing(chunk_id, index, entry, upto))

        return landed

    # Note [results travel as arguments do]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A result is pickled as an argument is: by reference where that works (module-level
    # functions and classes, the script's top-level names, which the parent resolves in its
    # own ``__main__``), by value with cloudpickle otherwise. So whatever went to a worker can
    # come back: an optax optimizer (its ``chain.<locals>.init_fn``), a flax ``TrainState``
    # holding one, a ``functools.partial`` over a local function, a lambda. loky and Ray do the
    # same; ``multiprocessing.Pool`` pickles results by reference only and raises
    # MaybeEncodingError for these. MaybeEncodingError remains for what cloudpickle cannot
    # pickle either (a lock, an open socket). The parent's ``__main__`` is the script this
    # worker runs as ``__mp_main__``, so the C pickler's by-reference pickle is sent as is
    # (``prepare(to_parent=True)``) and the Python-level pickler runs only when it failed.


# Note [JAX imported in the background]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Pool(preload_jax=...) has each worker import JAX on a thread of its own once it is ready, so
# the first task that needs JAX does not pay the import. It begins once the worker finds no
# message waiting, or after its first chunk: a task already in the pipe when the worker gets
# ready (a new pool's first call) runs first, without the import taking the GIL from it every
# switch interval (a task that needs JAX imports it itself then, as it would wait for it).
# Two threads importing JAX's modules at once is not safe: JAX's modules import each other in
# cycles, and a second thread that enters the cycle elsewhere (unpickling a jitted function's
# wrapper class, say) gets CPython's "partially initialized module" ImportError where the
# import locks would deadlock. So while the
# background import runs, ``builtins.__import__`` is wrapped: an import of ``jax``/``jaxlib``
# (or below) by any other thread waits until the background import is done, then proceeds (it
# finds everything imported). Import statements and pickle's class lookups go through
# ``__import__``; jaxtransport's own code imports JAX with import statements. A task that does
# not import JAX runs beside the import (sharing the GIL), and ``_nojax.jax_loaded()`` stays
# False until the import is done, so encoding and decoding numpy data never touch JAX.
# numpy is imported on the worker's own thread before the background import starts: JAX imports
# it too, and numpy's own modules import each other in a cycle, so a task's first import of it
# (the encoder's, loaded at first use since Note [launch first]) beside JAX's raised "partially
# initialized module 'numpy._core._multiarray_umath'" (seen in test_pool_forwarding).

_jax_import_done = threading.Event()
_jax_import_thread: int | None = None
_JAX_ROOTS = ("jax", "jaxlib")
_JAX_PREFIXES = tuple(root + "." for root in _JAX_ROOTS)


def _start_jax_import() -> None:
    import builtins

    original = builtins.__import__

    def gated(name, globals=None, locals=None, fromlist=(), level=0):
        if (
            level == 0
            and not _jax_import_done.is_set()
            and (name in _JAX_ROOTS or name.startswith(_JAX_PREFIXES))
            and threading.get_ident() != _jax_import_thread
        ):
            _jax_import_done.wait()
        return original(name, globals, locals, fromlist, level)

    def run():
        global _jax_import_thread
        _jax_import_thread = threading.get_ident()  # before its first import: it is never gated
        try:
            import jax

            jax.devices()
        except Exception:  # noqa: BLE001 - the task that needs JAX raises it with its own context
            pass
        finally:
            _jax_import_done.set()
            if builtins.__import__ is gated:  # unless someone wrapped it after us (then a pass-through)
                builtins.__import__ = original
        # Then what the first jax.Array argument or result needs, which this worker's start left
        # out (Note [launch first] in _launch): the encoder, the codec, the arena and the mapper
        # (modules only: the objects are made at first use, on the worker's thread). Its
        # modules import each other in no circle (tests/test_architecture), so a task importing
        # one of them meanwhile waits for it, as for any module another thread is importing.
        try:
            from .. import _codec, _shm, _wire  # noqa: F401

            _shm.Arena, _shm.Mapper  # noqa: B018 - their modules (PEP 562)
        except Exception:  # noqa: BLE001 - the task that needs them raises it with its own context
            pass

    thread = threading.Thread(target=run, name="jaxtransport-jax-import", daemon=True)
    builtins.__import__ = gated
    thread.start()


def _picklable(obj) -> bool:
    from .. import _wire

    try:
        _wire.prepare(obj, threshold=None, to_parent=True)
        return True
    except Exception:  # noqa: BLE001
        return False


def _pack_error(e: BaseException, note: str | None = None):
    """An ErrorReport: the exception pickled (cloudpickle, so classes defined in ``__main__``
    travel), and its class, message and traceback as text for when it does not rebuild."""
    import cloudpickle

    from .. import _devices
    from ._protocol import ErrorReport

    e = _devices.explain(e)  # a device held by another process: the cause and the fix
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if note:
        tb = f"{tb}({note})\n"
    e.__traceback__ = None
    mod = type(e).__module__
    name = type(e).__qualname__ if mod == "builtins" else f"{mod}.{type(e).__qualname__}"
    try:
        message = str(e)
    except Exception:  # noqa: BLE001
        message = "<unprintable>"
    try:
        blob = cloudpickle.dumps(e)
        pickle.loads(blob)  # it must also rebuild here (the parent checks again)
    except Exception:  # noqa: BLE001
        from .._errors import TransportError

        blob = pickle.dumps(TransportError(f"{name}: {message} (the original exception could not be pickled)"))
    return tuple(ErrorReport(blob, name, message, tb))
