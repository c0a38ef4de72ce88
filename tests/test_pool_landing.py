"""A Pool worker's large result is put on the parent's device while the worker still copies it
into its slot (Note [a result put while it lands] in ``_codec``): the worker says how far the
array has landed (``Landing`` messages), the parent's manager puts those pieces, and the
result's decode takes them. Here the parent plays an accelerator (``_codec._default_platform``
says "tpu": the pieces path runs on the CPU; tests/test_on_device.py runs the real thing): the
values stay bit-exact for each piece type, every early piece is used, a CPU parent puts nothing
early, and a worker that dies, fails or is stopped between two landings loses only its own task
and never hangs the pool (the conftest fixture checks /dev/shm and child processes)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal

import ml_dtypes
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import WorkerLostError, _codec, _copies
from jaxtransport.pool import _protocol

from .conftest import wait_until

pytestmark = [pytest.mark.shm, pytest.mark.timeout(180)]

METHODS = ["spawn", "forkserver"]
BIG = _codec.LANDING_MIN + (1 << 20)  # bytes: one landing per quarter
DTYPES = ["float32", "int8", "uint16", "int32"]  # the types that go to a device in pieces


# --------------------------------------------------------------------------------------------
# tasks (module level: spawned workers import them)


def expected(nbytes: int, i: int, dtype: str) -> np.ndarray:
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    n = nbytes // dt.itemsize
    return ((np.arange(n) % 97) + i).astype(dt)


def make(nbytes: int, i: int, dtype: str):
    """The worker's result: a new jax.Array of ``nbytes`` (``expected``'s values)."""
    import jax.numpy as jnp

    return jnp.asarray(expected(nbytes, i, dtype))


def _patch_landing(after_first) -> None:
    """In this worker, copy the next landing array's first quarter, say so, then
    ``after_first()``, then copy the rest (once: the original comes back)."""
    original = _copies.copy_landing

    def copy_landing(src, dst, groups, landed):
        _copies.copy_landing = original
        step = -(-src.nbytes // groups)
        _copies.copy_bytes(src[:step], dst[:step])
        landed(step)
        after_first()
        _copies.copy_bytes(src[step:], dst[step:])

    _copies.copy_landing = copy_landing


def make_then_die(nbytes: int):
    _patch_landing(lambda: os._exit(3))
    return make(nbytes, 0, "float32")


def make_then_fail(nbytes: int):
    def fail():
        raise RuntimeError("the copy broke after the first landing")

    _patch_landing(fail)
    return make(nbytes, 0, "float32")


def make_then_stop(nbytes: int, path: str):
    def stop():
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)

    _patch_landing(stop)
    return make(nbytes, 5, "float32")


def square(x):
    return x * x


# --------------------------------------------------------------------------------------------
# the parent as an accelerator, with what the manager put early counted


class Counts:
    def __init__(self):
        self.early = 0  # pieces put while the worker copied
        self.taken = 0  # of those, pieces the decode took from the cache


@pytest.fixture
def accelerator(monkeypatch) -> Counts:
    counts = Counts()
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    put_landed, put_pieces = _codec.put_landed, _codec._put_pieces

    def counted_put_landed(pieces, cache):
        counts.early += len(pieces)
        return put_landed(pieces, cache)

    def counted_put_pieces(pieces, device):
        cache = getattr(_codec._landed, "cache", None)
        before = len(cache) if cache else 0
        try:
            return put_pieces(pieces, device)
        finally:
            counts.taken += before - (len(cache) if cache else 0)

    monkeypatch.setattr(_codec, "put_landed", counted_put_landed)
    monkeypatch.setattr(_codec, "_put_pieces", counted_put_pieces)
    return counts


def same(got, want: np.ndarray) -> bool:
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


# --------------------------------------------------------------------------------------------
# through the Pool


@pytest.mark.parametrize("start_method", METHODS)
def test_a_large_result_is_put_on_the_device_while_the_worker_copies_it(start_method, accelerator):
    with jt.Pool(1, start_method=start_method) as pool:
        for i, dtype in enumerate(DTYPES):
            early = accelerator.early
            got = pool.apply(make, (BIG, i, dtype))
            assert same(got, expected(BIG, i, dtype)), dtype
            assert accelerator.early > early, f"{dtype}: nothing was put while it landed"
            del got
        # A type that goes to a device whole (Note [host to device in pieces]) lands unannounced.
        early = accelerator.early
        got = pool.apply(make, (BIG, 4, "bfloat16"))
        assert same(got, expected(BIG, 4, "bfloat16")) and accelerator.early == early
        del got
        # The slot again (recycled), and two results of one map (two landing arrays).
        a, b = pool.starmap(make, [(BIG, 7, "float32"), (BIG, 8, "float32")])
        assert same(a, expected(BIG, 7, "float32")) and same(b, expected(BIG, 8, "float32"))
        del a, b
    assert accelerator.taken == accelerator.early  # the decode took every piece put early


def test_a_cpu_parent_puts_nothing_early_and_a_small_result_sends_no_landing(accelerator, monkeypatch):
    with jt.Pool(1) as pool:
        small = pool.apply(make, (4 << 20, 1, "float32"))  # below LANDING_MIN, on "tpu"
        assert same(small, expected(4 << 20, 1, "float32")) and accelerator.early == 0
        monkeypatch.setattr(_codec, "_default_platform", lambda: "cpu")
        got = pool.apply(make, (BIG, 2, "bfloat16"))
        assert same(got, expected(BIG, 2, "bfloat16")) and accelerator.early == 0
        del small, got


@pytest.mark.slow
def test_a_pool_with_host_placement_puts_nothing_early(accelerator):
    with jt.Pool(1, placement="host") as pool:
        got = pool.apply(make, (BIG, 3, "int8"))
        assert isinstance(got, np.ndarray) and same(got, expected(BIG, 3, "int8"))
        assert accelerator.early == 0
        del got


@pytest.mark.parametrize("start_method", METHODS)
def test_a_worker_that_dies_between_two_landings_loses_only_its_task(start_method, accelerator):
    with jt.Pool(1, start_method=start_method) as pool:
        with pytest.raises(WorkerLostError):
            pool.apply(make_then_die, (BIG,))
        assert accelerator.early > 0  # it had landed a part, which the parent put
        got = pool.apply(make, (BIG, 4, "float32"))  # the replacement's result, whole
        assert same(got, expected(BIG, 4, "float32"))
        del got


def test_a_result_that_fails_after_a_landing_raises_its_error_and_frees_its_slot(accelerator):
    with jt.Pool(1) as pool:
        for _ in range(2):  # the slot of the failed result is free for the next one
            with pytest.raises(RuntimeError, match="the copy broke after the first landing"):
                pool.apply(make_then_fail, (BIG,))
            got = pool.apply(make, (BIG, 6, "uint16"))
            assert same(got, expected(BIG, 6, "uint16"))
            del got


def test_a_worker_stopped_between_two_landings_holds_up_only_its_own_result(accelerator, tmp_path):
    path = str(tmp_path / "pid")
    with jt.Pool(2) as pool:
        stopped = pool.apply_async(make_then_stop, (BIG, path))
        assert wait_until(lambda: os.path.exists(path) and os.path.getsize(path) > 0, 60)
        pid = int(open(path).read())
        try:
            assert wait_until(lambda: accelerator.early > 0, 30)  # its first part was put
            with pytest.raises(multiprocessing.TimeoutError):
                stopped.get(0.5)
            assert pool.apply(square, (7,)) == 49  # the other worker goes on
        finally:
            os.kill(pid, signal.SIGCONT)
        assert same(stopped.get(60), expected(BIG, 5, "float32"))


# --------------------------------------------------------------------------------------------
# the parts, without processes


def test_the_pieces_put_early_are_the_ones_the_decode_puts(monkeypatch):
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    import jax

    want = expected(BIG, 9, "uint16")
    meta, _ = _codec.encode(jax.numpy.asarray(want))
    raw = np.empty(want.nbytes + 64, np.uint8)[64:]  # any host memory holding the bytes
    raw[:] = want.view(np.uint8)
    pieces = _codec.landing_pieces(tuple(meta), raw)
    assert len(pieces) >= 2 and sum(p.nbytes for p in pieces) == want.nbytes
    cache: dict = {}
    _codec.put_landed(pieces[:-1], cache)  # all but the last landed
    with _codec.landed(cache):
        got = _codec.decode(tuple(meta), [raw], "device")
    assert same(got, want) and not cache  # each early piece taken once
    # Other memory with the same bytes matches nothing: its pieces are put afresh.
    other = raw.copy()
    _codec.put_landed(_codec.landing_pieces(tuple(meta), raw), cache)
    with _codec.landed(cache):
        assert same(_codec.decode(tuple(meta), [other], "device"), want)
    assert len(cache) == len(pieces)


def test_a_cpu_receiver_or_a_small_array_has_no_pieces_to_put_early(monkeypatch):
    import jax

    x = jax.numpy.zeros(BIG // 4, jax.numpy.float32)
    meta, bufs = _codec.encode(x)
    assert _codec.landing_pieces(tuple(meta), bufs[0]) == []  # on the CPU: aliased, not put
    monkeypatch.setattr(_codec, "_default_platform", lambda: "tpu")
    meta, bufs = _codec.encode(jax.numpy.zeros(1024, jax.numpy.float32))
    assert _codec.landing_pieces(tuple(meta), bufs[0]) == []


def test_a_landing_copy_says_how_far_it_has_landed_and_copies_everything():
    src = np.random.default_rng(0).integers(0, 256, 10_000_003, np.uint8)
    dst = np.zeros_like(src)
    seen: list = []

    def landed(upto):
        assert dst[:upto].tobytes() == src[:upto].tobytes()
        seen.append(upto)

    _copies.copy_landing(src, dst, 4, landed)
    assert np.array_equal(src, dst)
    assert seen == sorted(seen) and len(seen) == 3 and seen[-1] < src.nbytes
    seen.clear()
    _copies.copy_landing(src[:3], dst[:3], 8, landed)  # fewer bytes than parts
    assert seen == [1, 2]


def test_a_landing_message_is_checked_like_every_other():
    entry = ("jax", (1,), ((0, 8),), (0, 0, 64, 1))
    raw = _protocol.dumps(_protocol.Landing(3, 0, entry, 32))
    assert _protocol.loads(raw, _protocol.TO_PARENT) == _protocol.Landing(3, 0, entry, 32)
    for bad in ((3, 0, "not a tuple", 32), ("3", 0, entry, 32), (3, 0, entry, 1.5), (3, None, entry, 32)):
        with pytest.raises(jt.CorruptTransferError):
            _protocol.loads(pickle.dumps(("landing", *bad)), _protocol.TO_PARENT)
    with pytest.raises(jt.CorruptTransferError):  # a parent never sends one
        _protocol.loads(raw, _protocol.TO_WORKER)
