"""Where a Loader's batches land: the default device, or a sharding (a ``NamedSharding`` over a
mesh's data axis, any ``jax.sharding.Sharding``), and the checks made before any worker starts.

A batch arrives as numpy arrays over the Pool's shared memory (the Pool runs with placement
"host"). Each leaf is then put:
- with no sharding: as the Pool's own results land (``_codec._put``): on the default device,
  uncommitted; on an accelerator a large leaf goes in pieces at once and is joined there (Note
  [host to device in pieces] in ``_codec``); on the CPU the array aliases the shared memory (no
  copy), which returns to the worker when the batch is gone;
- on a sharding with one device: the same pieces, on that device, with that sharding;
- on any other sharding: ``jax.device_put(leaf, sharding)`` (each device gets its shard).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from .. import _codec


def resolve(sharding: Any, data_axis: Any) -> Any:
    """The ``jax.sharding.Sharding`` for ``Loader(sharding=, data_axis=)``: a Mesh becomes a
    NamedSharding over ``data_axis`` (the mesh's only axis when it has one); None stays None."""
    if sharding is None:
        if data_axis is not None:
            raise ValueError("data_axis= names an axis of a mesh: pass the mesh too (sharding=mesh).")
        return None
    if isinstance(sharding, jax.sharding.Mesh):
        names = tuple(sharding.axis_names)
        if data_axis is None:
            if len(names) != 1:
                raise ValueError(
                    f"The mesh has axes {names}: say which one(s) the batch is split over, e.g. "
                    f"data_axis={names[0]!r} (or a tuple of axes)."
                )
            data_axis = names[0]
        for axis in data_axis if isinstance(data_axis, tuple) else (data_axis,):
            if axis not in names:
                raise ValueError(f"data_axis={data_axis!r}: the mesh has no axis {axis!r} (its axes: {names}).")
        return jax.sharding.NamedSharding(sharding, jax.sharding.PartitionSpec(data_axis))
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"sharding= takes a jax.sharding.Mesh (with data_axis=) or a jax.sharding.Sharding, got "
            f"{type(sharding).__name__}."
        )
    if data_axis is not None:
        raise ValueError("data_axis= goes with a Mesh; a Sharding already says how the batch is split.")
    return sharding


def batch_splits(sharding: Any) -> int:
    """How many parts a batch's first axis is split into by ``sharding`` (1 when not split, or
    when the sharding does not say)."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not len(sharding.spec):
        return 1
    first = sharding.spec[0]
    if first is None:
        return 1
    axes = first if isinstance(first, tuple) else (first,)
    return math.prod(sharding.mesh.shape[a] for a in axes)


def check(sharding: Any, sizes: set[int]) -> None:
    """Refuse, before any worker starts, a sharding this process cannot fill or a batch size it
    cannot split evenly (``sizes``: the batch sizes an epoch has)."""
    if sharding is None:
        return
    if not sharding.is_fully_addressable:
        raise ValueError(
            "The sharding spans devices of other processes (a multi-host mesh): a Loader puts whole "
            "batches from this process only. Give it this process's devices (a mesh of "
            "jax.local_devices()) and assemble the global batch with "
            "jax.make_array_from_process_local_data."
        )
    parts = batch_splits(sharding)
    for size in sorted(sizes):
        if size % parts:
            raise ValueError(
                f"A batch of {size} examples cannot be split evenly over {parts} devices of the data axis. "
                "Choose a batch_size that is a multiple of it; for the last, shorter batch of an epoch, "
                "drop_remainder=True (or a dataset size whose remainder is a multiple)."
            )


def put(tree: Any, sharding: Any) -> Any:
    """``tree`` (numpy leaves) on the device(s), as the module docstring says."""
    if sharding is None:
        return jax.tree.map(_default, tree)
    devices = sharding.device_set
    if len(devices) == 1:
        (device,) = devices
        return jax.tree.map(lambda a: _one_device(a, device, sharding), tree)
    return jax.device_put(tree, sharding)


def _default(a: np.ndarray) -> Any:
    return _codec._put(np.ascontiguousarray(a), False)


def _one_device(a: np.ndarray, device: Any, sharding: Any) -> Any:
    a = np.ascontiguousarray(a)
    count = _codec._pieces_for(a.nbytes, a.dtype, device.platform)
    if not count:
        return jax.device_put(a, sharding)
    out = _codec._put_parts([a], a.shape, a.dtype, False, count, lambda: a, device=device)
    return jax.device_put(out, sharding)  # the same device: no copy, the sharding asked for
