"""The worker process of jaxtransport.Pool.

A worker receives messages from its parent on one pipe and segment fds on a SOCK_SEQPACKET socket
(see ``_shm``), runs task chunks one at a time, and sends each chunk's results back, large arrays
through its own :class:`~jaxtransport._shm.Arena`. Messages (tuples, standard pickle):

parent -> worker                                   worker -> parent
``("T", chunk_id, data, entries, releases)``       ``("I", ok, error)`` after the initializer
``("D", tree_id, data, entries)`` define a tree    ``("R", chunk_id, ok, data, entries, releases)``
``("X", tree_id)`` drop a tree                     ``("L", releases)`` releases of parent slots
``("L", releases)`` releases of worker slots       ``("F", seg_ids)`` segments it unmapped
``("F", seg_ids)`` parent segments unmapped        ``("Q",)`` leaving (maxtasksperchild)
``("S",)`` stop

The worker exits when told to, when its pipe closes, or when its parent process dies (a pidfd
watchdog: the parent may have been SIGKILLed). SIGINT is ignored: Ctrl-C is the parent's to handle.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

_RELEASE_FLUSH_S = 0.05
_CAPACITY_GRACE_S = 5.0


def _apply_env(env: dict) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    if "jax" in sys.modules and "JAX_PLATFORMS" in env:
        # jax read JAX_PLATFORMS at import (a forkserver may have imported it): tell its config.
        try:
            sys.modules["jax"].config.update("jax_platforms", env["JAX_PLATFORMS"] or None)
        except Exception:
            pass


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the parent process is gone."""

    def run():
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is None:
            while True:
                time.sleep(0.5)
                try:
                    os.kill(parent_pid, 0)
                except ProcessLookupError:
                    os._exit(3)
                except PermissionError:
                    pass
        import select

        select.select([fd], [], [])
        os._exit(3)

    if os.getppid() != parent_pid and parent_pid == 1:
        os._exit(3)
    threading.Thread(target=run, name="jaxtransport-parent-watch", daemon=True).start()


def worker_main(conn, fdsock, config: bytes) -> None:
    """Entry point of a pool worker (a spawn/forkserver ``Process`` target)."""
    cfg = pickle.loads(config)
    _apply_env(cfg["env"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(cfg["parent_pid"])
    global CURRENT
    CURRENT = _Worker(conn, fdsock, cfg)
    CURRENT.run()


CURRENT = None  # the running worker (for introspection and tests)


class _Worker:
    def __init__(self, conn, fdsock, cfg):
        import cloudpickle  # noqa: F401  (functions arrive pickled by value)

        from .. import _shm
        from . import _wire

        self.wire = _wire
        self.conn = conn
        self.fdsock = fdsock
        self.cfg = cfg
        self.placement = cfg["placement"]
        self.threshold = cfg["threshold"]
        self.arena = _shm.Arena(cfg["capacity"], label=f"pool worker {os.getpid()}")
        if cfg.get("reserve"):
            # Pool(shm_reserve=...): segments for results, made while this worker starts.
            try:
                self.arena.reserve(cfg["reserve"])
            except BaseException as e:  # noqa: BLE001 - the first result that needs memory raises it
                self.arena.reserve_error = e
        self.mapper = _shm.Mapper(fdsock, label="the pool's parent")
        self.sent_segs: set[int] = set()
        self.trees: dict[int, tuple] = {}  # id -> (data, entries)
        self.tree_cache: dict[int, object] = {}
        self.backlog: list = []
        self.parent_gone = False
        self._wait_start: float | None = None

    # -- sending
    def send(self, msg) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(msg, protocol=5))
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
        rel = self.mapper.take_releases()
        forgotten = self.arena.take_forgotten()
        if forgotten:
            self.sent_segs.difference_update(forgotten)
            self.send(("F", forgotten))
        if rel:
            self.send(("L", rel))

    # -- receiving
    def recv(self, timeout: float | None):
        if timeout is not None and not self.conn.poll(timeout):
            return None
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise SystemExit(0) from None

    def handle_control(self, msg) -> bool:
        """Apply a non-task message; False when ``msg`` is a task or stop (for the caller)."""
        kind = msg[0]
        if kind == "L":
            for h in msg[1]:
                self.arena.release(h, "parent")
        elif kind == "D":
            self.trees[msg[1]] = (msg[2], msg[3])
        elif kind == "X":
            self.trees.pop(msg[1], None)
            self.tree_cache.pop(msg[1], None)
        elif kind == "F":
            self.mapper.forget(msg[1])
        else:
            return False
        return True

    def wait_for_release(self, cond) -> bool:
        """Arena wait hook: pump the pipe for releases (queueing tasks), up to a grace period
        per result; False (-> ShmCapacityError for this task) when it runs out."""
        now = time.monotonic()
        if self._wait_start is None:
            self._wait_start = now
        if now - self._wait_start > self.cfg.get("grace", _CAPACITY_GRACE_S):
            return False
        cond.release()
        try:
            self.flush_releases()
            msg = self.recv(0.05)
            if msg is not None and not self.handle_control(msg):
                self.backlog.append(msg)
            return True
        finally:
            cond.acquire()

    def tree(self, tree_id: int):
        try:
            return self.tree_cache[tree_id]
        except KeyError:
            pass
        if tree_id not in self.trees:
            from .._errors import ShmHandleError

            raise ShmHandleError(
                f"SharedTree {tree_id} is not defined in this worker (it was released before the "
                "task ran?). Keep a SharedTree alive and unreleased while tasks using it run."
            )
        data, entries = self.trees[tree_id]
        value = self.wire.decode(data, entries, self.mapper, self.placement, readonly=True)
        self.tree_cache[tree_id] = value
        return value

    # -- the loop
    def run(self) -> None:
        cfg = self.cfg
        try:
            if cfg["initializer"] is not None:
                init, initargs = pickle.loads(cfg["initializer"])
                init(*initargs)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            self.send(("I", False, _pack_error(e)))
            return
        self.send(("I", True, None))
        done = 0
        maxtasks = cfg["maxtasks"]
        while True:
            if self.backlog:
                msg = self.backlog.pop(0)
            else:
                busy = self.mapper.pending or self.arena._forgotten
                msg = self.recv(_RELEASE_FLUSH_S if busy else (0.2 if self.mapper.live else None))
                if msg is None:
                    self.flush_releases()
                    continue
            if self.handle_control(msg):
                continue
            if msg[0] == "S":
                self.flush_releases()
                return
            self.run_chunk(msg)
            done += 1
            if maxtasks and done >= maxtasks:
                import gc

                gc.collect()
                self.flush_releases()
                self.send(("Q",))
                return

    def run_chunk(self, msg) -> None:
        _, chunk_id, data, entries, releases = msg
        for h in releases:
            self.arena.release(h, "parent")
        ok = True
        unheld = ()
        try:
            try:
                fn, mode, items = self.wire.decode(data, entries, self.mapper, self.placement, trees=self.tree)
            except BaseException as e:
                unheld = getattr(e, "unheld", ())
                raise
            del data, entries, msg
            if mode == "apply":
                out = [fn(*a, **k) for a, k in items]
            elif mode == "star":
                out = [fn(*a) for a in items]
            else:
                out = [fn(a) for a in items]
            del fn, items
        except BaseException as e:  # noqa: BLE001 - sent to the parent
            if isinstance(e, (SystemExit,)) and self.parent_gone:
                raise
            ok = False
            out = _pack_error(e)
            e = None  # noqa: F841  (drop the traceback's frames: they hold arrays)
        self._wait_start = None
        try:
            enc = self.wire.encode(
                out,
                threshold=self.threshold,
                arena=self.arena,
                borrower="parent",
                wait=self.wait_for_release,
                peer=self.mapper,
            )
        except BaseException as e:  # noqa: BLE001
            ok = False
            enc = self.wire.encode(
                _pack_error(e, note="while sending the task's result back to the parent"),
                threshold=None,
                arena=None,
                borrower=None,
            )
        del out
        self.send_fds(enc.segs)
        rel = self.mapper.take_releases()
        forgotten = self.arena.take_forgotten()
        if forgotten:
            self.sent_segs.difference_update(forgotten)
            self.send(("F", forgotten))
        self.send(("R", chunk_id, ok, enc.data, enc.entries, rel, tuple(unheld)))


def _pack_error(e: BaseException, note: str | None = None):
    """(exception, formatted remote traceback); the exception replaced by a picklable stand-in
    when it does not pickle."""
    import cloudpickle

    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if note:
        tb = f"{tb}({note})\n"
    e.__traceback__ = None
    exc = e
    try:
        pickle.loads(cloudpickle.dumps(e))  # it must also rebuild in the parent
    except Exception:
        from .._errors import TransportError

        exc = TransportError(f"{type(e).__module__}.{type(e).__qualname__}: {e} (the original exception could not be pickled)")
    return (exc, tb)
