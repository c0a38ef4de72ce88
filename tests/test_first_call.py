"""The first call (issue 14): how new shared memory gets its pages, Pool(shm_reserve=...),
segments that grow instead of starting over, and workers that import JAX only when a task
needs it. No timing assertions: page counts, segment counts and sys.modules."""

from __future__ import annotations

import gc
import os
import platform
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _os, _shm
from jaxtransport._errors import ShmCapacityError

from .conftest import ROOT, run_python, wait_until

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def allocated(fd: int) -> int:
    """Bytes of the file behind ``fd`` that have pages (st_blocks counts 512-byte units)."""
    return os.fstat(fd).st_blocks * 512


# ------------------------------------------------------------------------------------------
# how a segment gets its pages


def test_population_method_follows_the_kernel():
    method = _os.populate_method()
    if _kernel_at_least(5, 14):
        assert method == "madvise"
    else:
        assert method in ("madvise", "fallocate")


def test_new_segment_has_every_page_before_the_first_write():
    size = 8 * MIB
    fd, mm = _os.create_segment(size)
    try:
        assert allocated(fd) >= size  # reserved up front: a full system fails here, not later
        view = np.frombuffer(mm, np.uint8)
        view[:: _shm.PAGE] = 7
        assert int(view[:: _shm.PAGE].sum()) == 7 * (size // _shm.PAGE)
        del view
    finally:
        mm.close()
        os.close(fd)


def test_memory_that_cannot_be_had_is_a_capacity_error_not_sigbus():
    """A write to a page past the end of a memfd is a SIGBUS. MADV_POPULATE_WRITE reports it as
    an error instead, which the arena turns into ShmCapacityError: the same path a system out of
    memory takes. Run in a fresh interpreter so that a SIGBUS would fail the test, not pytest."""
    if _os.populate_method() != "madvise":
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (fallocate path: reserved up front)")
    code = textwrap.dedent(
        """
        import os
        from jaxtransport import _os, _shm
        from jaxtransport._errors import ShmCapacityError
        fd = os.memfd_create("short", os.MFD_CLOEXEC)
        os.ftruncate(fd, 64 * _shm.PAGE)
        mm = __import__("mmap").mmap(fd, 64 * _shm.PAGE)
        os.ftruncate(fd, _shm.PAGE)  # the mapping has 64 pages; the file now has one
        try:
            _os.populate(mm, 0, 64 * _shm.PAGE)
        except ShmCapacityError as e:
            assert "could not reserve" in str(e) and "Fixes" in str(e), e
            print("capacity error")
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0 and "capacity error" in proc.stdout, (proc.returncode, proc.stderr)


def test_a_slightly_smaller_array_reuses_a_free_larger_slot():
    arena = _shm.Arena(256 * MIB)
    try:
        h, _ = arena.alloc(8 * MIB, "a")
        arena.release(h, "a")
        h2, view = arena.alloc(5 * MIB, "a")  # class 5 MiB: served by the free 8 MiB slot
        assert arena.segments_created == 1 and h2[0] == h[0] and view.nbytes == 5 * MIB
        h3, _ = arena.alloc(3 * MIB, "a")  # more than twice smaller: its own segment
        assert arena.segments_created == 2 and h3[0] != h[0]
    finally:
        arena.close()


def test_a_larger_array_grows_a_free_segment_in_place():
    arena = _shm.Arena(256 * MIB)
    try:
        h, _ = arena.alloc(4 * MIB, "a")
        arena.release(h, "a")
        h2, view = arena.alloc(12 * MIB, "a")
        assert (arena.segments_created, arena.segments_grown) == (1, 1)
        assert h2[0] != h[0] and arena.take_forgotten() == [h[0]]  # receivers drop the old id
        seg = arena.segment(h2[0])
        assert seg.size >= 12 * MIB and allocated(seg.fd) >= seg.size
        assert arena.mapped == seg.size
        view[:] = 3  # every byte writable
        assert int(view[:: _shm.PAGE].sum()) == 3 * (12 * MIB // _shm.PAGE)
        del view
        # A held segment never grows: the next one is new.
        h3, _ = arena.alloc(20 * MIB, "a")
        assert (arena.segments_created, arena.segments_grown) == (2, 1)
    finally:
        arena.close()


def test_arena_reserve_serves_the_first_alloc_and_respects_the_cap():
    arena = _shm.Arena(64 * MIB)
    try:
        t = arena.reserve(16 * MIB)
        h, _ = arena.alloc(16 * MIB, "a")  # waits for the reservation rather than making another
        t.join()
        assert arena.segments_created == 1
        arena.release(h, "a")
        with pytest.raises(ShmCapacityError, match=r"shm_reserve=.*does not fit"):
            arena.reserve(128 * MIB)
    finally:
        arena.close()


# ------------------------------------------------------------------------------------------
# Pool(shm_reserve=...)


def _worker_segments():
    from jaxtransport.pool import _worker

    a = _worker.CURRENT.arena
    for t in list(__import__("threading").enumerate()):
        if t.name == "jaxtransport-shm-reserve":
            t.join()
    return a.segments_created, a.mapped


def _make(n):
    return np.full(n, 5, np.uint8)


def _total(x):
    return int(x[::4096].sum()), x.nbytes


@pytest.mark.parametrize("reserve", [8 * MIB, (8 * MIB, 8 * MIB)], ids=["int", "pair"])
def test_shm_reserve_serves_first_argument_and_first_result(reserve):
    with jt.Pool(1, shm_reserve=reserve) as p:
        made, mapped = p.apply(_worker_segments)
        assert made == 1 and mapped >= 8 * MIB  # the worker made its result slot at start
        x = np.full(7 * MIB, 2, np.uint8)
        assert p.apply(_total, (x,)) == (2 * len(range(0, x.nbytes, 4096)), x.nbytes)
        assert p._state.arena.segments_created == 1  # the parent's reserved slot, no new one
        y = p.apply(_make, (7 * MIB,))
        assert y.nbytes == 7 * MIB and int(y[::4096].sum()) == 5 * (y.nbytes // 4096)
        assert p.apply(_worker_segments)[0] == 1
        del y


def test_shm_reserve_one_side_only():
    with jt.Pool(1, shm_reserve=(0, 4 * MIB)) as p:
        assert p.apply(_worker_segments)[0] == 1
        assert p._state.arena.segments_created == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "1G", True, (1, 2, 3), (1, -2), [1, 2]])
def test_shm_reserve_validated(bad):
    with pytest.raises(ValueError, match="shm_reserve"):
        jt.Pool(1, shm_reserve=bad)


def test_shm_reserve_beyond_capacity_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"shm_reserve asks for .* more than shm_capacity"):
        jt.Pool(1, shm_reserve=64 * MIB, shm_capacity=16 * MIB)
    gc.collect()


# ------------------------------------------------------------------------------------------
# workers import JAX only when a task needs it

_LAZY_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxtransport as jt
    assert "jax" not in sys.modules, "import jaxtransport imported jax"

    def numpy_task(x):
        import sys
        return float(x.sum()), "jax" in sys.modules

    def jax_task(x):
        import sys
        return type(x).__name__, str(x.dtype), float(x.sum()), "jax" in sys.modules

    def jax_result(n):
        import jax.numpy as jnp
        return jnp.arange(n, dtype=jnp.float64)

    if __name__ == "__main__":
        X64 = {x64}
        if X64:
            import jax
            jax.config.update("jax_enable_x64", True)
        with jt.Pool(1, preload_jax=False) as p:  # lazily, although this parent has JAX (x64)
            print("numpy", p.apply(numpy_task, (np.ones(1 << 20),)))
            print("numpy", p.apply(numpy_task, (np.ones(10),)))
            import jax, jax.numpy as jnp
            dt = jnp.float64 if X64 else jnp.float32
            print("jax", p.apply(jax_task, (jnp.arange(1 << 18, dtype=dt),)))
            print("small", p.apply(jax_task, (jnp.arange(4, dtype=dt),)))
            y = p.apply(jax_result, (1 << 18,))
            print("result", type(y).__name__, y.dtype, float(y[-1]))
    """
)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_worker_imports_jax_only_when_a_task_needs_it(x64):
    proc = run_python(_LAZY_SCRIPT.format(x64=x64), env={"JAX_PLATFORMS": "cpu"}, timeout=150)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    n = 1 << 18
    dt = "float64" if x64 else "float32"
    assert lines[0] == f"numpy ({float(1 << 20)}, False)"
    assert lines[1] == "numpy (10.0, False)"  # still no JAX in the worker
    assert lines[2] == f"jax ('ArrayImpl', '{dt}', {float(n * (n - 1) // 2)}, True)"
    assert lines[3] == f"small ('ArrayImpl', '{dt}', 6.0, True)"
    # x64 reached the worker's JAX through its environment although JAX started late there
    assert lines[4] == f"result ArrayImpl {dt} {float(n - 1)}"


def test_import_jaxtransport_imports_no_jax():
    proc = run_python(
        "import sys, jaxtransport as jt\n"
        "assert 'jax' not in sys.modules\n"
        "jt.ShmCapacityError, jt.Pool\n"  # the Pool's machinery loads JAX; the errors do not
        "assert issubclass(jt.TracerTransportError, __import__('jax').errors.ConcretizationTypeError)\n"
        "print('ok', sorted(set(jt.__all__) - set(dir(jt))))\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok []", proc.stderr


_NO_JAX_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxtransport as jt
    import jaxtransport.multiprocessing as jmp

    def task(x):
        import sys
        return x * 2, "jax" in sys.modules

    def jax_in_worker(_=None):
        import sys
        return "jax" in sys.modules

    def echo(q_in, q_out):
        q_out.put(q_in.get(timeout=60))

    if __name__ == "__main__":
        big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: through shared memory
        with jt.Pool(2) as p:
            out = p.map(task, [big, np.ones(3)])
            with p.share({"w": big}) as shared:
                p.apply(jax_in_worker, (shared,))
            assert all(np.array_equal(o, x * 2) for (o, _), x in zip(out, [big, np.ones(3)]))
            print("pool", "jax" in sys.modules, [w for _, w in out])
        with jt.Executor(1) as ex:
            got, worker_jax = ex.submit(task, big).result(timeout=60)
            print("executor", "jax" in sys.modules, worker_jax)
        q_in, q_out = jmp.Queue(), jmp.Queue()
        a, b = jmp.Pipe()
        proc = jmp.Process(target=echo, args=(q_in, q_out))
        proc.start()
        q_in.put(big)
        back = q_out.get(timeout=60)
        proc.join(30)
        a.send(big)
        print("multiprocessing", "jax" in sys.modules, np.array_equal(back, big), np.array_equal(b.recv(), big))
    """
)


def test_numpy_only_work_never_imports_jax(tmp_path):
    """Issue 22: no JAX import the data does not need, in the parent or the workers."""
    import subprocess

    script = tmp_path / "numpy_only.py"  # a script: the Process target is its __main__.echo
    script.write_text(_NO_JAX_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "pool False [False, False]",
        "executor False False",
        "multiprocessing False True True",
    ], proc.stdout + proc.stderr[-2000:]


_START_TASKS = textwrap.dedent(
    """
    import sys

    LATE = ("jaxtransport._wire", "jaxtransport._usercode", "cloudpickle", "jaxtransport._shm._arena",
            "jaxtransport._shm._mapper")

    def loaded(x=None):  # a str: a result that needs no encoder either (a list would load it)
        return repr([m for m in LATE if m in sys.modules])

    # Only the parent's pool machinery needs them (RemoteTraceback's base, the pool errors' base).
    NEVER = ("multiprocessing.pool", "concurrent.futures", "logging", "jaxtransport._os._segments")

    def never(x=None):
        return repr([m for m in NEVER if m in sys.modules])
    """
)

_START_SCRIPT = textwrap.dedent(
    """
    import multiprocessing.process, sys
    import numpy as np
    import jaxtransport as jt
    import start_tasks  # an importable module: its functions travel by name

    engine_loaded_at_start = []
    _start = multiprocessing.process.BaseProcess.start


    def script_loaded(x=None):  # the script's own function: it travels by its name in __main__
        return start_tasks.loaded(x)

    def recording_start(self):
        engine_loaded_at_start.append("jaxtransport.pool._engine" in sys.modules)
        _start(self)

    if __name__ == "__main__":
        multiprocessing.process.BaseProcess.start = recording_start
        with jt.Pool(2) as p:
            print("engine loaded at each start", engine_loaded_at_start)
            print("small", p.apply(start_tasks.loaded, (np.ones(10),)))
            print("small, the script's function", p.apply(script_loaded, (np.ones(10),)))
            print("never", p.map(start_tasks.never, range(2), chunksize=1))
            big = p.apply(np.ones, ((1 << 20,),))  # 8 MiB both ways: through shared memory
            print("large", p.apply(start_tasks.loaded, (big,)), float(big.sum()))
        print("worker code in the parent", "jaxtransport.pool._worker" in sys.modules)
    """
)


def test_pool_starts_workers_first_and_they_import_only_what_tasks_need(tmp_path):
    """Note [launch first]: Pool() starts its workers before it imports its engine (their start
    overlaps its imports), and the parent never imports the worker's code. A worker reads a task
    of an importable function with small numpy arguments and answers a scalar without the
    encoder (``_wire``, ``_usercode``, cloudpickle), nor one of a function of the main script
    (it travels by its name), never imports what only the parent's machinery needs
    (``multiprocessing.pool``, ``concurrent.futures``, ``logging``) nor the segments' module
    before it needs shared memory, and makes its shared-memory arena and mapper only once a
    task or result needs them."""
    import subprocess

    (tmp_path / "start_tasks.py").write_text(_START_TASKS)
    script = tmp_path / "start_script.py"
    script.write_text(_START_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    late = "['jaxtransport._wire', 'jaxtransport._usercode', 'cloudpickle', 'jaxtransport._shm._arena', "
    assert proc.stdout.splitlines() == [
        "engine loaded at each start [False, False]",
        "small []",
        "small, the script's function []",
        """never ['[]', '[]']""",
        f"large {late}'jaxtransport._shm._mapper'] {float(1 << 20)}",
        "worker code in the parent False",
    ], proc.stdout + proc.stderr[-2000:]


def jax_in_worker(_=None):
    return "jax" in sys.modules


def _worker_imported_jax(pool) -> bool:
    return pool.apply(jax_in_worker)


@pytest.mark.parametrize("preload", [None, False])
def test_workers_import_jax_in_the_background_when_the_parent_has_it(preload):
    import jax  # noqa: F401  (this test's parent has JAX loaded)

    with jt.Pool(1, preload_jax=preload) as p:
        if preload is None:  # default: the parent has JAX, so the worker imports it unasked
            assert wait_until(lambda: _worker_imported_jax(p), 60)
        else:
            time.sleep(1.0)  # time enough for a background import to have begun
            assert not _worker_imported_jax(p)
        assert p.apply(abs, (-2,)) == 2


def jax_import_begun(_=None):
    """(the background JAX import's thread exists, JAX is imported) in this worker."""
    import threading

    return any(t.name == "jaxtransport-jax-import" for t in threading.enumerate()), "jax" in sys.modules


def test_a_task_waiting_when_the_worker_gets_ready_runs_before_the_background_jax_import():
    """Note [JAX imported in the background]: a new pool's first call, already in the pipe when
    the worker is ready, runs without the import beside it; the import begins after it."""
    import jax  # noqa: F401  (this test's parent has JAX loaded: the workers preload it)

    with jt.Pool(1, initializer=time.sleep, initargs=(1.0,)) as p:  # the call waits in the pipe
        assert p.apply(jax_import_begun) == (False, False)
        assert wait_until(lambda: _worker_imported_jax(p), 60)


def _sum_and_echo(x):
    return int(x[::4096].astype(np.int64).sum()), np.full(x.nbytes, 9, np.uint8)


def test_pool_transfers_stay_exact_while_segments_grow_and_shrink():
    """Arguments and results of rising then falling sizes: segments are grown in place (the
    workers forget the old ids and map the new ones) and larger free slots are reused."""
    with jt.Pool(1) as p:
        for mib in (3, 5, 9, 17, 12, 7, 17):
            x = np.full(mib * MIB, mib, np.uint8)
            total, back = p.apply(_sum_and_echo, (x,))
            assert total == mib * len(range(0, x.nbytes, 4096))
            assert back.nbytes == x.nbytes and int(back[::4096].sum()) == 9 * len(range(0, x.nbytes, 4096))
            del back
        arena = p._state.arena
        assert arena.segments_grown >= 2
        assert arena.segments_created <= 2


def test_large_segment_populated_in_parts_has_every_page():
    size = 72 * MIB  # above the size populated by several threads
    fd, mm = _os.create_segment(size)
    try:
        assert allocated(fd) >= size
    finally:
        mm.close()
        os.close(fd)
    if _os.populate_method() != "madvise":
        return
    code = textwrap.dedent(
        """
        import mmap, os
        from jaxtransport import _os, _shm
        from jaxtransport._errors import ShmCapacityError
        n = 80 << 20
        fd = os.memfd_create("short", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        os.ftruncate(fd, n // 2)  # the second half of the mapping has no file behind it
        try:
            _os.populate(mm, 0, n)
        except ShmCapacityError as e:
            print("capacity error")
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0 and "capacity error" in proc.stdout, (proc.returncode, proc.stderr)
