"""Shared fixtures: OS-level leak checks after every test, helpers for fresh interpreters.

Leak check (torch's test_multiprocessing habit): after each test no new entry that the test
could have made may remain in /dev/shm (Note [shm leak check]) and no child process of the test
process may survive. Tests marked ``ray`` share a session-scoped Ray cluster whose processes
outlive single tests, so they are exempt from the child-process half of the check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

# The debug lock-order checker (jaxtransport/_lockorder.py) on for the whole suite, before any
# jaxtransport lock exists; child interpreters and pool workers inherit it. A test during which
# a thread takes two of the package's locks against their written order fails (no_leaks).
os.environ.setdefault("JAXTRANSPORT_CHECK_LOCKS", "1")

# Ray starts its worker processes at niceness 15 (its worker_niceness setting). On a machine
# whose cores are all busy (CI's 2 cores under 3 test processes, with another suite beside) a
# niceness-15 worker gets a few percent of a core from the scheduler: importing JAX took it over
# a minute, and Ray tests that start a worker took about 100 s against 2 s on an idle machine.
# Every Ray this suite starts (the fixtures, the fresh interpreters it runs, the demo) inherits
# this: its workers run at the tests' own niceness. Nothing here depends on the niceness.
os.environ.setdefault("RAY_worker_niceness", "0")

SHM = "/dev/shm"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Note [shm leak check]
# /dev/shm is shared by every program on the machine (a joblib job elsewhere leaves its
# joblib_memmapping_folder_* there while it runs), so the leak check counts only a new entry
# that jaxtransport or the test's own processes could have made:
# - a name starting with one of OWN_SHM_PREFIXES: jaxtransport's own names, whoever made them.
#   Its segments are memfds with no name on Linux; a named segment (a platform without
#   memfd_create) must start with one of these, so that a leak of one fails the suite;
# - a name of a library the suite drives that carries its creator's pid (PID_SHM_NAMES), when
#   that pid is the test process or a live process below it.
# Anything else (another program's, or another test run's on the same machine) is ignored.
# Semaphores (sem.*) are the resource tracker's to report, not this check's.
OWN_SHM_PREFIXES: tuple[str, ...] = ("jaxtransport",)
PID_SHM_NAMES = (
    re.compile(r"joblib_memmapping_folder_(?P<pid>\d+)_"),  # joblib/loky memory-mapped arguments
    re.compile(r"pym-(?P<pid>\d+)-"),  # multiprocessing.heap's arenas (unlinked as soon as made)
    re.compile(r"torch_(?P<pid>\d+)_"),  # torch.multiprocessing's file_system strategy
)


def shm_entries() -> set[str]:
    try:
        return {e for e in os.listdir(SHM) if not e.startswith(("sem.", "."))}
    except FileNotFoundError:
        return set()


def _ancestors(pid: int) -> set[int]:
    """``pid`` and the processes above it (read from /proc; empty when it is gone)."""
    out: set[int] = set()
    while pid > 1 and pid not in out:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            break
        out.add(pid)
        pid = int(fields[1])
    return out


def shm_leaks(before: set[str], after: set[str], me: int | None = None) -> set[str]:
    """The entries of ``after`` not in ``before`` that jaxtransport or process ``me`` (default:
    this one) and the processes below it could have made (Note [shm leak check])."""
    me = os.getpid() if me is None else me
    leaks = set()
    for name in after - before:
        if name.startswith(OWN_SHM_PREFIXES):
            leaks.add(name)
            continue
        for pattern in PID_SHM_NAMES:
            m = pattern.match(name)
            if m is not None and me in _ancestors(int(m.group("pid"))):
                leaks.add(name)
                break
    return leaks


# How a jaxtransport segment shows in /proc/self/maps and /proc/self/fd: a memfd (Linux), or an
# unlinked POSIX shared-memory object (the portable path, Note [segment kinds] in _os).
SEGMENT_MARKS = ("memfd:jaxtransport", "/dev/shm/jaxtransport-")


def is_segment(text: str) -> bool:
    """Whether a line of /proc/self/maps (or an fd's link) names a jaxtransport segment."""
    return any(m in text for m in SEGMENT_MARKS)


def memfd_mapped(address: int) -> bool:
    """Whether ``address`` lies in a jaxtransport segment mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return len(parts) >= 6 and is_segment(parts[5])
    return False


def popen_interruptible(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` whose child starts with SIGINT at its default (Python's
    KeyboardInterrupt). A test run started in the background by a non-interactive shell
    (``cmd &``) has SIGINT ignored, and an ignored signal stays ignored across exec, so a
    Ctrl-C test could not interrupt its child otherwise. Call from the main thread."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, old)


# What CPython prints when a KeyboardInterrupt is raised inside JAX's gc callback: it discards
# exceptions raised in gc callbacks, so that Ctrl-C is lost (jax-ml/jax#18246).
JAX_LOST_INTERRUPT = "Exception ignored in: <function _xla_gc_callback"


def interrupt(proc: subprocess.Popen, stderr_path: str, timeout: float = 30.0) -> int:
    """Ctrl-C ``proc`` (SIGINT) and wait for it to exit; returns its exit code.

    A SIGINT that arrives while JAX's garbage-collection callback runs is printed as
    ``JAX_LOST_INTERRUPT`` and lost: not jaxtransport's to answer, and a user presses Ctrl-C
    again. So does this, once for each such line in ``stderr_path`` (the child's stderr, a
    file). Any other interrupt left unanswered is a ``subprocess.TimeoutExpired``."""
    import signal

    proc.send_signal(signal.SIGINT)
    sent = 1
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.wait(0.2)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise
        with open(stderr_path, errors="replace") as f:
            if f.read().count(JAX_LOST_INTERRUPT) >= sent:
                proc.send_signal(signal.SIGINT)
                sent += 1


def child_pids(parent: int | None = None) -> set[int]:
    """Live (non-zombie-reaped) children of ``parent`` read from /proc."""
    parent = os.getpid() if parent is None else parent
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.add(int(entry))
    return out


def _service_pids() -> set[int]:
    """Process-wide helpers multiprocessing starts once and keeps by design (not leaks):
    the resource tracker (semaphores of spawn-context queues) and the forkserver."""
    pids = set()
    try:
        from multiprocessing import forkserver, resource_tracker

        for obj in (resource_tracker._resource_tracker, forkserver._forkserver):
            pid = getattr(obj, "_pid", None) or getattr(obj, "_forkserver_pid", None)
            if pid:
                pids.add(pid)
    except Exception:
        pass
    return pids


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pid_once_all_started(marks: str, i: int, n: int) -> int:
    """A pool task: its worker's pid, returned once ``n`` such tasks have started (each leaves
    a file in the folder ``marks``), or after 60 s."""
    open(os.path.join(marks, str(i)), "w").close()
    wait_until(lambda: len(os.listdir(marks)) >= n, 60, 0.01)
    return os.getpid()


def worker_pids(pool, n: int = 2) -> list[int]:
    """The pids of a pool's ``n`` workers, once all of them run tasks. ``n`` tasks that each end
    only when all have started cannot share a worker, however late one worker starts on a loaded
    machine (two tasks that merely slept could: the first worker idle, the Pool takes the late
    worker's unstarted task back and gives it to the first)."""
    import shutil
    import tempfile

    marks = tempfile.mkdtemp(prefix="jaxtransport-test-pids-")
    try:
        rs = [pool.apply_async(pid_once_all_started, (marks, i, n)) for i in range(n)]
        pids = sorted({r.get(120) for r in rs})
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    assert len(pids) == n, f"{n} tasks that wait for each other ran on {len(pids)} workers"
    return pids



@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that needs Ray is slow too (a Ray cluster starts in seconds, its tasks and
    actors in more): ``make test`` leaves them out, ``make test-slow`` and CI run them.

    Note [parallel test processes]
    The make targets run the suite in several test processes (pytest-xdist, ``-n TEST_JOBS
    --dist loadgroup``): most of a test's time is spent waiting on the processes it starts, so
    even on 2 cores more than one test runs at a time. Each test process is a separate pytest
    process with its own leak check (its own children, the /dev/shm entries its processes could
    make). Each test file is one xdist group, so its tests run one after another in one test
    process, in the file's order, as without xdist: the tests of a file share module fixtures
    (a warm pool) and process-wide settings (``set_shm_capacity``), and a test may meet what
    the test before it left (seen: ``test_killed_consumer_gives_its_memory_back`` run straight
    after ``test_memory_is_recycled_and_the_producer_does_not_grow``, without the test between
    them, fails its first put: issue 49's note). The tests marked ``ray``, whatever their file,
    are one group of their own: they share one session-scoped Ray cluster and the two-node
    cluster test, one Ray cluster at a time on the machine, as without xdist (a plain
    ``ray.init()``, as the demo's, joins the machine's latest cluster: with another test's Ray
    beside it, test_cli_ray_end_to_end took 180 s against 49, most likely waiting for that
    cluster's CPUs). A test without Ray that runs in a fresh interpreter and shares nothing with
    its file's other tests may name an xdist group of its own (``pytest.mark.xdist_group``), so
    that it runs beside them: the shards of joblib's own suite. pytest-xdist writes the group
    into each test's node id (``name@group``); under pytest 9.2 it cannot,
    and the groups silently fell apart (.ci/tools.txt holds pytest below 9.2;
    ``tests/test_leak_check.py::test_each_file_is_one_xdist_group`` checks)."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            if item.get_closest_marker("slow") is None:
                item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_collection_finish(session):
    """Note [objects frozen after collection]
    ``no_leaks`` runs a full garbage collection after every test. A test process that has
    imported JAX, NumPy, hypothesis and the test modules holds some 120,000 objects that live
    until it exits, and a full collection walked them all: about 0.2 s a test on CI's 2 cores,
    two thirds of a test process's CPU time in ``test_codec`` (py-spy), for 1,800 tests. What
    exists once collection has finished (modules, their functions and parameters) is moved to
    the permanent generation (``gc.freeze``), which collections skip. Everything a test
    creates is still collected after it: frozen are only objects that were reachable before any
    test ran. Each test process (xdist worker) collects, and so freezes, for itself."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaks(request):
    before_shm = shm_entries()
    check_children = request.node.get_closest_marker("ray") is None
    before_children = child_pids() if check_children else set()
    from jaxtransport import _lockorder

    _lockorder.clear()
    yield
    inversions = _lockorder.violations()
    _lockorder.clear()
    assert not inversions, "lock-order inversion during the test:\n" + "\n".join(inversions)
    # Give finalizers and exiting children a moment, then insist. (The collection also frees
    # arrays in reference cycles that still hold a process-wide arena's slots: a later test with
    # a small shm capacity must not inherit them.)
    import gc

    gc.collect()
    leaked_shm: set[str] = set()

    def shm_clean():
        nonlocal leaked_shm
        leaked_shm = shm_leaks(before_shm, shm_entries())
        return not leaked_shm

    assert wait_until(shm_clean, 10), f"test leaked /dev/shm entries: {sorted(leaked_shm)}"
    if check_children:
        leaked: set[int] = set()

        def children_gone():
            nonlocal leaked
            leaked = child_pids() - before_children - _service_pids()
            return not leaked

        assert wait_until(children_gone, 15), f"test left child processes alive: {sorted(leaked)}"


class SlowPieces:
    """``np.asarray`` standing in for the copy threads' take of a device piece: each call on a
    ``jax.Array`` sleeps 50 ms, the ``fail_at``-th raises RuntimeError("piece N failed");
    ``running`` is how many are under way, ``ended`` the calls that have ended (in order)."""

    def __init__(self, asarray, fail_at: int):
        self.real, self.fail_at = asarray, fail_at
        self.running, self.calls, self.ended = 0, 0, []
        self.lock = threading.Lock()

    def __call__(self, a, *args, **kwargs):
        import jax

        if isinstance(a, jax.Array):
            with self.lock:
                self.calls += 1
                self.running += 1
                mine = self.calls
            try:
                time.sleep(0.05)
                if mine == self.fail_at:
                    raise RuntimeError(f"piece {mine} failed")
            finally:
                with self.lock:
                    self.running -= 1
                    self.ended.append(mine)
        return self.real(a, *args, **kwargs)


def run_python(code: str, *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (the real cross-process check)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def huge_pages_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding ``address`` in this process (None: not found)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                inside = lo <= address < hi
            elif inside and parts and parts[0] == "AnonHugePages:":
                return int(parts[1])
    return None


def malloc_huge_pages_work() -> str | None:
    """Why glibc.malloc.hugetlb=1 cannot give huge pages here (None when it can)."""
    import platform

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are disabled on this kernel"
    except OSError:
        return "no transparent huge pages on this system"
    lib, version = platform.libc_ver()
    if lib != "glibc" or tuple(int(v) for v in version.split(".")[:2]) < (2, 35):
        return f"glibc.malloc.hugetlb needs glibc >= 2.35 (this is {lib} {version})"
    return None


# --------------------------------------------------------------------------------------------
# Version awareness: what this JAX has. A test needing something missing skips with the reason.


def jax_version_str() -> str:
    import jax

    return f"jax {jax.__version__}"


def dtype_missing(name: str) -> str | None:
    """Why this JAX cannot hold arrays of dtype ``name`` (None when it can)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        dt = np.dtype(jnp.dtype(name))
        np.asarray(jax.device_put(np.zeros((2,), dt)))
    except Exception as e:
        return f"{jax_version_str()} has no dtype {name} ({type(e).__name__})"
    return None


def dtype_params(names) -> list:
    """``names`` as pytest params, those this JAX lacks marked skip with the reason."""
    out = []
    for name in names:
        why = dtype_missing(name)
        out.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=why)) if why else name)
    return out


def weak_typed(x):
    """``x`` as a weak-typed array (same dtype, same bits), asserted weak: the input of every
    weak-type round-trip test. Uses jax's own ``_convert_element_type(weak_type=True)``, what
    ``jnp`` calls for Python scalars (jax/_src/lax/lax.py; same signature from 0.4.30 to 0.12)."""
    from jax._src.lax import lax as lax_internal

    out = lax_internal._convert_element_type(x, x.dtype, weak_type=True)
    assert out.weak_type, "could not make a weak-typed test input"
    return out


def shard_map(f, **kwargs):
    """``jax.shard_map`` (jax >= 0.6), else ``jax.experimental.shard_map.shard_map`` (same
    arguments): tracer detection under shard_map is tested on every version."""
    import jax

    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    return fn(f, **kwargs)


def _accelerator() -> str | None:
    """The platform of the accelerator JAX finds in this process, None when it finds none."""
    import jax

    platform = jax.default_backend()
    return None if platform == "cpu" else platform


def pytest_runtest_setup(item):
    """Tests marked ``device`` need an accelerator in this process (``make test-device``): they
    are skipped where JAX finds none, as in CI. Tests marked ``shm`` check the shared-memory mechanism itself: where arrays travel in-band
    (Note [platforms] in jaxtransport/_os) there is none, and they are skipped."""
    if item.get_closest_marker("device") is not None and _accelerator() is None:
        pytest.skip("no accelerator here: make test-device runs these on one (a TPU or GPU host)")
    if item.get_closest_marker("shm") is not None:
        from jaxtransport import _os

        if _os.in_band():
            pytest.skip("no shared memory here: arrays travel in-band (Note [platforms])")
