"""jaxtransport.multiprocessing: queues and pipes through shared memory, per start method, with
leak checks (/dev/shm and child processes by the conftest fixture, fds here) and dead, stopped
and garbage-sending peers."""

from __future__ import annotations

import os
import queue
import signal
import socket
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxtransport as jt
import jaxtransport.multiprocessing as jmp
from jaxtransport import _os

from .conftest import is_segment, memfd_mapped, run_python, wait_until

METHODS = [m for m in ("spawn", "forkserver") if m in jmp.get_all_start_methods()]
THRESH = 1 << 12  # small arrays still take the shared-memory path here


def open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


@pytest.fixture
def no_fd_leak():
    import gc

    before = open_fds()
    yield
    gc.collect()
    extra: set[int] = set()

    def settled():
        nonlocal extra
        gc.collect()
        extra = {fd for fd in open_fds() - before if not _is_service_fd(fd)}
        return not extra

    assert wait_until(settled, 10), f"fds left open: {[_describe(fd) for fd in sorted(extra)]}"


def _describe(fd: int) -> str:
    try:
        return f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return str(fd)


def _is_service_fd(fd: int) -> bool:
    # multiprocessing keeps one connection to its resource tracker and forkserver for the
    # whole session (by design). Shared-memory segments (memfds) are cached by design: CPython's
    # mmap keeps one fd per mapping, so each segment this process sends from or has mapped holds
    # one or two fds for the process's life; test_a_hundred_thousand_arrays_never_exhaust_fds
    # checks that this stays bounded.
    try:
        if is_segment(os.readlink(f"/proc/self/fd/{fd}")):
            return True
    except OSError:
        return True
    try:
        from multiprocessing import forkserver, resource_tracker

        keep = {getattr(resource_tracker._resource_tracker, "_fd", None),
                getattr(forkserver._forkserver, "_forkserver_alive_fd", None)}
    except Exception:
        keep = set()
    return fd in keep


# --------------------------------------------------------------------------------------------
# child processes (module level: spawned children import them)


def echo(q_in, q_out):
    while True:
        item = q_in.get(timeout=60)
        if item is None:
            return
        q_out.put(item)


def echo_pipe(conn):
    while True:
        item = conn.recv()
        if item is None:
            conn.close()
            return
        conn.send(item)


def hold_then_wait(q_in, q_out, n):
    held = [q_in.get(timeout=60) for _ in range(n)]
    q_out.put(sum(int(np.asarray(h).reshape(-1)[0]) for h in held))
    time.sleep(120)


def produce_then_wait(q, done, n, nbytes):
    for i in range(n):
        q.put(np.full(nbytes, i, np.uint8))
    q.close()
    q.join_thread()  # every message is in the queue's socket now
    done.put(True)
    time.sleep(120)


def consume_count(q, out, n_messages, nofile):
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    total = count = 0
    for _ in range(n_messages):
        msg = q.get(timeout=60)
        for a in msg:
            total += int(a[0])
            count += 1
        del msg, a
    out.put((count, total, len(os.listdir("/proc/self/fd"))))


def send_garbage(conn):
    fd_to_send = os.open("/", os.O_RDONLY)
    raw = socket.socket(fileno=os.dup(conn.fileno()))
    raw.send(b"not a jaxtransport message")
    raw.sendmsg([b"\x80\x05garbage with an fd"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     np.array([fd_to_send], np.int32).tobytes())])
    raw.close()
    conn.send(np.arange(5000, dtype=np.int64))
    conn.close()


def joinable_worker(q, out):
    while True:
        item = q.get(timeout=60)
        try:
            if item is None:
                return
            out.put(float(np.asarray(item).sum()))
        finally:
            q.task_done()


def make_echo(ctx, **kw):
    q_in, q_out = ctx.Queue(**kw), ctx.Queue(**kw)
    p = ctx.Process(target=echo, args=(q_in, q_out), daemon=True)
    p.start()
    return p, q_in, q_out


def stop(p, q_in=None):
    if q_in is not None:
        q_in.put(None)
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join(5)
    assert p.exitcode is not None


# --------------------------------------------------------------------------------------------
# the API and faithfulness


def payload():
    key = jax.random.key(7)
    return {
        "f32": jnp.arange(4096, dtype=jnp.float32) / 3,
        "bf16": jnp.linspace(-2, 2, 4096, dtype=jnp.bfloat16),
        "i8": jnp.arange(8192, dtype=jnp.int8),
        "bool": jnp.arange(5000) % 3 == 0,
        "c64": (jnp.arange(1024) * (1 + 2j)).astype(jnp.complex64),
        "weak": jnp.zeros(2048) + 1.5,  # weak_type=True, large
        "weak_small": jnp.asarray(3.0),
        "key": jax.random.split(key, 1024),
        "raw_key": jax.random.PRNGKey(3),
        "np": np.arange(10_000, dtype=np.float64).reshape(100, 100),
        "np_f8": np.arange(5000).astype(ml_dtypes.float8_e4m3fn),
        "noncontig": np.arange(20_000, dtype=np.int32).reshape(100, 200)[:, ::2],
        "tuple": (1, "two", None),
    }


def check_same(a, b):
    ja, jb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(ja) == len(jb)
    for x, y in zip(ja, jb):
        assert type(x) is type(y)
        if isinstance(x, jax.Array):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert getattr(x, "weak_type", None) == getattr(y, "weak_type", None)
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert str(jax.random.key_impl(x)) == str(jax.random.key_impl(y))
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
        else:
            assert x == y


@pytest.mark.parametrize("method", METHODS)
def test_queue_round_trip_is_faithful_and_aliases_shared_memory(method, no_fd_leak):
    ctx = jmp.get_context(method)
    p, q_in, q_out = make_echo(ctx, shm_threshold=THRESH)
    try:
        sent = payload()
        q_in.put(sent)
        got = q_out.get(timeout=60)
        check_same(sent, got)
        # Large arrays came back through the child's shared memory and alias it, jax arrays
        # read-only, numpy writeable; small ones inline.
        shared = not _os.in_band()  # in-band (no fd passing) every array is inside the pickle
        assert memfd_mapped(got["f32"].unsafe_buffer_pointer()) is shared
        assert memfd_mapped(got["np"].__array_interface__["data"][0]) is shared
        assert not memfd_mapped(got["weak_small"].unsafe_buffer_pointer())
        got["np"][0, 0] = -1.0  # writeable, private to this message
        assert sent["np"][0, 0] == 0.0
        del got
        # Recycling: the same sizes many times reuse the same memory on both sides.
        for i in range(30):
            q_in.put(np.full(1 << 16, i, np.int32))
            assert int(q_out.get(timeout=60)[0]) == i
    finally:
        stop(p, q_in)
        q_in.close(), q_out.close()


def echo_bytes(conn):
    """CPython's test_multiprocessing echo child: answer each recv_bytes with send_bytes."""
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg == b"STOP":
            conn.close()
            return
        conn.send_bytes(msg)


# Bytes that are no pickle, or a damaged one: recv() raises what pickle.loads raises for them.
GARBAGE = [b"garbage", b"", b"\x80\x05", b"\x80\x05\x95\x10\x00\x00\x00\x00\x00\x00\x00N", b"\x80\x05K\x01",
           b"\x80\x05cno_such_module\nthing\n."]


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001
        return ("raised", type(e), str(e))


@pytest.mark.parametrize("method", METHODS)
def test_recv_and_recv_bytes_after_an_echo_as_the_stock_module(method, no_fd_leak):
    # send(obj) -> an echo child's send_bytes(recv_bytes()) -> recv() gives obj back, and
    # pickle.loads(recv_bytes()) too; recv() of bytes that are no pickle raises as the stock
    # Connection does (CPython's test_connection). Compared with multiprocessing's own pipes.
    import multiprocessing
    import pickle

    small = {"seq": [1, 2.25, None], "text": "x" * 50_000, "jax": jnp.arange(8, dtype=jnp.int8),
             "np": np.arange(6.0)}  # a pickle larger than a packet: it travels in a slot
    outcomes = {}
    for ctx, kw in ((multiprocessing.get_context(method), {}), (jmp.get_context(method), {"shm_threshold": THRESH})):
        a, b = ctx.Pipe(**kw)
        p = ctx.Process(target=echo_bytes, args=(b,), daemon=True)
        p.start()
        b.close()
        try:
            a.send(small)
            got = pickle.loads(a.recv_bytes())
            assert got["seq"] == small["seq"] and got["text"] == small["text"]
            np.testing.assert_array_equal(np.asarray(got["jax"]), np.arange(8, dtype=np.int8))
            np.testing.assert_array_equal(got["np"], small["np"])
            a.send(small)
            got = a.recv()
            assert got["seq"] == small["seq"] and got["text"] == small["text"]
            np.testing.assert_array_equal(got["np"], small["np"])
            for obj in ([1, 2.25, None], 7, None, b"bytes"):
                a.send(obj)
                assert a.recv() == obj
            a.send_bytes(b"raw")
            assert a.recv_bytes() == b"raw"
            outcomes[ctx.__module__.split(".")[0]] = [
                (a.send_bytes(junk), _outcome(a.recv))[1] for junk in GARBAGE
            ]
            a.send("after")  # the pipe goes on after garbage
            assert a.recv() == "after"
            a.send_bytes(b"STOP")
            p.join(60)
            assert p.exitcode == 0
        finally:
            if p.is_alive():
                p.kill()
                p.join(10)
            p.close()
            a.close()
    assert outcomes["jaxtransport"] == outcomes["multiprocessing"]
    assert all(o[0] == "raised" for o in outcomes["jaxtransport"])
    assert outcomes["jaxtransport"][0][1] is pickle.UnpicklingError
    assert outcomes["jaxtransport"][1][1] is EOFError


@pytest.mark.parametrize("method", METHODS)
def test_arrays_in_shared_memory_echoed_as_bytes_come_back_faithfully(method, no_fd_leak):
    # A send() whose arrays travel in shared memory: recv_bytes() copies them into the bytes
    # (and gives the slots back at once), so an echo child that only moves bytes hands back
    # the same arrays: dtypes, weak types, PRNG keys, bit for bit.
    import pickle

    from jaxtransport.multiprocessing import _sharing

    ctx = jmp.get_context(method)
    a, b = ctx.Pipe(shm_threshold=THRESH)
    p = ctx.Process(target=echo_bytes, args=(b,), daemon=True)
    p.start()
    b.close()
    try:
        prod = _sharing.producer()
        prod.reap()
        before = prod.held()[0]  # earlier tests' messages may still be held
        sent = payload()
        a.send(sent)
        check_same(sent, a.recv())
        a.send(sent)
        check_same(sent, pickle.loads(a.recv_bytes()))
        big = np.arange(1 << 22, dtype=np.float32)  # 16 MiB
        a.send({"big": big, "jax": jnp.asarray(big[: 1 << 20])})
        got = a.recv()
        assert got["big"].tobytes() == big.tobytes() and got["big"].flags.writeable
        assert np.asarray(got["jax"]).tobytes() == big[: 1 << 20].tobytes()
        del got
        # This process's slots went back as soon as the child read them as bytes.
        assert wait_until(lambda: (prod.reap(), prod.held()[0] <= before)[1], 10), (before, prod.held())
        a.send_bytes(b"STOP")
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
        p.close()
        a.close()


@pytest.mark.parametrize("method", METHODS)
def test_pipe_round_trip(method, no_fd_leak):
    import pickle

    ctx = jmp.get_context(method)
    a, b = ctx.Pipe(shm_threshold=THRESH)
    p = ctx.Process(target=echo_pipe, args=(b,), daemon=True)
    p.start()
    b.close()
    try:
        sent = payload()
        a.send(sent)
        check_same(sent, a.recv())
        # A send_bytes() message larger than a packet (it travels in a slot); the child's recv()
        # unpickles it, as the stock module's does.
        a.send_bytes(pickle.dumps(b"x" * 100_000))
        assert a.recv() == b"x" * 100_000
        big = [np.arange(i, i + 100) for i in range(2000)]  # small arrays, large pickle
        a.send(big)
        assert all((x == y).all() for x, y in zip(big, a.recv()))
        assert a.poll(0) is False
        a.send(None)
        with pytest.raises(EOFError):
            a.recv()  # the child closed its end and exited
    finally:
        stop(p)
        a.close()


def test_one_way_pipe_and_bytes(no_fd_leak):
    r, w = jmp.Pipe(duplex=False)
    assert r.readable and not r.writable and w.writable and not w.readable
    w.send_bytes(b"abcdef", 1, 3)
    assert r.poll(5)
    assert r.recv_bytes() == b"bcd"
    w.send_bytes(b"hello")
    buf = bytearray(10)
    assert r.recv_bytes_into(buf, 2) == 5 and bytes(buf[2:7]) == b"hello"
    with pytest.raises(OSError, match="read-only"):
        r.send(1)
    w.close()
    with pytest.raises(EOFError):
        r.recv()
    r.close()
    assert r.closed


def test_queue_api_in_one_process(no_fd_leak):
    q = jmp.Queue(2, shm_threshold=THRESH)
    assert q.empty() and q.qsize() == 0
    x = jnp.arange(10_000.0)
    q.put(x)
    q.put_nowait({"y": np.ones(5000)})
    assert q.full()
    with pytest.raises(queue.Full):
        q.put(1, timeout=0.1)
    assert wait_until(lambda: not q.empty(), 5)
    y = q.get(timeout=5)
    assert (np.asarray(y) == np.asarray(x)).all()
    assert q.get_nowait()["y"].sum() == 5000
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.close()
    q.join_thread()
    with pytest.raises(ValueError, match="closed"):
        q.put(1)


@pytest.mark.parametrize("method", METHODS)
def test_joinable_and_simple_queue(method, no_fd_leak):
    ctx = jmp.get_context(method)
    q, out = ctx.JoinableQueue(shm_threshold=THRESH), ctx.SimpleQueue(shm_threshold=THRESH)
    p = ctx.Process(target=joinable_worker, args=(q, out), daemon=True)
    p.start()
    try:
        for i in range(5):
            q.put(jnp.full(4096, i, jnp.float32))
        q.join()  # every item was task_done()
        assert sorted(out.get() for _ in range(5)) == [4096.0 * i for i in range(5)]
        assert out.empty()
    finally:
        q.put(None)
        stop(p)
        q.close(), out.close()
    with pytest.raises(ValueError, match="too many"):
        jmp.JoinableQueue().task_done()


def test_tracer_raises_in_the_caller_with_its_path(no_fd_leak):
    q = jmp.Queue()
    a, b = jmp.Pipe()

    def f(x):
        with pytest.raises(jt.TracerTransportError) as e:
            q.put({"params": [np.ones(3), x]})
        assert "obj['params'][1]" in str(e.value) and e.value.path == "obj['params'][1]"
        with pytest.raises(jt.TracerTransportError, match=r"obj\[0\]"):
            a.send((x, 1))
        return x

    jax.jit(f)(jnp.ones(2))
    jax.grad(lambda x: (f(x) ** 2).sum())(jnp.ones(2))
    assert q.empty() and not b.poll(0.1)  # nothing was queued
    q.close(), a.close(), b.close()


def test_fork_is_refused_with_the_pool_explanation():
    for call in (lambda: jmp.get_context("fork"), lambda: jmp.set_start_method("fork")):
        with pytest.raises(ValueError, match=r"refuses method='fork'.*fork\(\) does not copy"):
            call()
    with pytest.raises(ValueError, match="start_method='fork'"):
        jt.Pool(1, start_method="fork")
    with pytest.raises(ValueError, match="spawn"):
        jmp.get_context("threads")
    assert jmp.get_start_method() == "spawn"
    assert jmp.get_context().get_start_method() == "spawn"


def test_passthrough_names():
    ctx = jmp.get_context("spawn")
    import multiprocessing

    # The standard Process, whose children are told the start method "spawn" (Note [the
    # child's start method] in jaxtransport/_os; tests/test_nested.py), plus the device plan's
    # variables (jaxtransport/_devices).
    assert issubclass(ctx.Process, multiprocessing.get_context("spawn").Process)
    assert ctx.Process._start_method == "spawn"
    assert ctx.Process is jmp.get_context("spawn").Process
    assert jmp.cpu_count() == multiprocessing.cpu_count()
    lock = jmp.Lock()
    with lock:
        pass
    assert issubclass(jmp.Process, multiprocessing.process.BaseProcess)
    with pytest.raises(AttributeError):
        jmp.not_a_thing  # noqa: B018


def square(x):
    return x * x


def test_pool_and_manager_passthrough():
    with jmp.get_context("forkserver" if "forkserver" in METHODS else "spawn").Pool(1) as pool:
        assert isinstance(pool, jt.Pool)
        assert (pool.apply(square, (jnp.arange(4.0),)) == jnp.arange(4.0) ** 2).all()
    with jmp.Manager() as m:
        d = m.dict()
        d["a"] = 1
        assert dict(d) == {"a": 1}


def test_import_registers_nothing():
    r = run_python(
        "import copyreg, multiprocessing.reduction as r, multiprocessing.connection, numpy, jax, cloudpickle\n"
        "before = (dict(copyreg.dispatch_table), dict(r.ForkingPickler._extra_reducers))\n"
        "import jaxtransport, jaxtransport.multiprocessing as m, threading, sys\n"
        "assert (dict(copyreg.dispatch_table), dict(r.ForkingPickler._extra_reducers)) == before\n"
        "assert threading.active_count() == 1 and 'ray' not in sys.modules\n"
        "assert jaxtransport.multiprocessing is m\n"
        "print('ok')\n")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_bad_options():
    with pytest.raises(ValueError, match="shm_threshold"):
        jmp.Queue(shm_threshold=-1)
    with pytest.raises(jt.PlacementError):
        jmp.Pipe(placement="gpu")
    with pytest.raises(ValueError, match="shm_capacity"):
        jmp.set_shm_capacity(0)


# --------------------------------------------------------------------------------------------
# placement="preserve" keeps shardings (8 host devices, fresh interpreter)

PRESERVE = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxtransport.multiprocessing as jmp
from tests.test_multiprocessing import echo
if __name__ == "__main__":
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    x = jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024), NamedSharding(mesh, P("x", "y")))
    ctx = jmp.get_context("spawn")
    q_in, q_out = ctx.Queue(shm_threshold=1024, placement="preserve"), ctx.Queue(shm_threshold=1024, placement="preserve")
    p = ctx.Process(target=echo, args=(q_in, q_out)); p.start()
    q_in.put({"x": x})
    y = q_out.get(timeout=60)["x"]
    q_in.put(None); p.join(30)
    assert y.sharding == x.sharding, (y.sharding, x.sharding)
    assert (np.asarray(y) == np.asarray(x)).all()
    print("ok", p.exitcode)
"""


def test_placement_preserve_keeps_the_sharding(tmp_path):
    script = tmp_path / "preserve.py"
    script.write_text(PRESERVE)
    import subprocess
    import sys

    from .conftest import ROOT

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0 and "ok 0" in r.stdout, r.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# lifetime: recycling, capacity, dead/stopped/garbage peers, fds


def test_memory_is_recycled_and_the_producer_does_not_grow(no_fd_leak):
    ctx = jmp.get_context("spawn")
    p, q_in, q_out = make_echo(ctx, shm_threshold=THRESH)
    try:
        def mapped() -> int:
            total = 0
            with open("/proc/self/maps") as f:
                for line in f:
                    if is_segment(line):
                        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                        total += hi - lo
            return total

        q_in.put(np.zeros(4 << 20, np.uint8))
        q_out.get(timeout=60)
        first = mapped()
        for i in range(40):
            q_in.put(np.full(4 << 20, i, np.uint8))
            assert q_out.get(timeout=60)[-1] == i
        # one 4 MiB class: this process's own slots plus the child's mapped ones, a few each
        assert mapped() <= first + 4 * (5 << 20), (first, mapped())
    finally:
        stop(p, q_in)
        q_in.close(), q_out.close()


@pytest.mark.shm
def test_slow_consumer_makes_put_wait_then_raise(no_fd_leak):
    q = jmp.Queue(shm_threshold=THRESH)
    jmp.set_shm_capacity(8 << 20)
    try:
        held = []
        with pytest.raises(jt.ShmCapacityError, match="no process has taken") as e:
            for _ in range(100):
                q.put(np.ones(1 << 20, np.uint8), timeout=0.5)
                held.append(1)
        assert "set_shm_capacity" in str(e.value)
        assert 2 <= len(held) < 10
        t0 = time.monotonic()
        # a consumer catching up frees the memory: puts succeed again
        for _ in held:
            q.get(timeout=5)
        q.put(np.ones(1 << 20, np.uint8), timeout=5)
        assert time.monotonic() - t0 < 10
        q.get(timeout=5)
    finally:
        jmp.set_shm_capacity(None)
        q.close()


@pytest.mark.shm
@pytest.mark.parametrize("method", METHODS)
def test_killed_consumer_gives_its_memory_back(method, no_fd_leak):
    ctx = jmp.get_context(method)
    q_in, q_out = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    jmp.set_shm_capacity(8 << 20)
    p = ctx.Process(target=hold_then_wait, args=(q_in, q_out, 3), daemon=True)
    p.start()
    try:
        for i in range(3):
            q_in.put(np.full(2 << 20, i + 1, np.uint8))
        assert q_out.get(timeout=60) == 6  # the child holds all three
        with pytest.raises(jt.ShmCapacityError):
            for _ in range(3):
                q_in.put(np.zeros(2 << 20, np.uint8), timeout=0.5)
        while not q_in.empty():
            q_in.get(timeout=5)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        # Its slots are free again: as many puts as the capacity holds succeed.
        for _ in range(3):
            q_in.put(np.zeros(2 << 20, np.uint8), timeout=10)
        for _ in range(3):
            q_in.get(timeout=10)
    finally:
        jmp.set_shm_capacity(None)
        stop(p)
        q_in.close(), q_out.close()


@pytest.mark.shm
@pytest.mark.parametrize("method", METHODS)
def test_stopped_consumer_blocks_nobody(method, no_fd_leak):
    ctx = jmp.get_context(method)
    q_in, q_out = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    jmp.set_shm_capacity(8 << 20)
    p = ctx.Process(target=hold_then_wait, args=(q_in, q_out, 1), daemon=True)
    p.start()
    try:
        q_in.put(np.full(1 << 20, 1, np.uint8))
        assert q_out.get(timeout=60) == 1
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(jt.ShmCapacityError):
            for _ in range(20):
                q_in.put(np.zeros(1 << 20, np.uint8), timeout=0.5)
        assert time.monotonic() - t0 < 30
        with pytest.raises(queue.Empty):
            q_out.get(timeout=0.3)
    finally:
        jmp.set_shm_capacity(None)
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        stop(p)
        q_in.close(), q_out.close()


@pytest.mark.shm
@pytest.mark.parametrize("method", METHODS)
def test_items_of_a_killed_producer_can_still_be_taken(method, no_fd_leak):
    ctx = jmp.get_context(method)
    q, done = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    p = ctx.Process(target=produce_then_wait, args=(q, done, 5, 3 << 20), daemon=True)
    p.start()
    first = q.get(timeout=60)
    assert first[0] == 0 and first.nbytes == 3 << 20
    assert done.get(timeout=60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    rest = [q.get(timeout=10) for _ in range(4)]
    assert [int(r[-1]) for r in rest] == [1, 2, 3, 4]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.3)
    assert int(first.sum()) == 0 and int(rest[-1].sum()) == 4 * (3 << 20)  # still valid
    del first, rest
    q.close(), done.close()


def test_garbage_from_a_peer_is_an_error_for_that_message_only(no_fd_leak):
    ctx = jmp.get_context("spawn")
    a, b = ctx.Pipe(shm_threshold=THRESH)
    p = ctx.Process(target=send_garbage, args=(b,), daemon=True)
    p.start()
    b.close()
    try:
        before = open_fds()
        with pytest.raises(jt.TransportError, match="Corrupt message"):
            a.recv()
        with socket.socket(fileno=os.dup(a.fileno())) as sock:
            stream = _os.is_stream(sock)
        if stream:
            return  # a framed stream (no SEQPACKET: macOS) cannot find the messages after garbage
        with pytest.raises(jt.TransportError, match="Corrupt message"):
            a.recv()  # it carried an fd: closed, not leaked
        assert open_fds() - before == set()
        assert (a.recv() == np.arange(5000)).all()
    finally:
        stop(p)
        a.close()


@pytest.mark.slow
def test_a_hundred_thousand_arrays_never_exhaust_fds(no_fd_leak):
    """100,000 arrays through one queue into a consumer limited to 64 open files."""
    ctx = jmp.get_context("spawn")
    q, out = ctx.Queue(64, shm_threshold=1024), ctx.Queue()
    n_msgs, per = 10_000, 10
    p = ctx.Process(target=consume_count, args=(q, out, n_msgs, 64), daemon=True)
    p.start()
    try:
        expect = 0
        for i in range(n_msgs):
            msg = [np.full(256, (i * per + j) % 251, np.int32) for j in range(per)]  # 1 KiB each
            expect += sum(int(m[0]) for m in msg)
            q.put(msg, timeout=60)
        count, total, fds = out.get(timeout=120)
        assert count == n_msgs * per and total == expect
        assert fds < 64
    finally:
        stop(p)
        q.close(), out.close()


def test_receivers_unmap_segments_the_sender_dropped(no_fd_leak):
    """At its capacity a sender drops wholly free segments of other sizes; receivers must not
    keep that memory alive."""
    def mapped_segments() -> int:
        with open("/proc/self/maps") as f:
            return len({line.split()[4] for line in f if is_segment(line)})

    q = jmp.Queue(shm_threshold=THRESH)
    jmp.set_shm_capacity(24 << 20)
    try:
        base = mapped_segments()
        for size_mib in (3, 5, 7, 9, 11, 13, 3, 5, 7, 9, 11, 13):  # a new size class each time
            q.put(np.ones(size_mib << 20, np.uint8), timeout=10)
            assert q.get(timeout=10).sum() == size_mib << 20
        # this process sends and receives: its own segments plus its mappings of them, bounded
        # by the capacity, not by the number of sizes ever sent
        assert mapped_segments() - base <= 2 * 3
    finally:
        jmp.set_shm_capacity(None)
        q.close()


def test_a_message_with_more_segments_than_one_packet_carries(monkeypatch, no_fd_leak):
    """Large arrays get a segment each; a packet carries at most MAX_FDS fds (SCM_MAX_FD is
    253): the rest travel in a bundle socket. Lowered here so that a small test crosses it."""
    from jaxtransport.multiprocessing import _sharing

    monkeypatch.setattr(_sharing, "MAX_FDS", 4)
    arrays = [np.full((5 << 20) // 4, i, np.uint8) for i in range(11)]  # 1.25 MiB: one segment each
    q = jmp.Queue(shm_threshold=THRESH)
    q.put(arrays)
    got = q.get(timeout=30)
    assert [int(a[0]) for a in got] == list(range(11)) and all(a.nbytes == (5 << 20) // 4 for a in got)
    del got
    ctx = jmp.get_context("spawn")
    p, q_in, q_out = make_echo(ctx, shm_threshold=THRESH)
    try:
        q_in.put(arrays)  # bundled here, unbundled in the child
        back = q_out.get(timeout=60)
        assert [int(a[-1]) for a in back] == list(range(11))
    finally:
        stop(p, q_in)
        q.close(), q_in.close(), q_out.close()


# A process whose default start method is a context only it has (as in a loky worker: loky
# registers its "loky" context this way). multiprocessing would hand that name to every spawned
# child, which cannot set it and dies at start-up ("cannot find context"); jaxtransport's
# children are told the start method jaxtransport chose (Note [the child's start method] in
# jaxtransport/_os; loky itself, per start method, in tests/test_nested.py).
FOREIGN_DEFAULT = """
import multiprocessing, multiprocessing.context
import jaxtransport as jt
import jaxtransport.multiprocessing as jmp
from tests.nested_tasks import put_start_method, start_method_here

class Elsewhere(multiprocessing.context.SpawnContext):
    _name = "elsewhere"


if __name__ == "__main__":
    multiprocessing.context._concrete_contexts["elsewhere"] = Elsewhere()
    multiprocessing.set_start_method("elsewhere")
    ctx = jmp.get_context({method!r})
    q = ctx.SimpleQueue()
    p = ctx.Process(target=put_start_method, args=(q,))
    p.start()
    p.join(60)
    print("PROCESS", p.exitcode, q.get() if p.exitcode == 0 else None, flush=True)
    with ctx.Manager() as m:
        print("MANAGER", m.dict(a=1)["a"], flush=True)
    with jt.Pool(1, start_method={method!r}) as pool:
        print("POOL", pool.apply(start_method_here), flush=True)
    stock = multiprocessing.get_context({method!r}).Process(target=print)
    stock.start()
    stock.join(60)
    print("STOCK", stock.exitcode, flush=True)
"""


@pytest.mark.parametrize("method", METHODS)
def test_children_get_the_chosen_start_method_not_the_callers_default(method):
    proc = run_python(FOREIGN_DEFAULT.format(method=method), timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"PROCESS 0 {method}" in proc.stdout, out[-4000:]
    assert "MANAGER 1" in proc.stdout, out[-4000:]
    assert f"POOL {method}" in proc.stdout, out[-4000:]
    assert "STOCK 1" in proc.stdout, out[-4000:]  # the standard library's own child: cannot find context
    assert "leaked" not in proc.stderr, out[-4000:]


def test_the_live_segment_list_every_message_carries_follows_the_arena():
    """``Producer.live_segments`` (in every packet: Note [a message with no arrays]) is kept
    between messages, and a new segment of the arena is in the next list."""
    from jaxtransport.multiprocessing import _sharing

    if _os.in_band():
        pytest.skip("no shared memory here: every message is in band")
    p = _sharing.Producer(None)
    try:
        first = p.live_segments()
        assert first == (0, ()) and p.live_segments() is first
        data, _view = p.alloc(1 << 16, None)
        second = p.live_segments()
        assert second == (data[0], (data[0],)) and p.live_segments() is second
        data2, _view2 = p.alloc(64 << 20, None)  # too large for the first segment: a second one
        third = p.live_segments()
        assert third[0] == data2[0] > data[0] and set(third[1]) == {data[0], data2[0]}
        del _view, _view2
        p.drop(data)
        p.drop(data2)
    finally:
        p.arena.close()


@pytest.mark.parametrize("method", METHODS)
def test_small_messages_both_ways_leave_nothing_behind(method, no_fd_leak):
    """Messages with no arrays for shared memory (Note [a message with no arrays]) between
    two processes, on a queue and a pipe, mixed with ones that have: every object back as
    sent, and the child exits cleanly."""
    ctx = jmp.get_context(method)
    q, r = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH)
    a, b = ctx.Pipe(shm_threshold=THRESH)
    proc = ctx.Process(target=_echo_both, args=(q, r, b))
    proc.start()
    try:
        msgs = [5, "x" * 100, {"a": np.arange(3)}, np.arange(THRESH, dtype=np.uint8), (None, b"\0" * 20_000),
                np.full(40_000, 7, np.uint8)]  # the last: a pickle larger than a packet
        for m in msgs * 3:
            q.put(m)
            got = r.get(timeout=60)
            a.send(m)
            got2 = a.recv()
            for g in (got, got2):
                if isinstance(m, np.ndarray):
                    assert isinstance(g, np.ndarray) and np.array_equal(g, m)
                elif isinstance(m, dict):
                    assert np.array_equal(g["a"], m["a"])
                else:
                    assert g == m
            del got, got2
        q.put(None)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        q.close(), r.close(), a.close(), b.close()


def _echo_both(q, r, conn) -> None:
    while True:
        x = q.get()
        if x is None:
            return
        r.put(x)
        conn.send(conn.recv())
        del x


def test_a_packet_with_no_arrays_is_still_validated():
    """The short path of a message with nothing in shared memory (Note [a message with no
    arrays]) refuses what the general path refuses: a pickle that is not bytes, an owner that is
    not the sender, as a TransportError that says the message is lost."""
    import pickle

    from jaxtransport._errors import TransportError
    from jaxtransport.multiprocessing import _sharing

    key = (os.getpid(), b"12345678")
    good = pickle.dumps((_sharing.MAGIC, key, pickle.dumps([1, "a"]), (), (), None, (0, ()), 0, (key,), ()))
    assert _sharing.decode(good, [], "device") == [1, "a"]
    assert _sharing.decode(good, [], "device", raw=True) == pickle.dumps([1, "a"])
    for bad in (
        (_sharing.MAGIC, key, 123, (), (), None, (0, ()), 0, (key,), ()),
        (_sharing.MAGIC, key, b"\x80\x05K\x01.", (), (), None, (0, ()), 0, ((1, b"other"),), ()),
        (_sharing.MAGIC, key, b"\x80\x05K\x01.", (), (), None, (0, ()), 0, (), ()),
    ):
        with pytest.raises(TransportError, match="Corrupt message"):
            _sharing.decode(pickle.dumps(bad), [], "device")
