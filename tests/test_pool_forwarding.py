"""jaxtransport.Pool: a worker's result fed into a later task travels by handle, not copied into
the parent's shared memory (Note [a result sent on] in ``pool/_engine``, Note [forwarded slots]
in ``_shm``): map after map, fan-out of one result to many tasks, a chain of results, a round
trip back to the parent, a SharedTree of results; with the owner killed (-9) while its slot is
queued, the receiver killed (-9) or stopped while it holds the slot, and the parent's array
deleted (donated) while a task holding it waits. Checksums stay intact and nothing leaks in any
of them (the conftest fixture checks /dev/shm and child processes; this file checks fds and
that every forwarded record is gone at the end).

What a test can see of "by handle": the parent's arena made no segment of its own
(``segments_created``: a copy would have needed one) and booked the slot as forwarded.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import WorkerLostError, _os

from .conftest import wait_until

pytestmark = [pytest.mark.shm, pytest.mark.timeout(180)]

N = 1 << 19  # float32 elements: 2 MiB, above the default shm_threshold
METHODS = ["spawn", "forkserver"]


# --------------------------------------------------------------------------------------------
# tasks (module level: spawned workers import them)


def make(i):
    """A fresh 2 MiB result in the worker's shared memory, distinct per ``i``."""
    return jnp.arange(N, dtype=jnp.float32) * 0 + jnp.float32(i)


def made_by(i):
    return os.getpid(), make(i)


def checksum(x) -> float:
    return float(np.asarray(x, dtype=np.float64).sum())


def checksum_after(x, seconds):
    time.sleep(seconds)
    return checksum(x)


def plus_one(x):
    return x + 1


def identity(x):
    return x


def hold(x, seconds, path):
    """Write this worker's pid to ``path`` once running, hold ``x`` for ``seconds``, then report
    the pid and ``x``'s checksum."""
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(seconds)
    return os.getpid(), checksum(x)


def started(path) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def sleep(seconds):
    time.sleep(seconds)
    return os.getpid()


def tree_sum(tree):
    return checksum(tree["a"]) + checksum(tree["b"])


# --------------------------------------------------------------------------------------------
# helpers


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_back_to(n: int) -> bool:
    """This process has at most ``n`` fds open once dead arrays are collected (a mapping of a
    worker's segment holds an fd while an array aliases it)."""
    import gc

    gc.collect()
    jt_collect()
    return open_fds() <= n


def forwarded(pool) -> int:
    """Forwarded slots the parent's arena books now."""
    arena = pool._state.arena
    with arena.cond:
        return sum(1 for s in arena._slots.values() if s.keep is not None)


def forwarded_segments(pool) -> int:
    return len(pool._state.arena._foreign)


def copied_segments(pool) -> int:
    """Segments the parent's arena made to copy arguments into."""
    return pool._state.arena.segments_created


def settled(pool, timeout: float = 10.0) -> bool:
    """Every forwarded record dropped (releases travel asynchronously)."""
    import gc

    def done():
        gc.collect()
        jt_collect()
        return forwarded(pool) == 0 and forwarded_segments(pool) == 0

    return wait_until(done, timeout)


def jt_collect():
    from jaxtransport import _shm

    _shm.collect_deferred()


def value(i) -> float:
    return float(i) * N


@pytest.fixture(autouse=True)
def needs_shared_memory():
    if _os.in_band():
        pytest.skip("arrays travel in-band here: nothing is forwarded")


@pytest.fixture(scope="module", autouse=True)
def services_started():
    """multiprocessing opens process-wide fds at the first spawn and forkserver start: open
    them before any fd is counted."""
    for m in METHODS:
        with jt.Pool(1, start_method=m) as p:
            p.apply(abs, (-1,))


# --------------------------------------------------------------------------------------------
# the paths


@pytest.mark.parametrize("start_method", METHODS)
def test_map_after_map_goes_by_handle(start_method):
    fds = open_fds()
    with jt.Pool(2, start_method=start_method) as pool:
        rs = pool.map(make, range(4))
        assert all(isinstance(r, jax.Array) for r in rs)
        sums = pool.map(checksum, rs)
        assert sums == [value(i) for i in range(4)]
        assert copied_segments(pool) == 0  # nothing was copied into the parent's memory
        # The next map's results, fed on again: a chain of three maps.
        rs2 = pool.map(plus_one, rs)
        assert pool.map(checksum, rs2) == [value(i + 1) for i in range(4)]
        assert copied_segments(pool) == 0
        # The parent's own arrays are intact and still its.
        assert [checksum(r) for r in rs] == [value(i) for i in range(4)]
        del rs, rs2
        assert settled(pool)
    assert wait_until(lambda: fds_back_to(fds))


@pytest.mark.parametrize("start_method", METHODS)
def test_fanout_of_one_result_to_many_tasks(start_method):
    with jt.Pool(3, start_method=start_method) as pool:
        r = pool.apply(make, (7,))
        outs = [pool.apply_async(checksum_after, (r, 0.01)) for _ in range(30)]
        assert [o.get(60) for o in outs] == [value(7)] * 30
        assert copied_segments(pool) == 0
        assert forwarded_segments(pool) <= 1  # one record for the slot, however many tasks
        del r, outs
        assert settled(pool)


def test_round_trip_back_to_the_parent_and_on_again():
    with jt.Pool(2) as pool:
        r = pool.apply(make, (3,))
        back = pool.apply(identity, (r,))  # the worker sends the forwarded slot back as it came
        assert checksum(back) == value(3)
        assert pool.apply(checksum, (back,)) == value(3)
        assert pool.map(checksum, [r, back, r]) == [value(3)] * 3
        assert checksum(r) == value(3)
        del r, back
        assert settled(pool)


def test_shared_tree_of_results():
    with jt.Pool(2) as pool:
        a, b = pool.map(make, [1, 2])
        tree = pool.share({"a": a, "b": b})
        assert pool.map(tree_sum, [tree] * 6) == [value(1) + value(2)] * 6
        assert copied_segments(pool) == 0
        tree.release()
        del a, b, tree
        assert settled(pool)


def test_mixed_with_fresh_arrays_and_small_items():
    with jt.Pool(2) as pool:
        r = pool.apply(make, (5,))
        fresh = jnp.full((N,), 2.0, jnp.float32)
        small = jnp.ones((3,), jnp.float32)
        assert pool.map(checksum, [r, fresh, small, r]) == [value(5), 2.0 * N, 3.0, value(5)]
        assert copied_segments(pool) == 1  # only the fresh array was copied
        del r
        assert settled(pool)


def test_a_slice_of_a_result_is_copied_not_forwarded():
    with jt.Pool(2) as pool:
        r = pool.apply(make, (4,))
        half = r[: N // 2]
        assert pool.apply(checksum, (half,)) == value(4) / 2
        assert forwarded(pool) == 0
        del r, half
        assert settled(pool)


# --------------------------------------------------------------------------------------------
# lifetimes: deletion, death, stops


def test_donated_while_queued_still_reads_the_right_bytes():
    """The parent's jax.Array is deleted (as a donation does) while a task that names its slot
    waits in the queue: the parent's booking keeps the owner's slot, so the task reads what was
    sent, not a recycled slot's new contents."""
    with jt.Pool(2) as pool:
        r = pool.apply(make, (9,))
        blockers = [pool.apply_async(sleep, (0.5,)) for _ in range(2)]
        time.sleep(0.1)
        out = pool.apply_async(checksum, (r,))
        r.delete()
        del r
        # The owner makes new results: were the slot recycled, they would land in it.
        fill = pool.map(make, [100, 101, 102, 103])
        assert out.get(60) == value(9)
        assert [b.get(60) for b in blockers]
        del fill
        assert settled(pool)


@pytest.mark.parametrize("start_method", METHODS)
def test_owner_killed_while_its_slot_waits_in_the_queue(start_method):
    with jt.Pool(2, start_method=start_method) as pool:
        owner, r = pool.apply(made_by, (6,))
        blockers = [pool.apply_async(sleep, (1.0,)) for _ in range(2)]
        time.sleep(0.2)
        queued = [pool.apply_async(checksum, (r,)) for _ in range(3)]
        os.kill(owner, signal.SIGKILL)
        assert [q.get(60) for q in queued] == [value(6)] * 3
        for b in blockers:
            try:
                b.get(60)
            except WorkerLostError:
                pass  # the owner's running task is lost with it
        # Its result in the parent is intact, and goes on (copied now: its owner is gone).
        assert checksum(r) == value(6)
        assert pool.apply(checksum, (r,)) == value(6)
        del r
        assert settled(pool)


@pytest.mark.parametrize("start_method", METHODS)
def test_receiver_killed_while_it_holds_the_slot(start_method, tmp_path):
    path = str(tmp_path / "pid")
    with jt.Pool(2, start_method=start_method) as pool:
        r = pool.apply(make, (8,))
        held = pool.apply_async(hold, (r, 30.0, path))
        assert wait_until(lambda: started(path), 20)
        assert forwarded(pool) == 1
        victim = started(path)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            held.get(60)
        assert wait_until(lambda: forwarded(pool) == 0, 20)  # its booking went with it
        assert pool.map(checksum, [r, r]) == [value(8)] * 2  # forwarded again
        del r
        assert settled(pool)


def test_receiver_stopped_then_continued(tmp_path):
    """SIGSTOP of the worker holding the slot: other tasks naming it run elsewhere, and the
    stopped one finishes once continued."""
    path = str(tmp_path / "pid")
    with jt.Pool(2) as pool:
        r = pool.apply(make, (2,))
        held = pool.apply_async(hold, (r, 0.5, path))
        assert wait_until(lambda: started(path), 20)
        victim = started(path)
        os.kill(victim, signal.SIGSTOP)
        try:
            assert [pool.apply(checksum, (r,)) for _ in range(3)] == [value(2)] * 3
        finally:
            os.kill(victim, signal.SIGCONT)
        assert held.get(60) == (victim, value(2))
        del r
        assert settled(pool)


def test_terminate_with_forwarded_tasks_queued_leaks_nothing():
    fds = open_fds()
    pool = jt.Pool(2)
    r = pool.apply(make, (1,))
    [pool.apply_async(sleep, (5.0,)) for _ in range(2)]
    [pool.apply_async(checksum, (r,)) for _ in range(5)]
    pool.terminate()
    assert forwarded(pool) == 0 and forwarded_segments(pool) == 0
    assert checksum(r) == value(1)
    del r
    assert wait_until(lambda: fds_back_to(fds))


# --------------------------------------------------------------------------------------------
# the parent's own array sent again (Note [the same array again] in ``pool/_pins``)


def copies(pool) -> int:
    """Slots the parent's arena has handed out so far (each a copy of an array)."""
    arena = pool._state.arena
    with arena.cond:
        return sum(s.gen for s in arena._slots.values() if s.keep is None)


@pytest.mark.parametrize("start_method", METHODS)
def test_the_same_array_sent_again_is_copied_once(start_method):
    x = jnp.arange(N, dtype=jnp.float32)
    want = checksum(x)
    with jt.Pool(2, start_method=start_method) as pool:
        outs = [pool.apply_async(checksum_after, (x, 0.01)) for _ in range(20)]
        assert [o.get(60) for o in outs] == [want] * 20
        assert pool.map(checksum, [x] * 6) == [want] * 6
        tree = pool.share({"a": x, "b": x})
        assert pool.apply(tree_sum, (tree,)) == 2 * want
        tree.release()
        assert copies(pool) == 1
        y = x + 1  # a new array: copied
        assert pool.apply(checksum, (y,)) == want + N
        assert copies(pool) == 2
        del x, y, tree

        def freed():
            import gc

            gc.collect()
            pool._state.arena.apply_deferred()
            return pool._state.arena.in_use() == 0

        if not wait_until(freed):
            raise AssertionError(pool._state.arena._holders())


def test_a_donated_array_is_not_sent_from_its_old_slot():
    x = jnp.arange(N, dtype=jnp.float32)
    with jt.Pool(2) as pool:
        assert pool.apply(checksum, (x,)) == checksum(x)
        x.delete()
        with pytest.raises(jt.ArrayDeletedError, match="deleted"):
            pool.apply(checksum, (x,))


def test_pins_are_dropped_when_memory_runs_short():
    """Pinned slots never make a caller wait or fail: at the cap they are let go, and arrays
    sent again are copied again."""
    cap = 16 << 20
    with jt.Pool(1, shm_capacity=cap) as pool:
        xs = [jnp.full((N,), float(i), jnp.float32) for i in range(12)]  # 24 MiB in all
        for i, x in enumerate(xs):
            assert pool.apply(checksum, (x,)) == float(i) * N
        assert pool._state.pins.bytes <= cap // 2
        assert [pool.apply(checksum, (x,)) for x in xs] == [float(i) * N for i in range(12)]
