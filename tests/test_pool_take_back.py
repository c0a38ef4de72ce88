"""A stalled worker's unstarted chunks move to an idle worker (issue 21 item 3), and no task
ever runs twice (Note [taking back a chunk] in jaxtransport/pool/_worker.py).

Every task appends one line (its index and pid) to a log file with O_APPEND (atomic for a short
line), so the test counts runs, not results: a task run twice would show twice even if only
one result came back. Per start method; bounds are generous against a noisy shared machine.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import jaxtransport as jt

from .conftest import wait_until, worker_pids

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request):
    return request.param


def logged(path: str, i: int, seconds: float = 0.0) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    if seconds:
        time.sleep(seconds)
    return i * i


def runs(path: str) -> list[tuple[int, int]]:
    try:
        with open(path) as f:
            return [tuple(map(int, line.split())) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_idle_stopped_worker_gives_its_tasks_to_the_other(start_method, tmp_path):
    log = str(tmp_path / "runs")
    p = jt.Pool(2, start_method=start_method)
    try:
        stopped, other = worker_pids(p)
        os.kill(stopped, signal.SIGSTOP)
        try:
            start = time.monotonic()
            rs = [p.apply_async(logged, (log, i)) for i in range(20)]
            assert [r.get(timeout=30) for r in rs] == [i * i for i in range(20)]
            took = time.monotonic() - start
            # each ran once, all on the worker that was not stopped
            assert sorted(runs(log)) == [(i, other) for i in range(20)], took
        finally:
            os.kill(stopped, signal.SIGCONT)
        # resumed, the stopped worker skips what was taken back from it: nothing runs twice
        # and it runs tasks again once it has read and skipped them (a moment after SIGCONT)
        seen: set = set()
        for _ in range(20):
            seen |= {r.get(60) for r in [p.apply_async(pid_after, (0.3,)) for _ in range(2)]}
            if seen == {other, stopped}:
                break
        assert seen == {other, stopped}
        assert sorted(i for i, _ in runs(log)) == list(range(20))
        p.close()
        p.join()
    finally:
        p.terminate()
    assert sorted(i for i, _ in runs(log)) == list(range(20))


def test_a_started_chunk_stays_with_its_stopped_worker(start_method, tmp_path):
    log = str(tmp_path / "runs")
    p = jt.Pool(2, start_method=start_method)
    try:
        worker_pids(p)
        long = p.apply_async(logged, (log, 100, 3.0))
        assert wait_until(lambda: runs(log), 30)
        ((_, busy),) = runs(log)
        os.kill(busy, signal.SIGSTOP)  # mid-task: it has started, it must not run elsewhere
        try:
            rs = [p.apply_async(logged, (log, i)) for i in range(20)]
            assert [r.get(timeout=30) for r in rs] == [i * i for i in range(20)]
            time.sleep(0.3)
            assert not long.ready()
        finally:
            os.kill(busy, signal.SIGCONT)
        assert long.get(timeout=30) == 100 * 100
        got = runs(log)
        assert sorted(i for i, _ in got) == list(range(20)) + [100]
        assert [pid for i, pid in got if i == 100] == [busy]
        assert all(pid != busy for i, pid in got if i != 100)
        p.close()
        p.join()
    finally:
        p.terminate()


def test_stop_and_continue_at_random_never_runs_a_task_twice(start_method, tmp_path):
    # The race of Note [taking back a chunk]: the parent takes chunks back while the worker
    # may be starting one of them. Stop and continue a worker over and over while quick tasks
    # flow; every task runs exactly once.
    import random

    rng = random.Random(21)
    log = str(tmp_path / "runs")
    n = 300
    p = jt.Pool(2, start_method=start_method)
    try:
        pids = worker_pids(p)
        rs = []
        for i in range(n):
            rs.append(p.apply_async(logged, (log, i, rng.choice((0.0, 0.0, 0.002)))))
            if i % 15 == 0:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGSTOP)
                time.sleep(rng.uniform(0.0, 0.12))
                os.kill(victim, signal.SIGCONT)
        assert [r.get(timeout=60) for r in rs] == [i * i for i in range(n)]
        p.close()
        p.join()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        p.terminate()
    assert sorted(i for i, _ in runs(log)) == list(range(n))


def test_maxtasksperchild_counts_only_tasks_run(start_method, tmp_path):
    # Chunks taken back do not count toward the stopped worker's maxtasksperchild.
    log = str(tmp_path / "runs")
    with jt.Pool(2, start_method=start_method, maxtasksperchild=3) as p:
        stopped, _other = worker_pids(p)
        os.kill(stopped, signal.SIGSTOP)
        try:
            rs = [p.apply_async(logged, (log, i)) for i in range(12)]
            assert [r.get(timeout=60) for r in rs] == [i * i for i in range(12)]
        finally:
            os.kill(stopped, signal.SIGCONT)
        rs = [p.apply_async(logged, (log, i)) for i in range(12, 24)]
        assert [r.get(timeout=60) for r in rs] == [i * i for i in range(12, 24)]
    assert sorted(i for i, _ in runs(log)) == list(range(24))
