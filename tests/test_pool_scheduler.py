"""The Pool's scheduler on its own, without processes: the pull-based assignment rule."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

from jaxtransport.pool._scheduler import QUICK_S, SMALL_MESSAGE, TINY_TASK_S, Chunk, Scheduler, prefetch_limit


class FakeWorker:
    def __init__(self, name, pace=None, alive=True, can_take=True):
        self.name, self.pace, self._alive, self._can_take = name, pace, alive, can_take
        self.outstanding = collections.deque()
        self.started = -1  # what a worker records in its shared cell (Note [started])

    def started_chunk(self):
        return self.started

    def can_take(self):
        return self._can_take

    def alive(self):
        return self._alive


def chunk(i, *, nbytes=100, shm=False):
    enc = SimpleNamespace(handles=[(1, 0, 8, 1)] if shm else [], trees=[], data=b"x" * nbytes)
    return Chunk(i, None, i, enc)


def names(pairs):
    return [(w.name, c.chunk_id) for w, c in pairs]


def test_each_idle_worker_gets_one_chunk_and_nothing_waits_behind_a_busy_one():
    s = Scheduler()
    a, b = FakeWorker("a"), FakeWorker("b")
    for i in range(5):
        s.add(chunk(i))
    assert names(s.assign([a, b])) == [("a", 0), ("b", 1)]
    assert names(s.assign([a, b])) == []  # pace unknown: no prefetch behind a running chunk
    assert len(s.pending) == 3
    assert s.finished(b, 1).chunk_id == 1
    assert names(s.assign([a, b])) == [("b", 2)]  # b pulled the next one; a still runs 0


def test_tiny_tasks_are_prefetched_only_when_no_worker_is_idle():
    s = Scheduler()
    fast, slow = FakeWorker("fast", pace=TINY_TASK_S / 10), FakeWorker("slow", pace=5.0)
    limit = prefetch_limit(fast.pace)
    for i in range(limit + 10):
        s.add(chunk(i))
    got = names(s.assign([fast, slow]))
    assert got[:2] == [("fast", 0), ("slow", 1)]
    assert all(name == "fast" for name, _ in got[2:])  # never queued behind the slow one
    assert len(fast.outstanding) == limit and len(slow.outstanding) == 1
    assert len(s.pending) == 9


def test_large_or_shared_memory_chunks_wait_only_one_deep_behind_a_quick_chunk():
    s = Scheduler()
    w = FakeWorker("w", pace=TINY_TASK_S / 10)
    s.add(chunk(0))
    s.add(chunk(1, nbytes=SMALL_MESSAGE))
    s.add(chunk(2, shm=True))
    assert names(s.assign([w])) == [("w", 0), ("w", 1)]  # one behind the running one, no more
    s.finished(w, 0)
    assert names(s.assign([w])) == [("w", 2)]
    s.finished(w, 1)
    assert not s.pending and [c.chunk_id for c in w.outstanding] == [2]


def test_nothing_waits_behind_a_chunk_running_for_long_or_on_a_slow_worker():
    s = Scheduler()
    busy, slow = FakeWorker("busy", pace=TINY_TASK_S / 10), FakeWorker("slow", pace=QUICK_S * 2)
    s.add(chunk(0, shm=True))
    s.add(chunk(1, shm=True))
    assert names(s.assign([busy, slow])) == [("busy", 0), ("slow", 1)]
    busy.outstanding[0].began -= QUICK_S  # it has run for QUICK_S: a long task, or a stopped worker
    for i in (2, 3):
        s.add(chunk(i, shm=True))
        s.add(chunk(i + 10))  # small, but neither worker's chunks are tiny now
    assert names(s.assign([busy, slow])) == [] and len(s.pending) == 4
    s.finished(slow, 1)
    assert names(s.assign([busy, slow])) == [("slow", 2)]  # idle again: it pulls one


def test_dead_or_retiring_workers_get_nothing():
    s = Scheduler()
    dead, leaving, ok = FakeWorker("dead", alive=False), FakeWorker("leaving", can_take=False), FakeWorker("ok")
    s.add(chunk(0))
    s.add(chunk(1))
    assert names(s.assign([dead, leaving, ok])) == [("ok", 0)]
    assert [c.chunk_id for c in s.pending] == [1]


def test_requeue_puts_unstarted_chunks_first_in_order_and_take_all_empties_the_books():
    s = Scheduler()
    a = FakeWorker("a", pace=TINY_TASK_S / 10)
    for i in range(4):
        s.add(chunk(i))
    s.assign([a])
    s.add(chunk(9))
    lost = s.take_worker(a)
    assert [c.chunk_id for c in lost] == [0, 1, 2, 3] and not a.outstanding
    s.requeue(lost[1:])
    assert [c.chunk_id for c in s.pending] == [1, 2, 3, 9]
    assert s.in_flight([a]) == 4 and not s.idle([a])
    assert s.finished(a, 42) is None
    assert sorted(c.chunk_id for c in s.take_all([a])) == [1, 2, 3, 9]
    assert s.idle([a])


def test_a_dead_workers_chunk_counts_as_running_only_once_started():
    s = Scheduler()
    w = FakeWorker("w", pace=TINY_TASK_S / 10)
    for i in range(3):
        s.add(chunk(i))
    s.assign([w])
    running, never = Scheduler.lost(w)
    assert running is None and [c.chunk_id for c in never] == [0, 1, 2]  # it never began one
    for c in never:
        w.outstanding.append(c)
    w.started = 0  # the worker began chunk 0
    running, never = Scheduler.lost(w)
    assert running.chunk_id == 0 and [c.chunk_id for c in never] == [1, 2]
    for c in [running, *never]:
        w.outstanding.append(c)
    s.finished(w, 0)  # ... finished it, and died before it began chunk 1: chunk 1 never ran
    running, never = Scheduler.lost(w)
    assert running is None and [c.chunk_id for c in never] == [1, 2]
    for c in never:
        w.outstanding.append(c)
    w.started = 1  # ... or after it began chunk 1
    running, never = Scheduler.lost(w)
    assert running.chunk_id == 1 and [c.chunk_id for c in never] == [2]


def test_a_busy_worker_that_may_take_nothing_more_gets_nothing_queued_behind_it():
    s = Scheduler()
    full = FakeWorker("full", pace=TINY_TASK_S / 10, can_take=False)  # e.g. leaving (maxtasksperchild)
    fast = FakeWorker("fast", pace=TINY_TASK_S / 10)
    full.outstanding.append(chunk(100))
    fast.outstanding.append(chunk(101))
    full.outstanding[0].began = fast.outstanding[0].began = time.monotonic()  # running, young
    for i in range(4):
        s.add(chunk(i))
    assert names(s.assign([full, fast])) == [("fast", i) for i in range(4)]
    assert [c.chunk_id for c in full.outstanding] == [100]


def test_a_run_of_plain_chunks_becomes_chunks_only_as_they_are_handed_out():
    """Note [few objects per waiting chunk]: a ChunkRun waits as its pickles; each becomes a
    Chunk (with the next id, its index in the result) when the scheduler reaches it, in order,
    after the chunks queued before it; counts and take_all see every chunk of it."""
    import itertools

    from jaxtransport.pool._scheduler import ChunkRun

    s = Scheduler()
    a, b = FakeWorker("a", pace=TINY_TASK_S / 10), FakeWorker("b", pace=TINY_TASK_S / 10)
    ids = itertools.count(100)
    s.add(chunk(0))
    run = ChunkRun([b"p%d" % k for k in range(40)], "result", 7, ids)
    s.add_run(run)
    s.add_run(ChunkRun([], "empty", 0, ids))  # nothing: not queued
    assert len(s.pending) == 2 and s.in_flight([a, b]) == 41
    out = s.assign([a, b])
    assert [c.chunk_id for _w, c in out][:3] == [0, 100, 101]
    made = [c for _w, c in out if c.chunk_id >= 100]
    assert [c.index for c in made] == list(range(7, 7 + len(made)))
    assert [c.data for c in made] == [b"p%d" % k for k in range(len(made))]
    assert all(c.enc is None and c.handles == () and c.small and c.result == "result" for c in made)
    # (the chunk the pass looked at last may have been made and wait, first in line, as a Chunk)
    waiting = sum(1 for item in s.pending if type(item) is Chunk)
    assert waiting <= 1 and len(run) + waiting == 40 - len(made) and s.in_flight([a, b]) == 41
    left = s.take_all([a, b])
    assert sorted(c.index for c in left if c.result == "result") == list(range(7, 47))
    assert not s.pending and s.in_flight([a, b]) == 0 and len(run) == 0
