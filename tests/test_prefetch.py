"""Small accelerator arrays of a message are fetched to the host all at once before it is pickled
(Note [fetch every leaf at once] in ``jaxtransport/_codec.py``).

This machine has no accelerator, so which leaves are started is checked with the process made
to look like it holds one (``initialized_platforms`` and ``_on_host`` replaced) and
``copy_to_host_async`` replaced by a recorder. On the chip, ``tests/test_on_device.py`` sends
many small TPU arrays through every face and checks them bit-exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _codec, _compat, _wire


@pytest.fixture
def started(monkeypatch):
    """The shapes ``copy_to_host_async`` was called on, in a process that looks as if it held
    a TPU and every jax.Array lived there."""
    calls: list[tuple] = []
    array_type = type(jnp.zeros(1))
    monkeypatch.setattr(array_type, "copy_to_host_async", lambda self: calls.append(tuple(self.shape)))
    monkeypatch.setattr(_compat, "initialized_platforms", lambda: {"tpu", "cpu"})
    monkeypatch.setattr(_codec, "_on_host", lambda a: False)
    return calls


def test_small_one_device_leaves_start_and_nothing_else(started, monkeypatch):
    cached = jnp.arange(5.0)  # one whose host copy JAX already keeps (np.asarray did it)
    monkeypatch.setattr(_compat, "cached_host_copy", lambda a: np.zeros(5) if a is cached else None)
    deleted = jnp.ones(6)
    deleted.delete()
    big = jnp.zeros((_codec.CHUNKED_MIN // 4,), jnp.float32)  # travels in pieces instead
    big_half = jnp.zeros((_codec.CHUNKED_MIN // 2,), jnp.float16)  # travels whole: fetched too
    tree = {
        "a": jnp.ones(3),
        "b": [jnp.zeros((2, 2)), np.ones(4), 7, "x"],
        "key": jax.random.key(0),  # its data is a new array at encoding
        "cached": cached,
        "deleted": deleted,
        "big": big,
        "big_half": big_half,
    }
    _codec.prefetch(tree)
    assert sorted(started) == [(2, 2), (3,), (_codec.CHUNKED_MIN // 2,)]


def test_nothing_without_an_accelerator(started, monkeypatch):
    monkeypatch.setattr(_compat, "initialized_platforms", lambda: {"cpu"})
    _codec.prefetch([jnp.ones(3)])
    monkeypatch.setattr(_compat, "initialized_platforms", lambda: None)
    _codec.prefetch([jnp.ones(3)])
    assert started == []


def test_an_object_that_does_not_flatten_is_left_to_the_pickler(started, monkeypatch):
    def refuse(obj):
        raise TypeError("no")

    monkeypatch.setattr(jax.tree, "leaves", refuse)
    _codec.prefetch([jnp.ones(3)])  # no error
    assert started == []


def test_a_failing_start_is_left_to_the_pickler(monkeypatch):
    array_type = type(jnp.zeros(1))

    def broken(self):
        raise RuntimeError("transfer refused")

    monkeypatch.setattr(array_type, "copy_to_host_async", broken)
    monkeypatch.setattr(_compat, "initialized_platforms", lambda: {"tpu"})
    monkeypatch.setattr(_codec, "_on_host", lambda a: False)
    _codec.prefetch([jnp.ones(3), jnp.ones(4)])  # no error: np.asarray raises it when pickled


@pytest.fixture
def seen(monkeypatch):
    """The objects ``_codec.prefetch`` was given."""
    got: list = []
    monkeypatch.setattr(_codec, "prefetch", got.append)
    return got


def test_every_message_path_starts_its_leaves_first(seen):
    x = jnp.arange(4.0)
    jt.dumps({"x": x})
    assert seen == [{"x": x}]
    seen.clear()
    _wire.prepare((x, 1), threshold=1 << 20)
    assert seen == [(x, 1)]
    seen.clear()
    parts = [((x,),), ((x,),)]
    _wire.prepare_calls(len, "star", parts, threshold=1 << 20)
    assert seen[0] == parts  # every chunk's leaves at once, before the first is pickled


def _first(x):
    return float(np.asarray(x)[0])


def test_a_pool_and_a_queue_send_through_prepare(seen):
    import jaxtransport.multiprocessing as jmp

    with jt.Pool(1) as pool:
        xs = [jnp.full(3, float(i)) for i in range(3)]
        assert pool.map(_first, xs) == [0.0, 1.0, 2.0]
        assert any(isinstance(obj, list) and len(obj) == 3 for obj in seen)  # the map's chunks
        seen.clear()
        handle = pool.share({"w": xs[0]})
        assert seen == [{"w": xs[0]}]
        handle.release()
    seen.clear()
    q = jmp.get_context("spawn").Queue()
    try:
        q.put(xs[1])
        assert seen == [xs[1]]
        assert float(np.asarray(q.get(timeout=60))[0]) == 1.0
    finally:
        q.close()
        q.join_thread()
