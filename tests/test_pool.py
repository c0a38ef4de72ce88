"""jaxtransport.Pool: the multiprocessing.Pool API, cloudpickle, arrays both ways, tracers, env."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import pickle
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _os
from jaxtransport import _procenv as _pool_env
from jaxtransport._errors import PoolStateError, TransportError

from .conftest import huge_pages_kib, malloc_huge_pages_work, run_python

THRESH = 1 << 16  # small arrays still take the shared-memory path here


@pytest.fixture(scope="module")
def pool():
    p = jt.Pool(2, shm_threshold=THRESH)
    yield p
    p.close()
    p.join()


def square(x):
    return x * x


def worker_info(_=None):
    import os

    from jaxtransport.pool import _worker as _pool_worker

    w = _pool_worker.CURRENT
    return {
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES",
                                               "JT_TEST_VAR", "GLIBC_TUNABLES")},
        "segments_created": w.arena.segments_created,
    }


# --------------------------------------------------------------------------------------------
# the API


def test_apply_and_async_result(pool):
    assert pool.apply(square, (7,)) == 49
    assert pool.apply(lambda a, b=1: a + b, (1,), {"b": 5}) == 6
    r = pool.apply_async(time.sleep, (0.3,))
    assert not r.ready()
    with pytest.raises(ValueError):
        r.successful()
    with pytest.raises(multiprocessing.TimeoutError):
        r.get(timeout=0.01)
    r.wait()
    assert r.ready() and r.successful() and r.get() is None


def test_map_family(pool):
    assert pool.map(square, range(20)) == [i * i for i in range(20)]
    assert pool.map(square, range(20), chunksize=3) == [i * i for i in range(20)]
    assert pool.map(square, []) == []
    assert pool.map_async(square, range(5), 2).get(30) == [0, 1, 4, 9, 16]
    assert pool.starmap(lambda a, b: a - b, [(3, 1), (10, 4)]) == [2, 6]
    assert pool.starmap_async(pow, [(2, 3), (3, 2)], 1).get(30) == [8, 9]
    assert list(pool.imap(square, range(10))) == [i * i for i in range(10)]
    assert list(pool.imap(square, (i for i in range(10)), chunksize=3)) == [i * i for i in range(10)]
    assert sorted(pool.imap_unordered(square, range(10), 4)) == [i * i for i in range(10)]
    assert sorted(pool.imap_unordered(square, iter(range(7)))) == [i * i for i in range(7)]
    assert list(pool.imap(square, [])) == []
    it = pool.imap(time.sleep, [0.5])
    with pytest.raises(multiprocessing.TimeoutError):
        it.next(timeout=0.01)
    assert it.next(timeout=30) is None


def test_callbacks(pool):
    got, errs = [], []
    pool.apply_async(square, (3,), callback=got.append).get(30)
    pool.map_async(square, range(4), callback=got.append).get(30)
    r = pool.apply_async(lambda: 1 / 0, error_callback=errs.append)
    with pytest.raises(ZeroDivisionError):
        r.get(30)
    assert got == [9, [0, 1, 4, 9]]
    assert len(errs) == 1 and isinstance(errs[0], ZeroDivisionError)
    assert not r.successful()


def test_lambdas_closures_and_exceptions_with_remote_traceback(pool):
    k = 10
    assert pool.map(lambda x: x + k, [1, 2]) == [11, 12]

    def failing(x):
        raise KeyError(f"bad {x}")

    with pytest.raises(KeyError) as info:
        pool.map(failing, [1, 2, 3])
    cause = info.value.__cause__
    assert type(cause).__name__ == "RemoteTraceback" and "failing" in str(cause) and "KeyError" in str(cause)
    it = pool.imap(lambda x: 1 // (x - 2), range(4))
    assert next(it) == -1 and next(it) == -1
    with pytest.raises(ZeroDivisionError):
        next(it)
    assert next(it) == 1


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("nope")
        self.lock = __import__("threading").Lock()


def test_unpicklable_exception_and_result(pool):
    def raise_it():
        raise Unpicklable()

    with pytest.raises(TransportError, match="Unpicklable"):
        pool.apply(raise_it)
    # An unpicklable result fails as in multiprocessing.Pool (MaybeEncodingError naming it).
    with pytest.raises(multiprocessing.pool.MaybeEncodingError, match="lock"):
        pool.apply(lambda: __import__("threading").Lock())
    assert pool.apply(square, (2,)) == 4  # the pool is fine


def test_unpicklable_argument_raises_in_caller(pool):
    import threading

    with pytest.raises(TypeError):
        pool.apply(square, (threading.Lock(),))
    assert pool.apply(square, (3,)) == 9


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_burst_on_a_busy_pool_is_sent_by_the_manager_and_nothing_is_lost(start_method):
    # Note [one task on a busy pool] (pool/_engine.py): once a task runs, a tiny apply_async
    # is queued and the manager thread sends what is queued, per worker in one write; the
    # calling threads write to no worker. Four threads burst at once; every result is exact.
    import threading

    with jt.Pool(3, start_method=start_method) as p:
        long = p.apply_async(time.sleep, (20.0,))  # sent by the caller: the pool was idle
        engine = p._state
        writers: set = set()
        for w in engine.workers:
            post = w.sender.post

            def counted(payload, segments=(), post=post):
                writers.add(threading.current_thread().name)
                return post(payload, segments)

            w.sender.post = counted
        results: dict = {}

        def burst(t):
            results[t] = [p.apply_async(square, (t * 1000 + k,)) for k in range(500)]

        threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t, rs in results.items():
            assert [r.get(60) for r in rs] == [(t * 1000 + k) ** 2 for k in range(500)]
        assert not long.ready()  # busy all along
        assert writers == {"jaxtransport-pool-manager"}
        p.terminate()
    # close() right after a burst: the manager still sends what is queued; join() waits for it
    with jt.Pool(2, start_method=start_method) as p:
        p.apply(square, (1,))
        rs = [p.apply_async(square, (k,)) for k in range(2000)]
        p.close()
        p.join()
        assert [r.get(0) for r in rs] == [k * k for k in range(2000)]


def test_main_module_code_under_spawn():
    code = """
import jax.numpy as jnp, jaxtransport as jt
SCALE = 3
def scaled(x):
    return x * SCALE
if __name__ == "__main__":
    with jt.Pool(1, shm_threshold=1024) as p:
        print(p.map(scaled, [1, 2]), float(p.apply(lambda a: scaled(a).sum(), (jnp.ones(4096),))))
"""
    out = run_python(code, env={"JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "[3, 6] 12288.0" in out.stdout


# --------------------------------------------------------------------------------------------
# arrays


def describe(tree):
    import jax

    from jaxtransport.pool import _worker as _pool_worker

    w = _pool_worker.CURRENT
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, (np.ndarray, jax.Array)):
            ptr = leaf.unsafe_buffer_pointer() if isinstance(leaf, jax.Array) else leaf.ctypes.data
            shared = w.mapper.find(ptr, leaf.nbytes) is not None
            out.append((type(leaf).__name__, str(leaf.dtype), leaf.shape, getattr(leaf, "weak_type", None), shared))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "uint16"])
def test_jax_arrays_both_ways_bit_exact(pool, dtype):
    n = THRESH * 2
    x = (jnp.arange(n) % 7).astype(dtype)
    tree = {"params": {"w": x, "b": jnp.ones(3, dtype)}, "n": np.arange(n, dtype=np.int16)}
    desc = pool.apply(describe, (tree,))
    # leaves in key order: n, params.b, params.w
    shared = not _os.in_band()  # in-band (no fd passing) every array is inside the pickle
    assert desc[0][:3] == ("ndarray", "int16", (n,)) and desc[0][4] is shared  # numpy: shared memory
    assert desc[1][:3] == ("ArrayImpl", dtype, (3,)) and desc[1][4] is False  # small: inline
    assert desc[2][:3] == ("ArrayImpl", dtype, (n,)) and desc[2][4] is shared  # zero-copy alias
    back = pool.apply(lambda t: t, (tree,))
    assert back["params"]["w"].dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]).view(np.uint8), np.asarray(x).view(np.uint8))
    np.testing.assert_array_equal(back["n"], tree["n"])


def test_weak_type_prng_keys_and_scalars(pool):
    w = jnp.full((THRESH,), 2.0)  # weak-typed: built from a Python scalar
    s = jnp.asarray(0.5)  # a weak scalar (below the shared-memory threshold: pickled inline)
    assert w.weak_type and s.weak_type
    key = jax.random.split(jax.random.key(1), THRESH // 4)
    out = pool.apply(lambda a, k, b: (a, k, jax.random.key_data(k).shape, b, b * 2, a + 1), (w, key, s))
    assert out[0].weak_type and out[0].dtype == w.dtype  # arguments and results stay weak
    assert out[3].weak_type and out[4].weak_type and out[5].weak_type
    np.testing.assert_array_equal(out[5], np.full(THRESH, 3.0, np.float32))
    assert jax.dtypes.issubdtype(out[1].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out[1]), jax.random.key_data(key))
    assert out[2] == (THRESH // 4, 2)


@pytest.mark.shm
def test_numpy_arguments_are_writeable_and_results_alias_shared_memory(pool):
    a = np.arange(THRESH, dtype=np.float64).reshape(-1, 8)

    def bump(x):
        x += 1  # a private, writeable copy
        return x

    out = pool.apply(bump, (a,))
    np.testing.assert_array_equal(out, a + 1)
    assert a[0, 0] == 0
    f = np.asfortranarray(a)
    np.testing.assert_array_equal(pool.apply(lambda x: x, (f,)), a)
    big = pool.apply(lambda: jnp.full((THRESH,), 3, jnp.int32))
    state = pool._state
    assert any(w.mapper.find(big.unsafe_buffer_pointer(), big.nbytes) for w in state.workers)
    assert int(big.sum()) == 3 * THRESH


def test_placement_host():
    with jt.Pool(1, shm_threshold=1024, placement="host") as p:
        out = p.apply(lambda a: (type(a).__name__, a * 2), (jnp.ones(4096, jnp.float32),))
    assert out[0] == "ndarray" and isinstance(out[1], np.ndarray)
    np.testing.assert_array_equal(out[1], 2)


def test_ml_dtypes_numpy_round_trip(pool):
    a = np.arange(THRESH, dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = pool.apply(lambda x: x, (a,))
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out.view(np.uint16), a.view(np.uint16))


# --------------------------------------------------------------------------------------------
# tracers fail fast


def test_tracer_fails_fast_with_path_before_any_shared_memory(pool):
    state = pool._state
    before = (state.arena.segments_created, state.arena.in_use(), next(state.chunk_ids))
    big = jnp.ones(THRESH)

    @jax.jit
    def traced(w):
        return pool.apply(square, ({"big": big}, {"params": {"w": w}}))

    with pytest.raises(jt.TracerTransportError) as info:
        traced(jnp.ones(3))
    assert info.value.path == "args[1]['params']['w']"
    assert isinstance(info.value, jax.errors.ConcretizationTypeError)

    with pytest.raises(jt.TracerTransportError) as info:
        jax.jit(lambda w: pool.map(square, [big, big, {"x": [w]}]))(jnp.ones(3))
    assert info.value.path == "iterable[2]['x'][0]"
    with pytest.raises(jt.TracerTransportError) as info:
        jax.jit(lambda w: pool.apply(lambda: w + 1))(jnp.ones(3))
    assert info.value.path.startswith("func")
    with pytest.raises(jt.TracerTransportError) as info:
        jax.jit(lambda w: pool.share({"a": big, "b": w}))(jnp.ones(3))
    assert info.value.path == "tree['b']"
    after = (state.arena.segments_created, state.arena.in_use(), next(state.chunk_ids))
    assert after[0] == before[0] and after[1] <= before[1]  # no slot was taken
    assert after[2] == before[2] + 1  # no task was created in between
    assert pool.apply(square, (3,)) == 9


# --------------------------------------------------------------------------------------------
# construction and environment


def test_fork_is_refused_and_arguments_validated():
    with pytest.raises(ValueError, match=r"fork.*deadlock"):
        jt.Pool(1, start_method="fork")
    with pytest.raises(ValueError):
        jt.Pool(0)
    with pytest.raises(ValueError):
        jt.Pool(1, maxtasksperchild=0)
    with pytest.raises(jt.PlacementError):
        jt.Pool(1, placement="gpu")
    with pytest.raises(ValueError):
        jt.Pool(1, shm_threshold=-1)


def test_worker_env_defaults_and_overrides(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    with jt.Pool(1, worker_env={"JT_TEST_VAR": "yes", "CUDA_VISIBLE_DEVICES": "7"}) as p:
        env = p.apply(worker_info)["env"]
    assert env == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "7",
        "JT_TEST_VAR": "yes",
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1",  # the parent's kept
    }
    assert "JT_TEST_VAR" not in os.environ
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    with jt.Pool(1, worker_env={"GLIBC_TUNABLES": None}) as p:  # opting out
        assert p.apply(worker_info)["env"]["GLIBC_TUNABLES"] is None


def test_malloc_huge_pages_tunable():
    assert _pool_env.malloc_huge_pages(None) == "glibc.malloc.hugetlb=1"
    assert _pool_env.malloc_huge_pages("") == "glibc.malloc.hugetlb=1"
    assert _pool_env.malloc_huge_pages("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # a user's own hugetlb setting (0 = off, 2 = hugetlbfs pages) is kept, and it is idempotent
    assert _pool_env.malloc_huge_pages("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"
    once = _pool_env.malloc_huge_pages("a.b=1")
    assert _pool_env.malloc_huge_pages(once) == once


def _buffer_huge_kib(nbytes):
    from .conftest import huge_pages_kib

    x = jnp.ones(nbytes // 4, jnp.float32).block_until_ready()
    return huge_pages_kib(x.unsafe_buffer_pointer())


def test_worker_jax_buffers_get_huge_pages():
    """What the tunable is for: a worker's large JAX buffers are backed by transparent huge pages
    (like numpy's), so copying results out of them into shared memory takes fewer TLB misses."""
    why = malloc_huge_pages_work()
    if why:
        pytest.skip(why)
    with jt.Pool(1) as p:
        assert p.apply(_buffer_huge_kib, (64 << 20,)) > 0
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        madvise_mode = "[madvise]" in f.read()
    if madvise_mode:  # ("always" gives every process huge pages, tunable or not)
        with jt.Pool(1, worker_env={"GLIBC_TUNABLES": None}) as p:
            assert p.apply(_buffer_huge_kib, (64 << 20,)) == 0


_GPU_ENV_CODE = """
import json
from jaxtransport import _devices, _procenv


def gpus(n):
    class Host(_devices.Gpu):  # a host with n NVIDIA GPUs
        def host_count(self):
            return n

    return (Host(),)


def worker_env(i, per, workers, overrides=None, n=4):
    plan = _devices.plan(workers, devices_per_worker=per, overrides=overrides, kinds=gpus(n))
    return _procenv.worker_env(i, devices=plan, overrides=overrides)


out = {
    "one_each": [worker_env(i, None, 5).get("CUDA_VISIBLE_DEVICES") for i in range(5)],
    "two_each": [worker_env(i, 2, 3).get("CUDA_VISIBLE_DEVICES") for i in range(3)],
    "single": worker_env(0, None, 1, overrides={"XLA_PYTHON_CLIENT_PREALLOCATE": None}, n=1),
}
print(json.dumps(out))
"""


@pytest.mark.parametrize("platforms", ["", "cuda", "cuda,cpu", "cpu"])
def test_round_robin_gpu_assignment(platforms):
    """GPUs go round robin to workers unless JAX_PLATFORMS pins JAX to the CPU (then no
    CUDA_VISIBLE_DEVICES is set). Runs in a fresh interpreter with JAX_PLATFORMS set as given
    ("" = unset), so the answer does not depend on what this test process was started with."""
    import json

    proc = run_python(_GPU_ENV_CODE, env={"JAX_PLATFORMS": platforms})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if platforms == "cpu":
        assert out["one_each"] == [None] * 5 and out["two_each"] == [None] * 3
    else:
        assert out["one_each"] == ["0", "1", "2", "3", "0"]
        assert out["two_each"] == ["0,1", "2,3", "0,1"]
    one = out["single"]
    assert "CUDA_VISIBLE_DEVICES" not in one and one["XLA_PYTHON_CLIENT_PREALLOCATE"] is None


def test_forkserver_initializer_and_maxtasksperchild():
    def init(v):
        import os

        os.environ["JT_TEST_VAR"] = v

    with jt.Pool(1, init, ("set",), maxtasksperchild=2, start_method="forkserver", shm_threshold=1024) as p:
        infos = [p.apply(worker_info) for _ in range(4)]
        assert all(i["env"]["JT_TEST_VAR"] == "set" for i in infos)
        pids = [i["pid"] for i in infos]
        assert pids[0] == pids[1] and pids[2] == pids[3] and pids[1] != pids[2]
        assert float(p.apply(lambda a: a.sum(), (jnp.ones(4096),))) == 4096.0


def test_initializer_failure_breaks_pool_without_hanging():
    def bad_init():
        raise RuntimeError("no GPU here")

    p = jt.Pool(1, bad_init)
    try:
        r = p.apply_async(square, (2,))
        with pytest.raises(PoolStateError, match="initializer raised RuntimeError"):
            r.get(60)
        with pytest.raises(PoolStateError, match="broken"):
            p.apply(square, (2,))
    finally:
        p.terminate()


def test_closed_pool_refuses_work():
    p = jt.Pool(1)
    p.close()
    with pytest.raises(PoolStateError):
        p.apply(square, (1,))
    with pytest.raises(ValueError):  # as multiprocessing: "Pool not running"
        p.map(square, [1])
    p.join()
    q = jt.Pool(1)
    with pytest.raises(ValueError, match="close"):
        q.join()
    q.terminate()
    q.join()


def test_import_has_no_side_effects():
    out = run_python(
        "import sys, threading, atexit, jaxtransport as jt\n"
        "import multiprocessing as mp\n"
        "assert mp.active_children() == [] and threading.active_count() == 1\n"
        "assert 'ray' not in sys.modules\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
        "print('ok', atexit._ncallbacks())\n"
    )
    assert out.returncode == 0, out.stderr


def test_closures_are_not_cached_across_calls(pool):
    k = 1
    f = lambda x: x + k  # noqa: E731
    assert pool.map(f, range(4), chunksize=1) == [1, 2, 3, 4]
    k = 10
    assert pool.map(f, range(4), chunksize=1) == [10, 11, 12, 13]
    assert pool.apply(f, (0,)) == 10


def test_many_threads_submitting_at_once(pool):
    import threading

    out = {}

    def client(i):
        x = jnp.full((THRESH,), i, jnp.float32)
        out[i] = [float(pool.apply(lambda a: a.sum(), (x,))) for _ in range(3)]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {i: [float(i * THRESH)] * 3 for i in range(4)}


def test_sharded_arrays_keep_their_sharding_with_preserve():
    code = """
import jax, jax.numpy as jnp, numpy as np, jaxtransport as jt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
def info(a):
    return str(a.sharding.spec), len(a.sharding.device_set), float(a.sum()), a
if __name__ == "__main__":
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    x = jax.device_put(jnp.arange(1 << 18, dtype=jnp.float32).reshape(512, 512), NamedSharding(mesh, P("x", "y")))
    with jt.Pool(1, shm_threshold=1024, placement="preserve") as p:
        spec, ndev, total, back = p.apply(info, (x,))
    assert spec in ("P('x', 'y')", "PartitionSpec('x', 'y')") and ndev == 4, (spec, ndev)
    assert total == float(x.sum())
    assert back.sharding == x.sharding and bool((back == x).all())
    print("ok")
"""
    out = run_python(code, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


def test_parent_x64_setting_reaches_workers():
    code = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, jaxtransport as jt
if __name__ == "__main__":
    with jt.Pool(1, shm_threshold=1024) as p:
        out = p.apply(lambda a: (str(a.dtype), a * 2), (jnp.arange(4096, dtype=jnp.float64),))
    assert out[0] == "float64" and out[1].dtype == jnp.float64, out[0]
    print("ok")
"""
    out = run_python(code, env={"JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


def test_main_module_references_are_found_in_any_pickle():
    """The check that sends code referring to ``__main__`` by value (fast path: led by memchr)."""
    from jaxtransport._wire import _mentions_main

    assert _mentions_main(b"xx__main__yy") and _mentions_main(b"\x8c\x0b__mp_main__\x94")
    assert not _mentions_main(b"") and not _mentions_main(b"_main_") and not _mentions_main(b"__mai__n")
    assert _mentions_main(b"_" * 1000 + b"__main__")  # past the memchr-led loop's budget
    assert not _mentions_main(b"_" * 1000) and not _mentions_main(b"_a" * 100 + b"main__")
    assert not _mentions_main(pickle.dumps(np.ones(1000), 5))
    assert _mentions_main(pickle.dumps(np.ones(1000), 5) + b"__main__")


def _chunk_pickles_equal(fn, mode, parts, threshold=None):
    """``prepare_calls`` (one head, many chunks) against pickling each whole chunk."""
    from jaxtransport import _wire

    got = _wire.prepare_calls(fn, mode, parts, threshold=threshold)
    assert len(got) == len(parts)
    for prep, items in zip(got, parts):
        # A chunk with nothing set aside is its pickle alone (bytes); the others are Prepared.
        data, found = (prep, []) if type(prep) is bytes else (prep.data, prep.found)
        _wire._decoding.resolved = [obj for _kind, obj in found]  # what _entry(k) reads
        try:
            f, m, back = pickle.loads(data)
        finally:
            del _wire._decoding.resolved
        assert m == mode
        assert pickle.dumps(back, 5) == pickle.dumps(items, 5)  # same values, same sharing
        yield f, back, prep


def test_map_chunks_share_one_pickled_head_and_read_back_the_same():
    """Note [one head, many chunks]: each chunk's pickle is the function's opcodes once, then its
    items'; memo references inside the items (the same list twice), arrays set aside for shared
    memory, items larger than one pickle frame and a function that is not a plain name all read
    back as pickling the whole chunk would."""
    from jaxtransport import _wire

    shared = [1, 2]
    big = np.arange(1 << 15, dtype=np.float64)  # 256 KiB: over the threshold below
    parts = [
        [1],
        [2.5, "x", None],
        [shared, shared],
        [{"k": (1, 2)}, {1: shared}],
        [np.arange(5)],
        [b"z" * 70_000],  # over one frame: the whole chunk is pickled
        (1, 2),
        [big, big],
    ]
    assert _wire._call_head(square, "map", None, 1 << 16) is not None
    backs = [back for f, back, _prep in _chunk_pickles_equal(square, "map", parts, threshold=1 << 16) if f is square]
    assert len(backs) == len(parts)
    assert backs[2][0] is backs[2][1] and backs[-1][0] is backs[-1][1]  # memo references kept
    preps = _wire.prepare_calls(square, "map", parts, threshold=1 << 16)
    assert [type(p) is bytes for p in preps] == [True] * (len(parts) - 1) + [False]
    found = preps[-1].found
    assert len(found) == 1 and found[0][1] is big  # set aside once, named twice
    # A function whose pickle reads its own memo (a partial of one object twice) is pickled
    # with each chunk; the chunks still read back.
    import functools

    twice = functools.partial(max, shared, shared)
    assert _wire._call_head(twice, "map", None, 1 << 62) is None
    for f, _back, _prep in _chunk_pickles_equal(twice, "map", [[1], [2]]):
        assert f() == shared


def test_map_of_a_range_and_of_mixed_items_matches_the_stock_pool(pool):
    """A range is read into a list before it is cut into chunks (a chunk of it is a list, as
    multiprocessing's are tuples); the answers are the stock pool's."""
    items = [1, 2.5, "ab", (1, 2), [3, [4]], {"k": 5}, None, b"xy" * 40_000]
    with multiprocessing.get_context("spawn").Pool(2) as stock:
        for iterable, cs in ((range(50), 1), (range(7, 90, 3), 4), (items, 1), (items, 3), (tuple(items), 2)):
            want = stock.map(repr, iterable, chunksize=cs)
            assert pool.map(repr, iterable, chunksize=cs) == want
            assert list(pool.imap(repr, iterable, chunksize=cs)) == want


def _sleep_ms(x):
    time.sleep(0.002)
    return x


def test_a_long_map_keeps_only_its_chunks_in_flight_as_objects():
    """Note [few objects per waiting chunk]: a map of thousands of small chunks does not hold a
    Chunk (an object the garbage collector tracks) per chunk while they wait, only for those
    handed out; its answers are complete and in order."""
    import gc

    from jaxtransport.pool._scheduler import Chunk

    with jt.Pool(1) as p:
        r = p.map_async(_sleep_ms, range(3000), chunksize=1)
        time.sleep(0.3)
        alive = sum(1 for o in gc.get_objects() if type(o) is Chunk)
        assert 0 < alive < 100, alive
        assert r.get(timeout=60) == list(range(3000))
