"""Which chunk runs where: pending chunks and each worker's in-flight ones, pull-based.

A chunk goes to a worker only when that worker is idle (nothing in flight), so no chunk waits
behind a long task while another worker could run it. Two exceptions, both only when no worker
is idle, keep quick tasks fast (the round trip of a result and the next task no longer idles
the worker; multiprocessing's shared queue gets the same from a worker's next task already
being in the pipe):

- tiny: a worker whose chunks take less than ``TINY_TASK_S`` (as it reports) may have about
  ``PREFETCH_S`` of them (``prefetch_limit``) in flight as small messages (no shared memory,
  under ``SMALL_MESSAGE``);
- quick: any chunk may wait as the one chunk behind a worker's running chunk when that worker's
  chunks take less than ``QUICK_S``.

Both only while the running chunk began less than ``QUICK_S`` ago: never behind a long or
stopped task once it has shown itself as one.

A chunk queued behind another can still wait behind a task that turns out long or a worker
that stops just then: nothing tells a slow process from a stopped one early. No processes
here: the scheduler works on any objects with ``outstanding`` (a deque), ``pace`` (seconds per
chunk or None), ``can_take()`` and ``alive()``, which is how it is unit-tested.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import Any

PREFETCH_TINY = 8
PREFETCH_MAX = 256
PREFETCH_S = 0.002  # queue about this much tiny work per worker: more than a message round trip
TINY_TASK_S = 0.001
QUICK_S = 0.005  # pace and age under which one chunk may wait behind a running one
SMALL_MESSAGE = 64 << 10


def prefetch_limit(pace: float) -> int:
    """Chunks a worker running tiny chunks of ``pace`` seconds may have in flight: enough to
    cover the round trip of a result and the next task (at least PREFETCH_TINY)."""
    return min(PREFETCH_MAX, max(PREFETCH_TINY, int(PREFETCH_S / max(pace, 1e-6))))


class Chunk:
    """One message's worth of tasks: ``enc`` (the encoded function and items), the result
    object it completes and its index there. ``key`` is its borrower name in the arena while
    it waits (its slots move to the worker that runs it). A plain chunk (nothing in shared
    memory, no tree) is made from its pickle alone: ``enc`` is None and ``data`` the pickle
    (one object a chunk while it waits: Note [few objects per waiting chunk] in ``_engine``)."""

    __slots__ = ("began", "chunk_id", "data", "enc", "index", "key", "result", "seq", "small", "trees")

    def __init__(self, chunk_id: int, result: Any, index: int, enc: Any):
        self.chunk_id, self.result, self.index = chunk_id, result, index
        self.key = ("chunk", chunk_id)
        if type(enc) is bytes:
            self.enc, self.data, self.trees = None, enc, ()
            self.small = len(enc) < SMALL_MESSAGE
        else:
            self.enc, self.data, self.trees = enc, enc.data, enc.trees
            self.small = not enc.handles and not enc.trees and len(enc.data) < SMALL_MESSAGE
        self.began = 0.0  # when it was sent, or when the one before it finished (monotonic)
        self.seq = 0  # its place in the stream of tasks sent to its worker (1, 2, ...)

    @property
    def handles(self) -> Any:
        """The arena slots it holds (none for a plain chunk)."""
        return () if self.enc is None else self.enc.handles


class ChunkRun:
    """Plain chunks in a row of one result object (a map's or an imap batch's), waiting as
    their pickles alone: each becomes a :class:`Chunk` (taking the next of ``ids``) only when
    the scheduler reaches it, so a map of thousands of chunks holds thousands of bytes objects,
    which the garbage collector does not track, not thousands of Chunks (Note [few objects per
    waiting chunk] in ``_engine``)."""

    __slots__ = ("datas", "ids", "index", "next", "result")

    def __init__(self, datas: list, result: Any, index: int, ids: Any):
        self.datas, self.result, self.index, self.ids = datas, result, index, ids
        self.next = 0  # the position in ``datas`` of the next chunk to make

    def __len__(self) -> int:
        return len(self.datas) - self.next

    def take(self) -> Chunk:
        k = self.next
        data, self.datas[k] = self.datas[k], None  # the Chunk holds it from now on
        self.next = k + 1
        return Chunk(next(self.ids), self.result, self.index + k, data)


class Scheduler:
    """Pending chunks (FIFO) and the assignment rule. Not thread-safe: the engine's lock.
    ``pending`` holds Chunks and ChunkRuns; the first one is made a Chunk (``head``) before it
    is looked at."""

    def __init__(self):
        self.pending: collections.deque = collections.deque()
        self.turn = 0  # where the next search for a busy worker to queue behind starts

    def add(self, chunk: Chunk) -> None:
        self.pending.append(chunk)

    def add_many(self, chunks: list[Chunk]) -> None:
        self.pending.extend(chunks)

    def add_run(self, run: ChunkRun) -> None:
        if len(run):
            self.pending.append(run)

    def head(self) -> Chunk:
        """The first pending chunk (pending must not be empty), made from its run if need be."""
        pending = self.pending
        first = pending[0]
        if type(first) is not ChunkRun:
            return first
        chunk = first.take()
        if not len(first):
            pending.popleft()
        pending.appendleft(chunk)
        return chunk

    def requeue(self, chunks: Iterable[Chunk]) -> None:
        """Put chunks that never started back at the front, in their order."""
        for chunk in reversed(list(chunks)):
            self.pending.appendleft(chunk)

    def assign(self, workers: list) -> list[tuple[Any, Chunk]]:
        """Move pending chunks to workers (``_assign``); interrupted (a Ctrl-C in the caller's
        thread: Note [a Ctrl-C while dispatching] in ``_engine``), the chunks it moved go back to
        the front of ``pending``, in order, so none is left counted as a worker's but never sent.
        Each is listed in ``out`` before it leaves ``pending``."""
        out: list[tuple[Any, Chunk]] = []
        try:
            return self._assign(workers, out)
        except BaseException:
            self._unassign(out)
            raise

    def _unassign(self, out: list) -> None:
        pending = self.pending
        for w, chunk in reversed(out):
            try:
                w.outstanding.remove(chunk)
            except ValueError:  # interrupted before it got there
                pass
            if not pending or pending[0] is not chunk:  # (interrupted before it left pending)
                pending.appendleft(chunk)

    def _assign(self, workers: list, out: list) -> list[tuple[Any, Chunk]]:
        """Move pending chunks to workers by the rule above; returns (worker, chunk) pairs to
        send, each chunk already appended to its worker's ``outstanding``.

        One pass over the workers per call, not per chunk (a map hands out hundreds at once):
        each idle worker takes one, in the workers' order; then, behind a running chunk, a small
        chunk goes to the worker of tiny chunks with the fewest in flight under its prefetch
        limit (ties: the first from a turning point that moves at each call, so that they spread
        over the workers), any other chunk to the first with exactly one in flight. The first
        chunk that may go nowhere stops the pass (FIFO)."""
        pending = self.pending
        if not pending:
            return out
        now = time.monotonic()
        for w in workers:
            if not pending:
                return out
            if not w.outstanding and w.can_take() and w.alive():
                chunk = self.head()
                out.append((w, chunk))
                pending.popleft()
                chunk.began = now
                w.outstanding.append(chunk)
        if not pending:
            return out
        # Behind a running chunk only on a worker of quick chunks whose running one is young.
        # Each candidate once, in turn order: [in flight, place in turn, worker, tiny limit]
        # (the limit is 0 unless its chunks are tiny); ``tiny``: those a small chunk may join.
        count = len(workers)
        first = self.turn % count if count else 0
        self.turn += 1
        # (No call per worker here: can_take() is asked of a candidate once it is picked, and
        # prefetch_limit is inlined; a single apply_async runs this per call.)
        cands: list[list] = []
        tiny: list[list] = []
        for k in range(count):
            w = workers[(first + k) % count]
            q = w.outstanding
            pace = w.pace
            if not q or pace is None or pace >= QUICK_S or now - q[0].began >= QUICK_S:
                continue
            n = len(q)
            # prefetch_limit(pace), at least PREFETCH_TINY, for workers of tiny chunks
            limit = (
                min(PREFETCH_MAX, max(PREFETCH_TINY, int(PREFETCH_S / (pace if pace > 1e-6 else 1e-6))))
                if pace < TINY_TASK_S
                else 0
            )
            cand = [n, k, w, limit, False]  # [4]: can_take() was asked and said yes
            cands.append(cand)
            if n < limit:
                tiny.append(cand)
        while pending and cands:
            chunk = self.head()
            if chunk.small and tiny:
                cand = min(tiny)  # the fewest in flight, then the first in turn (k is unique)
            else:
                for cand in cands:
                    if cand[0] == 1:
                        break
                else:
                    break
            if not cand[4]:
                if not cand[2].can_take():
                    cands.remove(cand)
                    if cand in tiny:
                        tiny.remove(cand)
                    continue
                cand[4] = True
            w = cand[2]
            out.append((w, chunk))
            pending.popleft()
            chunk.began = now
            w.outstanding.append(chunk)
            cand[0] += 1
            if cand[3] and cand[0] >= cand[3] and cand in tiny:
                tiny.remove(cand)
        return out

    @staticmethod
    def finished(w, chunk_id: int) -> Chunk | None:
        """Remove and return ``w``'s in-flight chunk ``chunk_id`` (None: not in flight, e.g.
        already failed by terminate); the next one in flight begins now."""
        for i, c in enumerate(w.outstanding):
            if c.chunk_id == chunk_id:
                del w.outstanding[i]
                if i == 0 and w.outstanding:
                    w.outstanding[0].began = time.monotonic()
                return c
        return None

    @staticmethod
    def finished_many(w, chunk_ids: list) -> list[Chunk | None]:
        """``finished`` of each of ``chunk_ids`` (a run of results from ``w``), in order."""
        out = w.outstanding
        got: list[Chunk | None] = []
        now = None
        for chunk_id in chunk_ids:
            if out and out[0].chunk_id == chunk_id:  # results come in the order sent
                got.append(out.popleft())
                if out:
                    if now is None:
                        now = time.monotonic()
                    out[0].began = now
            else:
                got.append(Scheduler.finished(w, chunk_id))
        return got

    @staticmethod
    def lost(w) -> tuple[Chunk | None, list[Chunk]]:
        """A dead worker's chunks: (the one it was running, if it had started one; the rest,
        which never started), removed from its books. Chunks run in the order sent, and the
        worker records each one's id before starting it (``w.started_chunk()``)."""
        lost = list(w.outstanding)
        w.outstanding.clear()
        if lost and lost[0].chunk_id == w.started_chunk():
            return lost[0], lost[1:]
        return None, lost

    @staticmethod
    def take_worker(w) -> list[Chunk]:
        lost = list(w.outstanding)
        w.outstanding.clear()
        return lost

    def take_all(self, workers: list) -> list[Chunk]:
        """Every chunk not finished (pending or in flight), removed from the books."""
        victims: list[Chunk] = []
        for item in self.pending:
            if type(item) is ChunkRun:
                victims.extend(item.take() for _ in range(len(item)))
            else:
                victims.append(item)
        self.pending.clear()
        for w in workers:
            victims.extend(self.take_worker(w))
        return victims

    def in_flight(self, workers: list) -> int:
        """Chunks pending or in flight (a run counts the chunks it has not made yet)."""
        pending = sum(len(item) if type(item) is ChunkRun else 1 for item in list(self.pending))
        return pending + sum(len(w.outstanding) for w in workers)

    def idle(self, workers: list) -> bool:
        return not self.pending and not any(w.outstanding for w in workers)
