"""What a Loader's batches hold, from the seed alone (numpy only: the parent and the workers).

Note [the same batches whatever the workers]
Nothing here depends on which worker runs a batch, or how many there are:
- the examples of epoch ``e``, in order: ``range(n)``, or its permutation by a generator keyed
  by ``(seed, SHUFFLE, e)``; batch ``k`` is positions ``[k * batch_size, (k + 1) * batch_size)``
  of that order (the last one shorter unless ``drop_remainder``);
- the random numbers a per-example ``transform`` gets for source index ``i`` in epoch ``e``: a
  ``numpy.random.Generator`` over Philox keyed by ``(seed, EXAMPLE, e, i)`` (the same example
  gets new numbers each epoch, the same ones in every run); a ``batch_transform`` gets one keyed
  by ``(seed, BATCH, e, k)``.
The keys are ``numpy.random.SeedSequence(seed, spawn_key=...)``: independent streams by
construction, and the ``spawn_key`` of each use starts with its own tag, so no two uses share a
stream. A record is ``source[i]`` with ``i`` the index in the order, read in the worker.
"""

from __future__ import annotations

import numpy as np

SHUFFLE, EXAMPLE, BATCH = 0, 1, 2


def generator(seed: int, *key: int) -> np.random.Generator:
    """A Philox generator for the stream ``key`` of ``seed``."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(seed, spawn_key=key)))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The source indices of epoch ``epoch``, in the order they are batched."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return generator(seed, SHUFFLE, epoch).permutation(n)


def batches_per_epoch(n: int, batch_size: int, drop_remainder: bool) -> int:
    return n // batch_size if drop_remainder else -(-n // batch_size)
