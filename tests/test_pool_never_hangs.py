"""The Pool never hangs: each way it could stall, bounded in time, through the public API, once
per start method (spawn and forkserver), as loky runs its executor suite per start method.

Each test's bound is generous against the noise of a shared machine but far below the stall it
guards against (the 8 s task, the stopped worker, a deadlock that never ends)."""

from __future__ import annotations

import os
import pickle
import signal
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import CorruptTransferError, PoolStateError, ShmCapacityError

from .conftest import wait_until, worker_pids

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20
ARG = np.ones(300_000 // 8)  # 300 KB: below the shm threshold, so it travels in the pipe


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request):
    return request.param


def pid_after(seconds: float):
    time.sleep(seconds)
    return os.getpid()


def total(x):
    return float(x.sum())


def test_quick_tasks_beside_a_long_one_are_not_stuck_behind_it(start_method):
    with jt.Pool(2, start_method=start_method) as p:
        worker_pids(p)
        long = p.apply_async(pid_after, (8.0,))
        time.sleep(0.2)  # the long task is running on one worker
        start = time.monotonic()
        quick = [p.apply_async(total, (ARG,)) for _ in range(20)]
        for r in quick:
            assert r.get(timeout=max(6.0 - (time.monotonic() - start), 0.01)) == ARG.size
        assert not long.ready()  # they all finished while the long task still ran


def test_a_stopped_worker_stalls_only_itself(start_method):
    with jt.Pool(2, start_method=start_method) as p:
        stopped, _other = worker_pids(p)
        os.kill(stopped, signal.SIGSTOP)
        try:
            quick = [p.apply_async(total, (ARG,)) for _ in range(20)]
            # One task may have gone to the stopped worker before it was known to be stuck
            # (nothing can tell a stopped process from a slow one); every other one completes.
            assert wait_until(lambda: sum(r.ready() for r in quick) >= 19, 20)
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert [r.get(60) for r in quick] == [ARG.size] * 20


def test_a_callback_may_call_apply(start_method):
    with jt.Pool(2, start_method=start_method) as p:
        got, errors = [], []

        def chain(v):
            got.append(p.apply(abs, (-v,)))  # works: callbacks do not run on the manager

        def nested(v):
            try:  # this one needs the callback thread itself: a clear error at once
                p.apply_async(abs, (v,), callback=got.append).get(30)
            except PoolStateError as e:
                errors.append(e)

        start = time.monotonic()
        p.apply_async(abs, (-3,), callback=chain).wait(60)
        p.apply_async(abs, (-4,), callback=nested).wait(60)
        assert time.monotonic() - start < 30
        assert wait_until(lambda: len(got) == 2, 30)
        assert got == [3, 4] or got == [3, 4][::-1]
        assert len(errors) == 1 and "callback" in str(errors[0])
        assert p.apply(abs, (-5,)) == 5  # the pool goes on


def send_raw(raw: bytes, then_sleep: float = 0.0):
    from jaxtransport.pool import _worker

    _worker.CURRENT.send_raw(raw)  # one frame, as Connection.send_bytes writes it
    time.sleep(then_sleep)
    return "unreachable" if then_sleep else "sent"


BAD_FROM_WORKER = {
    "not-a-pickle": b"\x00garbage",
    "unknown-kind": pickle.dumps(("frobnicate", 1)),
    "release-not-a-list": pickle.dumps(("release", 5)),
    "release-bad-handle": pickle.dumps(("release", [("a", "b")])),
    "result-wrong-arity": pickle.dumps(("result", 1, True)),
    # Note [bulk bytes after the pickle]: more bytes said to follow than the frame holds
    "result-trailer-too-long": pickle.dumps(("result", 1, True, 10**9, [], [], [], 0.1)),
}


@pytest.mark.parametrize("case", sorted(BAD_FROM_WORKER))
def test_malformed_message_from_a_worker_fails_only_its_task(start_method, case):
    start = time.monotonic()
    with jt.Pool(2, start_method=start_method) as p:
        r = p.apply_async(send_raw, (BAD_FROM_WORKER[case], 30.0))
        with pytest.raises(CorruptTransferError, match="malformed message"):
            r.get(60)
        assert p.map(abs, range(-4, 0)) == [4, 3, 2, 1]  # the worker was replaced; others go on
    assert time.monotonic() - start < 90  # and leaving `with` does not hang


BAD_TO_WORKER = {
    "not-a-pickle": b"\x00garbage",
    "unknown-kind": pickle.dumps(("frobnicate",)),
    "release-not-a-list": pickle.dumps(("release", 5)),
    "task-bad-fields": pickle.dumps(("task", 10**9, "not bytes", [], [])),
    "drop-tree-bad-id": pickle.dumps(("drop-tree", "x")),
    "task-trailer-too-long": pickle.dumps(("task", 10**9, 10**9, [], [])),
    "task-trailer-negative": pickle.dumps(("task", 10**9, -1, [], [])),
}


@pytest.mark.parametrize("case", sorted(BAD_TO_WORKER))
def test_malformed_message_to_a_worker_never_hangs_the_pool(start_method, case):
    start = time.monotonic()
    with jt.Pool(1, start_method=start_method) as p:
        assert p.apply(abs, (-1,)) == 1
        # An adversarial write on the pipe (no public API sends raw bytes).
        p._state.workers[0].post(BAD_TO_WORKER[case])
        assert [p.apply(abs, (-i,)) for i in range(5)] == list(range(5))
    assert time.monotonic() - start < 90


def big_result(v):
    return jnp.full((MIB // 4,), v, jnp.float32)  # 1 MiB: through the worker's shared memory


def test_imap_with_a_slow_consumer_makes_workers_wait(start_method):
    # Four 1 MiB results fit in each worker's shared memory; a consumer slower than the workers
    # must not make them pile up results there (and fail with ShmCapacityError).
    with jt.Pool(2, start_method=start_method, shm_capacity=4 * MIB) as p:
        values = []
        for out in p.imap(big_result, range(16)):
            values.append(float(out[0]))
            del out
            time.sleep(0.15)
        assert values == [float(v) for v in range(16)]


def keep_results(n):
    return [jnp.full((MIB // 4,), i, jnp.float32) for i in range(n)]


@pytest.mark.shm
def test_worker_shared_memory_at_its_limit_is_a_clear_error(start_method, monkeypatch):
    from jaxtransport.pool import _launch

    monkeypatch.setattr(_launch, "CAPACITY_GRACE_S", 0.5)
    with jt.Pool(1, start_method=start_method, shm_capacity=4 * MIB) as p:
        held = p.apply(keep_results, (3,))  # 3 MiB of the worker's 4 stay alive here
        with pytest.raises(ShmCapacityError, match="shm_capacity"):
            p.apply(keep_results, (3,))
        del held
        assert len(p.apply(keep_results, (3,))) == 3  # released: works again


def worker_capacity(_=None):
    from jaxtransport.pool import _worker

    return _worker.CURRENT.arena.capacity


def test_default_shared_memory_is_sized_for_the_machine_as_a_whole(start_method):
    from jaxtransport import _shm

    free = _shm.free_memory()
    with jt.Pool(2, start_method=start_method) as p:
        caps = p.map(worker_capacity, range(2), chunksize=1)
        parent = p._state.arena.capacity
    floor = _shm.MIN_CAPACITY
    assert parent + 2 * max(caps) <= max(free, 3 * floor)
