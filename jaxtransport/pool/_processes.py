"""Worker processes as the parent sees them: their records, starting one, closing one.

A :class:`WorkerRec` is created by the engine (under its lock) and read by every thread; its
fields change only under the engine's lock, except ``pace`` (the manager thread only). Its
``sender`` and ``reader`` are the parent's end of its pipe (``_senders``); its ``mapper`` maps
the worker's result segments (manager thread only).
"""

from __future__ import annotations

import collections
import os
import pickle
import select
from collections.abc import Sequence
from typing import Any

from .. import _os, _shm
from . import _claim
from ._senders import FrameReader, Sender

STARTING = -1  # the shared cell's value until the worker's own code runs (worker_main sets RUNNING)
RUNNING = -2  # the worker's code runs; no chunk started yet (chunk ids are >= 0)


class WorkerRec:
    __slots__ = (
        "cell",
        "claim",
        "conn",
        "dead",
        "fault",
        "fdsock",
        "held_back",
        "index",
        "key",
        "landing",
        "mapper",
        "maxtasks",
        "outstanding",
        "pace",
        "pid",
        "proc",
        "reader",
        "ready",
        "retiring",
        "sender",
        "sent",
        "sent_segs",
        "sentinel",
        "serial",
        "sock",
        "stop_sent",
        "taken_back",
        "trees",
    )

    def __init__(self, index: int, serial: int, proc, conn, fdsock, maxtasks: int | None, cell, claim=None):
        self.index, self.serial = index, serial
        self.key = ("worker", serial)  # its borrower name in the parent's arena
        self.proc, self.pid, self.conn, self.fdsock = proc, proc.pid, conn, fdsock
        self.sentinel = proc.sentinel
        # One socket object over the pipe for both directions: non-blocking reads by the
        # manager, writes by the sender (a socket may be read and written from two threads).
        self.sock = _os.parent_socket(conn)
        # Its segments' fds stay open while mapped, a few per worker, so that a result sent on
        # in a later task goes by handle (Note [a result sent on] in ``_engine``).
        self.mapper = _shm.Mapper(
            fdsock, label=f"pool worker {proc.pid}", keep_fds=True, max_kept=max(4, min(32, _os.fd_limit() // 64))
        )
        self.sender = Sender(self.sock, fdsock, name=f"jaxtransport-pool-sender-{index}")
        self.reader = FrameReader(self.sock)
        self.outstanding: collections.deque = collections.deque()  # chunks sent, in order
        self.sent_segs: set[int] = set()  # parent segments whose fd it has
        self.trees: set[int] = set()  # SharedTrees defined in it
        self.ready = self.retiring = self.dead = self.stop_sent = False
        self.sent = 0
        self.pace: float | None = None  # moving average of its seconds per chunk
        self.fault: str | None = None  # why the parent retired it (a corrupt message)
        self.maxtasks = maxtasks
        # Shared with the worker: [0] the chunk id it started last, [1] that chunk's place in
        # its stream of tasks, [2] the last place taken back, [3] the last one it skipped
        # for that; ``claim`` guards them across
        # processes (Note [started], Note [taking back a chunk] in _worker).
        self.cell = cell
        self.claim = claim
        self.taken_back = 0  # chunks sent to it and taken back (they do not count for maxtasks)
        # After a take-back: the last seq taken; nothing new goes to it until it shows it runs
        # (any message from it, or its cell[3] reaching this). 0: not held back.
        self.held_back = 0
        # Parts of a large result put on the parent's device while the worker copies the rest,
        # by chunk id (Note [a result put while it lands] in ``_codec``; ``_manager.Landed``).
        self.landing: dict = {}

    def started_chunk(self) -> int:
        """The id of the chunk the worker started last (-1: none yet). Read after it died, it
        tells whether its first in-flight chunk was running or never started."""
        return self.cell[0]

    def take_back_unstarted(self) -> list:
        """Engine lock held: remove and return this worker's in-flight chunks it has not
        started, so that none of them will ever start here (Note [taking back a chunk]).
        Empty when the worker holds ``claim`` just now (it is starting a chunk: look again
        later) -- never waits for it."""
        if not self.outstanding or self.claim is None or not self.claim.acquire(False):
            return []
        try:
            started = self.cell[1]
            # A generator, not a filtered list comprehension (Note [loops that end in a test]).
            back = list(c for c in self.outstanding if c.seq > started)  # noqa: C400
            if back:
                self.cell[2] = self.held_back = self.sent
        finally:
            self.claim.release()
        for c in back:
            self.outstanding.remove(c)
        self.taken_back += len(back)
        return back

    def reached_worker_code(self) -> bool:
        """Whether the process got as far as jaxtransport's worker code: False when it died
        while bootstrapping (unpickling its start data, running the main script as
        ``__mp_main__``)."""
        return self.cell[0] != STARTING

    def can_take(self) -> bool:
        if self.dead or self.retiring or self.stop_sent or self.fault is not None or self.held_back:
            return False
        return not self.maxtasks or self.sent - self.taken_back < self.maxtasks

    def alive(self) -> bool:
        """False once the process has exited, even before the manager has seen it."""
        try:
            if _os.posix_io():
                return not select.select([self.sentinel], [], [], 0)[0]
            return self.proc.is_alive()  # a process handle on Windows: no select() there
        except (OSError, ValueError):
            return False

    def post(self, msg_bytes: bytes | Sequence, segments=()) -> None:
        self.sender.post(msg_bytes, segments)


def adopt(started, index: int, serial: int, maxtasks: int | None) -> WorkerRec:
    """The record of a worker process ``_launch.Spec.launch`` started (``started``, a
    ``_launch.Launched``), from now on the engine's."""
    cells = _claim.Cells(started.block)
    return WorkerRec(index, serial, started.proc, started.conn, started.fdsock, maxtasks, cells, cells.lock)


def close_worker(w: WorkerRec) -> None:
    """Release everything the parent holds for a worker that is gone (idempotent)."""
    w.dead = True
    w.landing.clear()  # its slots' early holders: the worker and its slots are gone
    _quietly(w.sender.close)
    _shm.collect_deferred()  # jaxlib's deferred decrefs: its arrays' slots release now
    _quietly(w.mapper.close)
    for c in (w.sock, w.conn, w.fdsock):
        _quietly(c.close)
    _quietly(w.proc.close)


# What a spawned child runs before any jaxtransport code: the parent's preparation data
# (sys.path, working directory, the main script run as ``__mp_main__``), as
# ``multiprocessing.spawn._main`` applies it.
_BOOTSTRAP = """
import pickle, sys
import multiprocessing.process, multiprocessing.spawn
data = pickle.load(sys.stdin.buffer)
multiprocessing.process.current_process()._inheriting = True
multiprocessing.spawn.prepare(data)
"""

DIAGNOSIS_TIMEOUT_S = 60.0


def diagnose_start(env: dict, start_method: str, timeout: float = DIAGNOSIS_TIMEOUT_S) -> str:
    """Why workers die while bootstrapping, found by running the same bootstrap (the main
    script as ``__mp_main__``, with the worker's environment and start method) in a fresh interpreter whose
    stderr is captured: a sentence and the tail of that stderr. Run only once a pool breaks
    (a process start, seconds); bounded by ``timeout`` (its process group is killed then)."""
    import multiprocessing.spawn
    import subprocess

    data = multiprocessing.spawn.get_preparation_data("jaxtransport-pool-diagnosis")
    data.pop("authkey", None)
    data["start_method"] = start_method  # what the workers are told (Note [the child's start method] in _os)
    child_env = dict(os.environ)
    for k, v in env.items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = str(v)
    try:
        proc = subprocess.Popen(
            [multiprocessing.spawn.get_executable(), "-c", _BOOTSTRAP],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=child_env,
            start_new_session=True,
        )
    except OSError as e:
        return f"(jaxtransport could not run the start-up again to show why: {e})"
    try:
        _, err = proc.communicate(pickle.dumps(data), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        return (
            f"Running the same start-up again in a fresh interpreter did not finish within {timeout:.0f} s "
            "(the main script runs a long computation at its top level?)."
        )
    finally:
        _kill_group(proc)  # anything it left behind
    text = err.decode("utf-8", "replace").rstrip()
    if proc.returncode == 0:
        return (
            "Running the same start-up again in a fresh interpreter (the main script as `__mp_main__`, the "
            "worker's environment) succeeded, so the workers died later in their start (see their "
            "output on stderr)."
        )
    tail = "\n".join(text.splitlines()[-20:])
    guard = ""
    if "bootstrapping phase" in text or "MainGuardError" in text:
        guard = (
            'The main script starts processes outside `if __name__ == "__main__":`, which every '
            "worker runs again: guard the code that starts them with it. "
        )
    return (
        f"{guard}Running the same start-up again in a fresh interpreter (the main script as "
        f"`__mp_main__`, the worker's environment) exited with code {proc.returncode}; the end of its "
        f"stderr:\n{tail}"
    )


def _kill_group(proc) -> None:
    """Kill ``proc`` and its process group (POSIX); the process itself where there are no
    process groups (Windows)."""
    import signal

    killpg, sigkill = getattr(os, "killpg", None), getattr(signal, "SIGKILL", None)
    if killpg is not None and sigkill is not None:
        _quietly(lambda: killpg(proc.pid, sigkill))
    else:
        _quietly(proc.kill)


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:
        pass


def signal_name(code: int) -> str:
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
