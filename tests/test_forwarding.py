"""jaxtransport.multiprocessing: arrays already in shared memory travel on by handle (Note
[sending by handle] in ``multiprocessing/_sharing``): the same jax.Array sent again, a received
one forwarded along a chain and back to its owner, a fan-out beyond the lease table; with
owners, relays and receivers killed (-9) at each step, a peer stopped inside the header lock,
a reused pid, and forged messages. Checksums stay intact and nothing leaks in any of them
(the conftest fixture checks /dev/shm and child processes; ``no_fd_leak`` this process's fds).

What a test can see of "by handle": a receiver's arrays over one slot share their address;
a sender that copied nothing holds no slot of its own (``Producer.outstanding``).
"""

from __future__ import annotations

import os
import signal
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
import jaxtransport.multiprocessing as jmp
from jaxtransport import _os
from jaxtransport.multiprocessing import _sharing

from .conftest import alive, wait_until
from .test_multiprocessing import METHODS, THRESH, no_fd_leak  # noqa: F401 - a fixture

# In-band (no shared memory) everything is copied: nothing to see. Every test checks its fds.
pytestmark = [pytest.mark.shm, pytest.mark.usefixtures("no_fd_leak")]

N = 1 << 18  # float32 elements: 1 MiB


def _by_handle() -> bool:
    """Whether a receiver here can forward by handle (record locks on segments)."""
    return _os.record_locks()


def checksum(x) -> float:
    return float(np.asarray(x, dtype=np.float64).sum())


def address(x) -> int:
    return int(x.unsafe_buffer_pointer())


def _slots() -> set:
    """The slots this process copied into and still holds (or pins)."""
    p = _sharing.producer()
    p.reap(None)
    return set(p.outstanding)


def own_slots() -> int:
    return len(_slots())


def _new(before: set) -> int:
    """Slots held now that were not at ``before`` (earlier tests' may be freed meanwhile)."""
    return len(_slots() - before)


# --------------------------------------------------------------------------------------------
# child processes (module level: spawned children import them)


def hold_all(q_in, out, n, done):
    """Take ``n`` arrays, report their checksums and addresses, hold them until told."""
    got = [q_in.get(timeout=60) for _ in range(n)]
    out.put(([checksum(g) for g in got], [address(g) for g in got]))
    done.get(timeout=120)
    del got
    out.put("dropped")


def take_and_exit(q_in, out):
    """Take one array, read it, drop it and exit at once: no message after the drop."""
    x = q_in.get(timeout=60)
    out.put(checksum(x))
    del x


def relay(q_in, q_out, out, hold):
    """Forward whatever comes until None; report the slots this process had to copy into."""
    while True:
        x = q_in.get(timeout=60)
        if x is None:
            q_out.put(None)
            return
        q_out.put(x)
        if hold:
            q_out.close()
            q_out.join_thread()  # the message is in the queue's socket now
        out.put(("relayed", own_slots(), checksum(x)))
        if hold:
            time.sleep(300)  # killed here
        del x


def take_then_wait(q_in, out):
    """Take one array (its lease claimed), report, wait to be killed."""
    x = q_in.get(timeout=60)
    out.put(("took", checksum(x)))
    time.sleep(300)


def take_lock_and_stop(q_in, out):
    """Take one array, then take its slot header's lock and stop there (as a peer killed or
    stopped inside the locked section)."""
    x = q_in.get(timeout=60)
    c = _sharing.consumer()
    ptr = address(x)
    for m in c.mappers.values():
        if ptr in m.live:
            h = m.live[ptr]
            seg = m.segs[h.seg]
            assert _os.try_lock_range(seg.fd, h.offset - _sharing.HEADER, _sharing.HEADER)
            break
    else:
        raise AssertionError("the received array is not over a received slot")
    out.put(("locked", checksum(x)))
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(300)


def sink(q_in, out):
    while True:
        x = q_in.get(timeout=60)
        if x is None:
            return
        out.put(("sunk", checksum(x)))
        del x


def sink_where(q_in, out):
    while True:
        x = q_in.get(timeout=60)
        if x is None:
            return
        out.put((checksum(x), address(x)))
        del x


def _start(ctx, target, *args):
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _end(*procs):
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
            p.kill()
        p.join(15)
        assert p.exitcode is not None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _freed(before: set, left: int = 0, dead_too: bool = False) -> bool:
    """Whether at most ``left`` of the slots taken since ``before`` are still held. ``dead_too``
    once the receivers have exited: a release of a jax.Array that jaxlib's runtime thread had
    not handed back when its receiver exited (an exit flush waits for it 50 ms,
    ``_sharing.EXIT_FLUSH_S``; a loaded machine can take longer) counts as released, as the
    sender counts it when it runs short. Receivers that exit at once after dropping numpy arrays
    write every release: ``test_a_receiver_that_exits_right_after_dropping_gives_the_memory_back``."""
    p = _sharing.producer()
    _sharing.consumer().apply_releases()
    p.reap(None, dead_too=dead_too)
    return len(set(p.outstanding) - before) <= left


# --------------------------------------------------------------------------------------------
# re-sending, forwarding, round trips


@pytest.mark.parametrize("method", METHODS)
def test_the_same_array_sent_again_goes_by_handle_on_any_queue_or_pipe(method):
    ctx = jmp.get_context(method)
    q1, q2, out, done = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH), ctx.Queue(), ctx.Queue()
    a, b = ctx.Pipe(shm_threshold=THRESH)
    before = _slots()
    x = jnp.arange(N, dtype=jnp.float32) / 7
    want = checksum(x)
    p1 = _start(ctx, hold_all, q1, out, 3, done)
    p2 = _start(ctx, hold_all, q2, out, 1, done)
    try:
        for _ in range(3):
            q1.put(x)
        q2.put(x)
        res = [out.get(timeout=60) for _ in range(2)]
        assert _new(before) == 1  # one copy for four sends
        for sums, addrs in res:
            assert sums == [want] * len(sums)
            assert len(set(addrs)) == 1  # every one over the same slot
        a.send({"again": x})  # a pipe too: by handle, received in this very process
        got = b.recv()["again"]
        assert checksum(got) == want and _new(before) == 1
        del got
        done.put(1), done.put(1)
        assert [out.get(timeout=60) for _ in range(2)] == ["dropped", "dropped"]
        assert not _freed(before)  # x lives: its slot stays for the next send
        del x
        assert wait_until(lambda: _freed(before, dead_too=True), 10)
    finally:
        _end(p1, p2)
        for q in (q1, q2, out, done):
            q.close()
        a.close(), b.close()


@pytest.mark.parametrize("method", METHODS)
def test_a_chain_and_a_round_trip_forward_by_handle(method):
    """A (this process) -> B -> C -> D -> A, then A sends what came back on again."""
    ctx = jmp.get_context(method)
    qs = [ctx.Queue(shm_threshold=THRESH) for _ in range(4)]
    out = ctx.Queue()
    before = _slots()
    relays = [_start(ctx, relay, qs[i], qs[i + 1], out, False) for i in range(3)]
    try:
        x = jnp.arange(N, dtype=jnp.float32) * 3
        want = checksum(x)
        for _ in range(2):  # the second time the owner re-sends by handle too
            qs[0].put(x)
            back = qs[3].get(timeout=60)
            reports = [out.get(timeout=60) for _ in range(3)]
            assert checksum(back) == want
            assert [r[2] for r in reports] == [want] * 3
            # no relay copied: each holds no slot of its own (where forwarding is possible)
            assert all(r[1] == 0 for r in reports) == _by_handle(), reports
            assert _new(before) == 1
            if _by_handle():
                assert address(back) != address(x) and checksum(back) == want
            qs[0].put(back)  # round trip again: what came back goes on by handle
            again = qs[3].get(timeout=60)
            [out.get(timeout=60) for _ in range(3)]
            assert checksum(again) == want
            if _by_handle():
                assert _new(before) == 1 and address(again) == address(back)
            del back, again
        qs[0].put(None)
        assert qs[3].get(timeout=60) is None
        for r in relays:
            r.join(30)
        del x
        assert wait_until(lambda: _freed(before, dead_too=True), 10)
    finally:
        _end(*relays)
        for q in qs + [out]:
            q.close()


@pytest.mark.parametrize("method", METHODS)
def test_fan_out_beyond_the_lease_table_copies_the_rest(method):
    ctx = jmp.get_context(method)
    q, out, done = ctx.Queue(shm_threshold=THRESH), ctx.Queue(), ctx.Queue()
    n = _sharing.LEASES + 4
    before = _slots()
    x = jnp.full((N,), 2.5, jnp.float32)
    p = _start(ctx, hold_all, q, out, n, done)
    try:
        for _ in range(n):
            q.put(x)
        sums, addrs = out.get(timeout=60)
        assert sums == [checksum(x)] * n
        # LEASES messages share the first slot; the rest were copied, one slot each
        assert addrs.count(addrs[0]) == _sharing.LEASES and len(set(addrs)) == 5
        assert _new(before) == 5
        done.put(1)
        assert out.get(timeout=60) == "dropped"
        assert wait_until(lambda: _freed(before, 1), 10)  # the copies are freed, x's slot stays
        p.join(30)
        del x
        assert wait_until(lambda: _freed(before, dead_too=True), 10)
    finally:
        _end(p)
        q.close(), out.close(), done.close()


# --------------------------------------------------------------------------------------------
# kill -9 at each step


@pytest.mark.parametrize("method", METHODS)
def test_the_owner_killed_its_array_still_travels_on(method):
    # Each killed process gets queues of its own: on a framed stream (macOS) a process killed
    # just after a put may still hold that queue's writer lock (Note [queue messages]).
    ctx = jmp.get_context(method)
    q1, q2, go = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    out_a, out_b = ctx.Queue(), ctx.Queue()
    owner = _start(ctx, send_and_wait, q1, out_a)
    b = _start(ctx, take_then_forward_on_go, q1, go, q2, out_b)
    try:
        want = out_a.get(timeout=60)
        assert out_b.get(timeout=60) == "holding"
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        go.put("go")  # B forwards the dead owner's array to this process
        got = q2.get(timeout=60)
        assert checksum(got) == want
        assert out_b.get(timeout=60) == ("forwarded", 0 if _by_handle() else 1)
        del got
    finally:
        _end(owner, b)
        for q in (q1, q2, go, out_a, out_b):
            q.close()


def send_and_wait(q, out):
    x = jnp.arange(N, dtype=jnp.float32) + 1
    q.put(x)
    q.close()
    q.join_thread()
    out.put(checksum(x))
    time.sleep(300)


def take_then_forward_on_go(q_in, go, q_out, out):
    x = q_in.get(timeout=60)
    out.put("holding")
    assert go.get(timeout=60) == "go"
    q_out.put(x)
    out.put(("forwarded", own_slots()))
    time.sleep(300)


@pytest.mark.parametrize("method", METHODS)
def test_a_relay_killed_with_its_message_in_flight_or_after_the_claim(method):
    """B forwards to C and is killed before C takes the message (in flight: never reaped);
    C takes it and is killed (after the claim: reaped). The owner's slot comes back."""
    ctx = jmp.get_context(method)
    q1, q2, out, out_c = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH), ctx.Queue(), ctx.Queue()
    before = _slots()
    x = jnp.arange(N, dtype=jnp.float32) - 5
    want = checksum(x)
    b = _start(ctx, relay, q1, q2, out, True)
    c = None
    try:
        q1.put(x)
        assert out.get(timeout=60)[0] == "relayed"  # B may hold out's writer lock when killed
        os.kill(b.pid, signal.SIGKILL)
        b.join(10)
        del x
        # B's lease is reaped (dead), the one in flight to C is not: the slot stays. (Where
        # B could only copy, its message is in B's own slot: the owner's comes back now.)
        assert _freed(before, dead_too=True) != _by_handle()
        c = _start(ctx, take_then_wait, q2, out_c)
        assert out_c.get(timeout=60) == ("took", want)
        assert _freed(before, dead_too=True) != _by_handle()  # C holds it
        os.kill(c.pid, signal.SIGKILL)
        c.join(10)
        assert wait_until(lambda: _freed(before, dead_too=True), 10)
    finally:
        _end(b, *([c] if c is not None else []))
        for q in (q1, q2, out, out_c):
            q.close()


@pytest.mark.parametrize("method", METHODS)
def test_a_peer_stopped_or_killed_inside_the_header_lock(method):
    if not _by_handle():
        pytest.skip("no record locks on segments here (forwarding copies)")
    ctx = jmp.get_context(method)
    q1, q2, out = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    before = _slots()
    x = jnp.arange(N, dtype=jnp.float32) * 0.5
    want = checksum(x)
    out_s = ctx.Queue()
    lk = _start(ctx, take_lock_and_stop, q1, out)
    s = _start(ctx, sink_where, q2, out_s)
    try:
        q1.put(x)
        assert out.get(timeout=60) == ("locked", want)
        assert wait_until(lambda: _state(lk.pid) == "T", 10)
        t0 = time.monotonic()
        q2.put(x)  # the lease cannot be had: copied, never waited for
        assert time.monotonic() - t0 < 5
        sum1, at1 = out_s.get(timeout=60)
        assert sum1 == want
        assert wait_until(lambda: _freed(before, 1), 10)  # the copy is free once sunk
        os.kill(lk.pid, signal.SIGKILL)  # the kernel drops its lock
        lk.join(10)
        q2.put(x)  # by handle again: no new slot, and not where the copy was
        assert _new(before) == 1
        sum2, at2 = out_s.get(timeout=60)
        assert sum2 == want and at2 != at1
        del x
        assert wait_until(lambda: _freed(before, dead_too=True), 10)
        q2.put(None)
        s.join(30)
    finally:
        _end(lk, s)
        q1.close(), q2.close(), out.close(), out_s.close()


def test_a_reused_pid_does_not_keep_a_slot():
    """A lease names its holder by pid and start time: the same pid with another start time
    (the holder died and its pid was reused) counts as dead; the right one never does."""
    ctx = jmp.get_context("spawn")
    q, out = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    before = _slots()
    x = jnp.arange(N + 16, dtype=jnp.float32)  # a size no other test leaves behind
    p = _start(ctx, take_then_wait, q, out)
    try:
        q.put(x)
        assert out.get(timeout=60) == ("took", checksum(x))
        prod = _sharing.producer()
        (sent,) = [s for d, s in prod.outstanding.items() if d[2] == x.nbytes]
        mm = prod.arena.segment(sent.handle.seg).mm
        (j,) = [
            j
            for j in range(_sharing.LEASES)
            if struct.unpack_from("<QQQQ", mm, sent.handle.offset + 32 * j)[2] == p.pid
        ]
        del x
        assert not _freed(before, dead_too=True)  # its holder is alive
        token_at = sent.handle.offset + 32 * j + 24
        struct.pack_into("<Q", mm, token_at, struct.unpack_from("<Q", mm, token_at)[0] ^ 1)
        assert alive(p.pid)
        assert _freed(before, dead_too=True)  # that pid now names another process
    finally:
        _end(p)
        q.close(), out.close()


def test_forged_leases_are_errors_for_that_message_only():
    """A lease index out of range, or a message received twice (its lease no longer in
    flight): TransportError or ShmHandleError, its fds closed, its slots not taken."""
    a, b = jmp.Pipe(shm_threshold=THRESH)
    try:
        x = jnp.arange(N, dtype=jnp.float32)
        out = _sharing.commit(_sharing.prepare({"x": x}, THRESH, "obj"))
        packet, fds = out.packet, list(out.fds)
        rec = list(__import__("pickle").loads(packet))
        rec[9] = ((0, _sharing.LEASES),)
        bad = __import__("pickle").dumps(tuple(rec), protocol=5)
        with pytest.raises(jt.TransportError, match="out of range"):
            _sharing.decode(bad, [os.dup(fd) for fd in fds], "device")
        got = _sharing.decode(packet, [os.dup(fd) for fd in fds], "device")
        assert checksum(got["x"]) == checksum(x)
        with pytest.raises(jt.ShmHandleError, match="not in flight"):
            _sharing.decode(packet, [os.dup(fd) for fd in fds], "device")
        out.sent()
        del got
        a.send(x)  # the pipe goes on
        assert checksum(b.recv()) == checksum(x)
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("method", METHODS[:1])
def test_jitted_results_and_donated_arrays(method):
    """A jitted function's result is pinned like any array; a donated (deleted) array is
    refused as the copy path refuses it, and its slot is not sent."""
    ctx = jmp.get_context(method)
    q, out = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    p = _start(ctx, sink, q, out)
    try:
        f = jax.jit(lambda v: v * 2, donate_argnums=0)
        y = jax.jit(lambda v: v + 1)(jnp.zeros(N, jnp.float32))
        q.put(y)
        assert out.get(timeout=60) == ("sunk", float(N))
        f(y)  # donates y (on CPU JAX may keep it: then it is still valid and goes by handle)
        if y.is_deleted():
            with pytest.raises(RuntimeError):
                q.put(y)
        else:
            q.put(y)
            assert out.get(timeout=60) == ("sunk", float(N))
        q.put(None)
        p.join(30)
    finally:
        _end(p)
        q.close(), out.close()


def produce_sizes(q, sizes):
    for n in sizes:
        x = jnp.full((n // 4,), float(n), jnp.float32)
        q.put(x)
        del x
    q.put(None)
    q.close()
    q.join_thread()


def test_idle_segments_of_an_owner_seen_only_forwarded_are_unmapped(monkeypatch):
    """This process gets A's slots only through a relay, so A never says which segments it
    dropped: beyond FOREIGN_MAPPED_MAX, A's segments with no array over them are unmapped, and
    a later message naming one brings its fd again."""
    if not _by_handle():
        pytest.skip("forwarding copies here: only the relay's own segments arrive")
    monkeypatch.setattr(_sharing, "FOREIGN_MAPPED_MAX", 4 << 20)
    ctx = jmp.get_context("spawn")
    q1, q2, out = ctx.Queue(shm_threshold=THRESH), ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    sizes = [(1 << 20) * k for k in (1, 2, 3, 5, 8, 13)] * 2
    a = _start(ctx, produce_sizes, q1, sizes)
    b = _start(ctx, relay, q1, q2, out, False)
    try:
        c = _sharing.consumer()
        for n in sizes:
            x = q2.get(timeout=60)
            assert x.nbytes == n and checksum(x) == float(n) * (n // 4)
            del x
        assert q2.get(timeout=60) is None
        a.join(30), b.join(30)
        with c.lock:
            foreign = [m for k, m in c.mappers.items() if k not in c.senders]
            mapped = sum(s.size for m in foreign for s in m.segs.values() if s.mm is not None)
        assert foreign and mapped <= (4 << 20) + max(s.size for m in foreign for s in m.segs.values()), mapped
    finally:
        _end(a, b)
        q1.close(), q2.close(), out.close()


@pytest.mark.parametrize("method", METHODS)
def test_a_receiver_that_exits_right_after_dropping_gives_the_memory_back(method):
    """A consumer whose last act is to drop what it received still writes its release as it
    exits (``_sharing._flush_at_exit``): the sender has its slot back without counting the dead
    receiver's lease as released (``dead_too=False``)."""
    ctx = jmp.get_context(method)
    q, out = ctx.Queue(shm_threshold=THRESH), ctx.Queue()
    before = _slots()
    x = np.arange(N, dtype=np.float32)
    p = _start(ctx, take_and_exit, q, out)
    try:
        q.put(x)
        assert out.get(timeout=60) == checksum(x)
        p.join(60)
        assert p.exitcode == 0
        assert wait_until(lambda: _freed(before), 10)
    finally:
        _end(p)
        q.close(), out.close()
