"""Which chunk runs where: pending chunks and each worker's in-flight ones, pull-based.

A chunk goes to a worker only when that worker is idle (nothing in flight), so no chunk waits
behind a long task while another worker could run it. The one exception keeps tiny tasks fast:
a worker whose chunks take less than ``TINY_TASK_S`` (as it reports) may have about
``PREFETCH_S`` of them (``prefetch_limit``) in flight as small messages (no shared memory, under ``SMALL_MESSAGE``), and only
when no worker is idle; queueing a few tiny tasks behind one another costs little, and the pipe
latency no longer idles the worker. No processes here: the scheduler works on any objects with
``outstanding`` (a deque), ``pace`` (seconds per chunk or None), ``can_take()`` and ``alive()``,
which is how it is unit-tested.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable

PREFETCH_TINY = 8
PREFETCH_MAX = 256
PREFETCH_S = 0.002  # queue about this much tiny work per worker: more than a message round trip
TINY_TASK_S = 0.001
SMALL_MESSAGE = 64 << 10


def prefetch_limit(pace: float) -> int:
    """Chunks a worker running tiny chunks of ``pace`` seconds may have in flight: enough to
    cover the round trip of a result and the next task (at least PREFETCH_TINY)."""
    return min(PREFETCH_MAX, max(PREFETCH_TINY, int(PREFETCH_S / max(pace, 1e-6))))


class Chunk:
    """One message's worth of tasks: ``enc`` (the encoded function and items), the result
    object it completes and its index there. ``key`` is its borrower name in the arena while
    it waits (its slots move to the worker that runs it)."""

    __slots__ = ("chunk_id", "key", "result", "index", "enc", "trees", "small")

    def __init__(self, chunk_id: int, result: Any, index: int, enc: Any):
        self.chunk_id, self.result, self.index, self.enc = chunk_id, result, index, enc
        self.key = ("chunk", chunk_id)
        self.trees = enc.trees
        self.small = not enc.handles and not enc.trees and len(enc.data) < SMALL_MESSAGE


class Scheduler:
    """Pending chunks (FIFO) and the assignment rule. Not thread-safe: the engine's lock."""

    def __init__(self):
        self.pending: collections.deque = collections.deque()

    def add(self, chunk: Chunk) -> None:
        self.pending.append(chunk)

    def requeue(self, chunks: Iterable[Chunk]) -> None:
        """Put chunks that never started back at the front, in their order."""
        for chunk in reversed(list(chunks)):
            self.pending.appendleft(chunk)

    def assign(self, workers: list) -> list[tuple[Any, Chunk]]:
        """Move pending chunks to workers by the rule above; returns (worker, chunk) pairs to
        send, each chunk already appended to its worker's ``outstanding``."""
        out = []
        while self.pending:
            w = self._pick(workers, self.pending[0])
            if w is None:
                break
            chunk = self.pending.popleft()
            w.outstanding.append(chunk)
            out.append((w, chunk))
        return out

    @staticmethod
    def _pick(workers: list, chunk: Chunk):
        best = None
        for w in workers:
            if not w.outstanding and w.can_take() and w.alive():
                return w
        if not chunk.small:
            return None
        for w in workers:
            pace = w.pace
            if pace is None or pace >= TINY_TASK_S:
                continue
            n = len(w.outstanding)
            if (n >= PREFETCH_TINY and n >= prefetch_limit(pace)) or not w.can_take():
                continue
            if best is None or n < len(best.outstanding):
                best = w
        return best

    @staticmethod
    def finished(w, chunk_id: int) -> Chunk | None:
        """Remove and return ``w``'s in-flight chunk ``chunk_id`` (None: not in flight, e.g.
        already failed by terminate)."""
        for i, c in enumerate(w.outstanding):
            if c.chunk_id == chunk_id:
                del w.outstanding[i]
                return c
        return None

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
        victims = list(self.pending)
        self.pending.clear()
        for w in workers:
            victims.extend(self.take_worker(w))
        return victims

    def in_flight(self, workers: list) -> int:
        return len(self.pending) + sum(len(w.outstanding) for w in workers)

    def idle(self, workers: list) -> bool:
        return not self.pending and not any(w.outstanding for w in workers)
