"""``jaxtransport.data``: input pipelines for JAX training loops, a thin layer over ``jaxtransport.Pool``.

    from jaxtransport.data import Loader

    with Loader(paths, decode, batch_size=256, seed=0, shuffle=True, drop_remainder=True,
                workers=12, sharding=mesh, data_axis="data") as loader:
        for epoch in range(3):
            for batch in loader:          # one epoch, ordered, already on the devices
                state = train_step(state, batch)

A worker reads ``source[i]`` and runs ``transform(example, rng)`` on it (or ``batch_transform``
on a whole batch); the batch comes back through the Pool's recycled shared memory and is put on
the device (sharded over a mesh's data axis when asked) by a thread of the loader, a bounded
number of batches ahead of the loop. Batches are the same whatever the number of workers: the
order comes from ``(seed, epoch)`` and each example's random numbers from ``(seed, epoch,
index)``. The guide is ``docs/guides/input-pipelines.md``.

Importing this package imports numpy, neither JAX nor the Pool (``Loader`` imports them when one
is made); a worker imports ``jaxtransport.data._worker``, numpy only.
"""

from ._loader import Loader

__all__ = ["Loader"]
