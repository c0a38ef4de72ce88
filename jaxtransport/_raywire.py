"""What ``jaxtransport.ray``'s serializer and deserializer do to a ``jax.Array``, without Ray.

:mod:`jaxtransport.ray` registers thin wrappers of these with Ray (its ``_serialize`` and
``_deserialize``: the deserializer's import path is part of Ray's wire format, so it stays
there). Kept apart from Ray so that they can be called, and timed, in a process where Ray
cannot be imported or started (``benchmarks/device.py`` on an accelerator host).
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import jax

from . import _codec
from ._pickling import raw


def serialize(x: Any) -> tuple:
    """(meta, raw buffers...) for Ray's pickler; copies nothing on CPU (a large array on an
    accelerator comes over in pieces fetched at once, one buffer each: ``_codec``'s Note
    [pickled in pieces]). Each raw buffer is
    ``_pickling.raw``'s wrapper, which pickles as a ``PickleBuffer`` under protocol 5 (Ray's):
    out-of-band, and independent of numpy's own pickling (whose paths differ across numpy
    1 and 2, which a heterogeneous cluster may mix)."""
    meta, buffers = _codec.encode(x)
    return (tuple(meta), *[raw(b) for b in buffers])


def deserialize(payload: tuple, placement: str) -> Any:
    """Rebuild an array from :func:`serialize`'s payload with ``placement``; a jax.Array gets
    Note [prompt release]."""
    meta, *buffers = payload
    out = _codec.decode(meta, buffers, placement)
    if isinstance(out, jax.Array):
        _release_promptly(out)
    return out


# --------------------------------------------------------------------------------------------
# Note [prompt release]
#
# When a jax.Array that aliases a host buffer dies, jaxlib drops its reference to that buffer
# (here: Ray's view of the plasma object) from a runtime thread, which cannot take the GIL, so
# the decref is queued until the process's next JAX call or gc.collect(). A Ray worker that
# received a large argument and then sits idle (or runs tasks that do not touch JAX) would keep
# the object pinned in the object store indefinitely - measured: 64 MiB stayed "in use" after
# the task and the driver's ref were gone, until the worker's next JAX call. So every array we
# decode gets a ``weakref.finalize`` that wakes one daemon thread, which drains jaxlib's queue a
# moment later, and again with back-off (the runtime thread may enqueue after the callback,
# late on a loaded machine). The callback only
# puts a token on a SimpleQueue (reentrant, so safe from a callback that a garbage collection
# runs in any thread, even the reaper itself). The thread exists only in processes that
# decoded an array through Ray, blocks on the queue otherwise, and dies with the process.
# Cost: a few microseconds per decoded array, four short GIL acquisitions per burst of deaths.

_reaper_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in weakref callbacks
_reaper: threading.Thread | None = None
_reaper_lock = threading.RLock()
# Seconds between drains after a death: soon, then backing off, because on a loaded machine the
# runtime thread may queue the decref well after the array died (cumulative ~2.6 s).
_REAP_DELAYS = (0.005, 0.05, 0.5, 2.0)


def _collect_jax_garbage() -> None:
    from ._compat import collect_jax_garbage  # jaxlib's private hook, probed there

    collect_jax_garbage()


def _reap_forever() -> None:
    while True:
        _reaper_queue.get()  # an array died
        step = 0
        while step < len(_REAP_DELAYS):
            try:
                _reaper_queue.get(timeout=_REAP_DELAYS[step])
            except queue.Empty:
                _collect_jax_garbage()
                step += 1
            else:  # another one died: drain for the earlier ones, restart the schedule
                _collect_jax_garbage()
                step = 0


def _release_promptly(out: Any) -> None:
    global _reaper
    weakref.finalize(out, _reaper_queue.put, None).atexit = False
    if _reaper is None:
        with _reaper_lock:
            if _reaper is None:
                _reaper = threading.Thread(target=_reap_forever, name="jaxtransport-ray-release", daemon=True)
                _reaper.start()
