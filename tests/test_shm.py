"""The shared-memory layer on its own: size classes, slot accounting, fd passing, handles, lifetime."""

from __future__ import annotations

import gc
import os
import resource
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxtransport import _codec, _shm
from jaxtransport import _wire as _pool_wire
from jaxtransport._errors import ShmCapacityError, ShmHandleError

from .conftest import ROOT


def pair(capacity=64 << 20):
    """A sender arena and a receiver mapper connected by a fd socket, in one process."""
    a, b = _shm.fd_socketpair()
    return _shm.Arena(capacity, label="test sender"), _shm.Mapper(b, label="test sender", wait_fd=0.5), a


def send(arena, sock, sent, handle):
    if handle[0] not in sent:
        seg = arena.segment(handle[0])
        _shm.send_segment(sock, seg.seg_id, seg.size, seg.fd)
        sent.add(handle[0])


@given(st.integers(1, 1 << 31))
@settings(max_examples=300, deadline=None)
def test_size_class_bounds(n):
    c = _shm.size_class(n)
    assert c >= n and c % _shm.PAGE == 0
    assert c <= max(n * 1.25 + _shm.PAGE, _shm.PAGE)  # at most 25% slack past a page
    assert _shm.size_class(c) == c


def test_alloc_release_recycles_and_never_double_hands_out():
    arena = _shm.Arena(64 << 20)
    held = [arena.alloc(100_000, "r")[0] for _ in range(30)]
    keys = {(h[0], h[1]) for h in held}
    assert len(keys) == 30  # distinct slots while held
    created = arena.segments_created
    for h in held:
        assert arena.release(h, "r")
    again = [arena.alloc(100_000, "r")[0] for _ in range(30)]
    assert arena.segments_created == created  # recycled, no new memory
    assert {(h[0], h[1]) for h in again} == keys
    assert all(h[3] == 2 for h in again)  # new generation
    # stale (old generation) and double releases are ignored
    assert not arena.release(held[0], "r")
    assert arena.release(again[0], "r") and not arena.release(again[0], "r")
    arena.close()


def test_borrowers_transfer_lend_release_all():
    arena = _shm.Arena(64 << 20)
    h, _ = arena.alloc(5000, "chunk")
    arena.transfer([h], "chunk", "w1")
    arena.lend([h], "w2")
    assert arena.held_by("w1") == 1 and arena.held_by("w2") == 1 and arena.held_by("chunk") == 0
    arena.release_all("w1")
    assert arena.in_use() > 0
    arena.release(h, "w2")
    assert arena.in_use() == 0
    arena.close()


def test_capacity_error_eviction_and_wait():
    arena = _shm.Arena(8 << 20)
    h1, _ = arena.alloc(3 << 20, "a")
    h2, _ = arena.alloc(3 << 20, "a")
    with pytest.raises(ShmCapacityError, match=r"shm_capacity=.*is reached") as info:
        arena.alloc(3 << 20, "a")
    assert "bytes" in str(info.value) and "Fixes" in str(info.value)
    with pytest.raises(ShmCapacityError, match="larger than shm_capacity"):
        arena.alloc(9 << 20, "a")
    arena.release(h1, "a")
    arena.release(h2, "a")
    # a different size class: the free segments of the old one are unmapped to make room
    h3, _ = arena.alloc(7 << 20, "a")
    assert sorted(arena.take_forgotten()) == sorted({h1[0], h2[0]})
    # the wait hook runs while memory is short, with the arena's lock released (it may take
    # the arena's and other locks); a release lets the allocation through
    calls = []

    def wait():
        calls.append(arena.cond.acquire(blocking=False))
        arena.cond.release()
        if len(calls) == 2:
            arena.release(h3, "a")
        return 0.01 if len(calls) < 10 else False

    h4, _ = arena.alloc(7 << 20, "b", wait)
    assert calls == [True, True] and (h4[0], h4[1]) == (h3[0], h3[1])
    arena.close()


def test_fd_passing_holders_and_lifetime():
    arena, mapper, sock = pair()
    sent = set()
    h, view = arena.alloc(4096 * 4, "peer")
    view.view(np.float32)[:] = 1.5
    send(arena, sock, sent, h)
    holder = mapper.holder(h)
    meta = _codec.ArrayMeta(1, "float32", (4096,), False, None, None, ())
    x = _pool_wire._build("jax", (tuple(meta), ((0, h[2]),)), holder, h, "device", True)
    del holder
    assert isinstance(x, jax.Array) and float(x[0]) == 1.5
    assert mapper.find(x.unsafe_buffer_pointer(), x.nbytes) == h  # aliases the slot
    view.view(np.float32)[:] = 2.5  # proves aliasing (never done to live data by the pool)
    assert float(x[0]) == 2.5
    derived = np.asarray(x)
    del x
    gc.collect()
    assert mapper.take_releases() == []  # a numpy view of its buffer is still alive
    del derived
    gc.collect()
    assert mapper.take_releases() == [h]
    arena.release(h, "peer")
    assert arena.in_use() == 0
    mapper.close()
    arena.close()
    sock.close()


def test_bad_handles_raise_clear_errors():
    arena, mapper, sock = pair()
    h, _ = arena.alloc(8192, "peer")
    send(arena, sock, set(), h)
    seg_size = arena.segment(h[0]).size
    with pytest.raises(ShmHandleError, match="unknown here"):
        mapper.holder((999, 0, 10, 1))
    with pytest.raises(ShmHandleError, match="outside"):
        mapper.holder((h[0], seg_size - 64, 4096, 1))
    with pytest.raises(ShmHandleError, match="outside"):
        mapper.holder((h[0], -64, 10, 1))
    with pytest.raises(ShmHandleError, match="expected"):
        mapper.holder(("x",))
    holder = mapper.holder(h)
    with pytest.raises(ShmHandleError, match="truncated"):
        _pool_wire._build("np", (np.dtype("f4"), (4096,)), holder, h, "device", False)
    mapper.forget([h[0]])
    with pytest.raises(ShmHandleError, match="freed"):
        mapper.holder(h)
    del holder
    mapper.close()
    arena.close()
    sock.close()


def test_steady_state_touches_no_fresh_pages():
    arena, mapper, sock = pair(256 << 20)
    sent = set()
    src = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)

    def once():
        h, dst = arena.alloc(src.nbytes, "peer")
        np.copyto(dst, src)
        send(arena, sock, sent, h)
        holder = mapper.holder(h)
        total = int(np.frombuffer(holder, np.uint8)[:: 4096].sum())
        del holder, dst
        gc.collect()
        for r in mapper.take_releases():
            arena.release(r, "peer")
        return total

    once()
    once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        once()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = 5 * src.nbytes // _shm.PAGE
    assert faults < pages // 20, f"{faults} minor faults for {pages} pages moved"
    mapper.close()
    arena.close()
    sock.close()


def test_segment_larger_than_small_dev_shm():
    """A 64 MiB /dev/shm (Docker's default) in a private mount namespace: memfd is not bound by
    it, and nothing appears there."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m not permitted here: {probe.stderr.decode().strip()}")
    code = (
        "import os, numpy as np, jax.numpy as jnp, jaxtransport as jt\n"
        "st = os.statvfs('/dev/shm'); assert st.f_blocks * st.f_frsize <= 64 << 20\n"
        "if __name__ == '__main__':\n"
        "    with jt.Pool(1) as p:\n"
        "        x = jnp.ones(40 << 20, jnp.float32)\n"  # 160 MiB
        "        y = p.apply(lambda a: a * 2, (x,))\n"
        "        print('sum', float(y[::4096].sum()), os.listdir('/dev/shm'))\n"
    )
    script = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 77; "
        f"cd {ROOT} && JAX_PLATFORMS=cpu PYTHONPATH={ROOT} {sys.executable} -c \"$CODE\""
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, CODE=code), timeout=180)
    if out.returncode == 77:
        pytest.skip("mounting a tmpfs is not permitted here")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sum 20480.0 []" in out.stdout
