"""The portable and in-band paths (Note [platforms] in ``jaxtransport/_os``), run on Linux.

Two ways to reach them, both tested: the switch (``JAXTRANSPORT_PLATFORM=portable|inband``) and
the simulation (``tests/platforms``: a ``sitecustomize`` on PYTHONPATH that takes Linux's
facilities away in every process, parent and spawned workers, so that feature detection must
find the portable path). ``make test-platforms`` runs the Pool, Executor and
``jaxtransport.multiprocessing`` suites under the simulation; this file checks the pieces and
one whole round trip per mode and start method.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from jaxtransport import _os

from .conftest import ROOT, alive, run_python, shm_entries, shm_leaks, wait_until

SIM_DIR = os.path.join(ROOT, "tests", "platforms")


def _simulated(kind: str) -> dict:
    """The environment of a fresh interpreter whose Linux facilities are hidden as on ``kind``."""
    return {
        "JAXTRANSPORT_SIMULATE": kind,
        "PYTHONPATH": SIM_DIR + os.pathsep + ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def _describe(env: dict) -> dict:
    proc = run_python("import json; from jaxtransport import _os; print(json.dumps(_os.describe()))", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# choosing a path: the switch, and feature detection under the simulation


def test_the_linux_path_is_the_default_here():
    if not hasattr(os, "memfd_create") or not hasattr(socket, "SOCK_SEQPACKET"):
        pytest.skip("not a Linux host")
    d = _describe({})
    assert d["mode"] == "auto" and d["segments"] == "memfd" and d["messages"] == "seqpacket"
    assert d["populate"] in ("madvise", "fallocate") and d["proc"] is True


@pytest.mark.parametrize(
    "env, want",
    [
        ({"JAXTRANSPORT_PLATFORM": "portable"}, ("portable", "posix", "stream", True)),
        ({"JAXTRANSPORT_PLATFORM": "inband"}, ("inband", "none (in-band)", "socketpair", False)),
        ("macos", ("auto", "posix", "stream", True)),
        ("windows", ("auto", "none (in-band)", "socketpair", False)),
    ],
    ids=["switch-portable", "switch-inband", "simulated-macos", "simulated-windows"],
)
def test_each_path_is_chosen(env, want):
    d = _describe(_simulated(env) if isinstance(env, str) else env)
    assert (d["mode"], d["segments"], d["messages"], d["fd_passing"]) == want
    # The Pool's pipes (Note [pipe io]): POSIX I/O on both Unix columns, sockets on Windows's.
    assert d["pipes"] == ("posix" if d["fd_passing"] else "sockets")
    assert d["shared_lock"] == "multiprocessing.Lock" and d["proc"] is False
    if d["segments"] == "posix":
        assert d["populate"] == "touch"


def test_an_unknown_mode_is_an_error_naming_the_variable():
    proc = run_python("from jaxtransport import _os; _os.mode()", env={"JAXTRANSPORT_PLATFORM": "macos"})
    assert proc.returncode != 0 and "JAXTRANSPORT_PLATFORM='macos'" in proc.stderr


def test_without_proc_cpus_memory_and_liveness_still_answer():
    code = textwrap.dedent(
        """
        import os, subprocess, sys
        from jaxtransport import _os
        assert not _os.has_proc()
        assert _os.cpu_count() == (os.cpu_count() or 1)
        assert _os.free_memory() > 64 << 20
        assert _os.process_token(os.getpid()) == 0
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        assert _os.process_token(child.pid) is None  # reaped: gone
        print("ok")
        """
    )
    proc = run_python(code, env=_simulated("macos"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------
# the pieces of the portable path


def test_a_posix_segment_leaves_no_name_and_is_sized_once():
    before = shm_entries()
    code = textwrap.dedent(
        """
        import os
        from jaxtransport import _os
        fd, mm = _os.create_segment(8 << 20)
        link = os.readlink(f"/proc/self/fd/{fd}")
        name = link.split("/dev/shm", 1)[1].split(" ")[0]
        assert link.startswith("/dev/shm/jaxtransport-") and link.endswith("(deleted)"), link
        assert len(name) <= 31, name  # macOS's limit on shm_open names
        assert not os.path.exists("/dev/shm" + name)
        assert os.fstat(fd).st_size == 8 << 20 and not _os.can_grow()
        mm[:3] = b"abc"
        assert os.pread(fd, 3, 0) == b"abc"
        print("ok")
        """
    )
    proc = run_python(code, env={"JAXTRANSPORT_PLATFORM": "portable"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    assert not shm_leaks(before, shm_entries())


def _stream_pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


@pytest.mark.parametrize("size", [0, 1, 100 << 10, 3 << 20])
def test_stream_framing_keeps_messages_whole_with_their_fds(size):
    a, b = _stream_pair()
    payloads = [bytes([i % 251]) * size for i in range(3)]
    r, w = os.pipe()
    try:
        t = threading.Thread(
            target=lambda: [_os.send_message(a, p, [r] if i == 1 else []) for i, p in enumerate(payloads)]
        )
        t.start()
        got = [_os.recv_message(b, 64 << 10, 4) for _ in payloads]
        t.join()
        assert [g[0] for g in got] == payloads
        assert [len(g[1]) for g in got] == [0, 1, 0] and not any(g[2] for g in got)
        os.write(w, b"x")
        assert os.read(got[1][1][0], 1) == b"x"  # the fd that arrived is the pipe's read end
        os.close(got[1][1][0])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_stream_framing_never_starts_a_message_it_may_not_finish_at_once():
    a, b = _stream_pair()
    try:
        with pytest.raises(BlockingIOError):
            _os.send_message(a, b"x", (), socket.MSG_DONTWAIT)
        a.close()
        assert _os.recv_message(b, 1024, 4) == (b"", [], False)  # end of stream
    finally:
        b.close()


def test_a_fixed_record_arriving_in_parts_is_read_whole_with_its_fd():
    a, b = _stream_pair()
    r, w = os.pipe()
    try:
        record = bytes(range(16))
        socket.send_fds(a, [record[:5]], [r])
        a.sendall(record[5:])
        data, fds = _os.recv_fd(b, 16)
        assert data == record and len(fds) == 1
        os.close(fds[0])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


# ------------------------------------------------------------------------------------------
# whole round trips: the portable path under the simulation, the in-band path


ROUND_TRIP = textwrap.dedent(
    """
    import sys, warnings
    import numpy as np

    def double(x):
        return x * 2

    def double_w(tree):
        return tree["w"] * 2

    def main(method):
        import jax, jax.numpy as jnp
        import jaxtransport as jt
        import jaxtransport.multiprocessing as jmp
        from jaxtransport import _os
        warnings.simplefilter("error", RuntimeWarning)
        caught = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            x = jnp.arange(1 << 20, dtype=jnp.float32)  # 4 MiB
            key = jax.random.key(7)
            weak = jnp.asarray(2.0)
            with jt.Pool(2, start_method=method, shm_threshold=1 << 16) as pool:
                out = pool.map(double, [x, x + 1])
                assert bool((out[0] == x * 2).all()) and bool((out[1] == (x + 1) * 2).all())
                k2 = pool.apply(jax.random.key_data, (key,))
                assert bool((k2 == jax.random.key_data(key)).all())
                assert pool.apply(double, (weak,)).weak_type
                shared = pool.share({"w": x})
                assert bool((pool.apply(double_w, (shared,)) == x * 2).all())
                shared.release()
            with jt.Pool(1, start_method=method) as pool:  # a second pool: no second warning
                assert pool.apply(double, (3,)) == 6
            with jt.Executor(2, start_method=method) as ex:
                assert bool((ex.submit(double, x).result() == x * 2).all())
            ctx = jmp.get_context(method)
            q = ctx.Queue(shm_threshold=1 << 16)
            q.put({"x": x, "n": np.arange(5)})
            got = q.get(timeout=60)
            assert bool((got["x"] == x).all()) and got["n"].tolist() == [0, 1, 2, 3, 4]
            q.close()
            a, b = ctx.Pipe()
            a.send(np.arange(1 << 14))  # 128 KiB
            assert b.recv().sum() == sum(range(1 << 14))
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        print("WARNINGS", len(messages), messages[0][:160] if messages else "")
        print("SEGMENTS", _os.segment_kind())
        print("ok")

    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def _run_round_trip(tmp_path, method: str, env: dict, text: str = ROUND_TRIP, timeout: float = 600):
    """``text`` as a main script (``sys.argv[1]``: ``method``) in a fresh interpreter."""
    script = tmp_path / "script.py"
    script.write_text(text)
    code = (
        f"import runpy, sys; sys.argv = [{str(script)!r}, {method!r}]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    return run_python(code, env=env, timeout=timeout)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pool_executor_and_queues_on_the_simulated_mac(tmp_path, method):
    before = shm_entries()
    proc = _run_round_trip(tmp_path, method, _simulated("macos"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
    assert "WARNINGS 0" in proc.stdout and "SEGMENTS posix" in proc.stdout
    assert not shm_leaks(before, shm_entries())


def test_pool_executor_and_queues_in_band_warn_once_with_the_reason(tmp_path):
    before = shm_entries()
    proc = _run_round_trip(tmp_path, "spawn", _simulated("windows"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
    assert "WARNINGS 1" in proc.stdout and "cannot pass file descriptors" in proc.stdout
    assert not shm_leaks(before, shm_entries())


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pool_executor_and_queues_on_the_windows_pipes_by_the_switch(tmp_path, method):
    """``JAXTRANSPORT_PLATFORM=inband`` takes the Windows column whole, its socket pipes
    included (Note [pipe io]), with either start method."""
    before = shm_entries()
    proc = _run_round_trip(tmp_path, method, {"JAXTRANSPORT_PLATFORM": "inband"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
    assert "WARNINGS 1" in proc.stdout and "JAXTRANSPORT_PLATFORM=inband is set" in proc.stdout
    assert not shm_leaks(before, shm_entries())


def test_on_the_simulated_windows_a_busy_worker_follows_its_killed_parent():
    """Where ``os.kill`` terminates (Windows), a worker watches its parent's sentinel: the
    simulation's ``os.kill`` kills whatever the signal, so a ``kill(pid, 0)`` probe would have
    killed the parent at the pool's start."""
    code = textwrap.dedent(
        """
        import os, time, jaxtransport as jt
        if __name__ == "__main__":
            p = jt.Pool(2)
            pids = set()
            while len(pids) < 2:  # each worker's pid (a task each: both started)
                pids |= set(p.map(lambda _: (time.sleep(0.05), os.getpid())[1], range(8), chunksize=1))
            print("PIDS", *sorted(pids), flush=True)
            p.apply_async(time.sleep, (120,))  # a worker busy: only its watchdog can see the parent go
            time.sleep(1.0)
            print("READY", flush=True)
            time.sleep(120)
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", **_simulated("windows"))
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        pids: list[int] = []
        for line in proc.stdout:
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
            if line.startswith("READY"):
                break
        assert len(pids) == 2 and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else pids
        proc.kill()
        proc.wait(10)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 30), "a worker outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


PIPE_END_THROUGH_A_QUEUE = textwrap.dedent(
    """
    import sys
    import jaxtransport.multiprocessing as jmp

    def child(q):
        conn = q.get(timeout=60)  # a Pipe end, sent after the child started (not spawning)
        conn.send(conn.recv() * 2)

    if __name__ == "__main__":
        ctx = jmp.get_context(sys.argv[1])
        a, b = ctx.Pipe()
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        q.put(b)
        a.send(21)
        assert a.recv() == 42
        p.join(60)
        assert p.exitcode == 0
        print("ok")
    """
)


@pytest.mark.parametrize("mode", ["auto", "portable", "inband"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_pipe_end_travels_through_a_queue_in_every_mode(tmp_path, mode, method):
    """Sockets pickle with multiprocessing's own means in every mode (``_sockets.socket_handle``:
    ``DupFd`` on POSIX, served by the resource sharer when not spawning; ``DupSocket`` on
    Windows), so a Connection sent through a Queue to a running process works, as stock's."""
    proc = _run_round_trip(tmp_path, method, {"JAXTRANSPORT_PLATFORM": mode}, PIPE_END_THROUGH_A_QUEUE, 180)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_the_socket_pipes_poller_sees_sockets_and_many_process_sentinels():
    """The Windows column's manager wait (Note [pipe io]): sockets through a selector, other
    waitables (process handles there; pipe fds here) through ``connection.wait`` in groups
    small enough for Windows (at most 63 handles a wait), when the sockets have nothing."""
    code = textwrap.dedent(
        """
        import os, socket
        from jaxtransport import _os
        assert not _os.posix_io()
        import multiprocessing.connection as mpc
        try:
            mpc.wait([os.pipe()[0] for _ in range(64)], 0)
        except ValueError:
            pass
        else:
            raise AssertionError("the simulated wait() took 64 handles")
        a, b = socket.socketpair()
        pipes = [os.pipe() for _ in range(130)]
        poller = _os.Poller()
        wanted = {a: "sock"}
        wanted.update({r: ("pipe", i) for i, (r, _w) in enumerate(pipes)})
        poller.set(wanted)
        assert poller.poll(0.01) == []
        os.write(pipes[125][1], b"x")  # in the third group of handles
        assert poller.poll(0.01) == [("pipe", 125)]
        os.read(pipes[125][0], 1)
        b.send(b"y")
        assert poller.poll(1.0) == ["sock"]
        poller.set({a: "sock"})  # set anew: the pipes are gone
        os.write(pipes[3][1], b"x")
        assert poller.poll(0.01) == ["sock"]
        poller.close()
        print("ok")
        """
    )
    proc = run_python(code, env=_simulated("windows"))  # its wait() takes 63 at most, as Windows'
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_windows_simulation_takes_posix_io_from_jaxtransport():
    """What ``_simulate._hide_posix_io`` says it takes away, and that jaxtransport's liveness
    probe never signals a process there (the simulated ``os.kill`` would kill it)."""
    code = textwrap.dedent(
        """
        import os, select, socket, subprocess, sys, textwrap, time
        assert not hasattr(select, "poll") and not hasattr(os, "writev") and not hasattr(os, "killpg")
        assert not hasattr(socket, "MSG_DONTWAIT")
        from jaxtransport import _os
        assert not _os.posix_io() and not _os.kill_probes()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        assert _os.process_token(child.pid) == 0
        time.sleep(0.2)
        assert child.poll() is None, "the liveness probe killed the process"
        probe = '''
            a, b = socket.socketpair()
            calls = (lambda: os.write(a.fileno(), b"x"), lambda: a.sendmsg([b"x"]),
                     lambda: select.select([os.pipe()[0]], [], [], 0))
            for call in calls:
                try:
                    call()
                except (OSError, AttributeError):
                    pass
                else:
                    raise AssertionError("not hidden from jaxtransport")
            os.kill(child.pid, 0)
        '''
        ns = {"__name__": "jaxtransport.probe", "os": os, "socket": socket, "select": select, "child": child}
        exec(textwrap.dedent(probe), ns)  # as jaxtransport's own code
        assert child.wait(10) != 0  # os.kill from jaxtransport terminates, as on Windows
        print("ok")
        """
    )
    proc = run_python(code, env=_simulated("windows"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_codec_register_and_the_ray_serializers_need_no_shared_memory():
    """Ray's own Linux build needs Unix sockets (its psutil), so Ray is imported first; then
    fcntl, AF_UNIX, fd passing and /proc are taken away before jaxtransport is imported."""
    pytest.importorskip("ray")
    code = textwrap.dedent(
        f"""
        import pickle, sys
        import ray  # noqa: F401
        sys.path.insert(0, {SIM_DIR!r})
        import _simulate
        _simulate.hide("windows")
        import socket
        assert not hasattr(socket, "AF_UNIX") and sys.modules["fcntl"] is None
        import jax, jax.numpy as jnp
        import jaxtransport as jt
        import jaxtransport.ray as jr
        x = jnp.arange(10, dtype=jnp.bfloat16)
        key = jax.random.key(3)
        data, bufs = jt.dumps({{"x": x, "k": key}})
        y = jt.loads(data, bufs)
        assert bool((y["x"] == x).all()) and y["x"].dtype == x.dtype
        assert bool((jax.random.key_data(y["k"]) == jax.random.key_data(key)).all())
        jt.register()
        try:
            z = pickle.loads(pickle.dumps(jnp.asarray(1.0), protocol=5))
            assert z.weak_type
        finally:
            jt.unregister()
        oob = []  # as Ray carries the serializer's output: protocol 5, buffers out of band
        blob = pickle.dumps(jr._serialize(x), protocol=5, buffer_callback=oob.append)
        w = jr._deserialize(pickle.loads(blob, buffers=oob))
        assert bool((w == x).all())
        assert "jaxtransport._shm" not in sys.modules, "the codec pulled in shared memory"
        print("ok")
        """
    )
    proc = run_python(code, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


def test_simulation_hides_everything_it_says():
    code = textwrap.dedent(
        """
        import ctypes, mmap, os, socket, sys
        for name in ("memfd_create", "posix_fallocate", "sched_getaffinity", "pidfd_open"):
            assert not hasattr(os, name), name
        assert not hasattr(socket, "SOCK_SEQPACKET") and not hasattr(mmap, "MAP_POPULATE")
        try:
            socket.socketpair(socket.AF_UNIX, 5)
        except OSError:
            pass
        else:
            raise AssertionError("SOCK_SEQPACKET still works")
        lib = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(64)
        assert lib.sem_init(ctypes.addressof(buf), 1, 1) != 0
        m = mmap.mmap(-1, 4096)
        try:
            m.madvise(23)
        except OSError:
            pass
        else:
            raise AssertionError("MADV_POPULATE_WRITE still works")
        open("/proc/self/stat").close()  # the tests' own reads still work
        from jaxtransport import _os
        assert not _os.has_proc()
        print("ok")
        """
    )
    proc = run_python(code, env=_simulated("macos"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
