"""Shared memory for jaxtransport.Pool and jaxtransport.multiprocessing: recycled segments,
handles, lifetime.

Note [shared memory design]
Every process that *sends* arrays owns an :class:`Arena` (the parent for task arguments and
shared trees, each worker for its results). An arena is a set of segments (``memfd_create``
files on Linux, unlinked POSIX shared memory elsewhere: Note [segment kinds] in ``_os``) cut
into slots of a few size classes (quarter-octave steps, so at most 25% slack). A new segment's
pages are allocated up front (Note [how a segment gets its pages] in ``_os``): on Linux a full
system raises :class:`ShmCapacityError` there, never a SIGBUS later. Freed slots go back to a
per-class free list and are reused, so steady-state transfers of similar sizes touch no fresh
pages.

A memfd has no name in ``/dev/shm``: nothing can leak when any process dies, and Docker's 64 MiB
``/dev/shm`` does not bound it. A segment's fd travels once per receiver over a Unix socket
(SCM_RIGHTS, Note [message framing] in ``_os``; :func:`send_segment` / :meth:`Mapper._drain`);
the receiver maps it once (pages fault in as it reads them) and keeps the mapping. Only a small
handle ``(segment id, offset, nbytes, generation)`` travels with each message;
:meth:`Mapper.holder` validates it.

Note [slot lifetime]
A slot's references are counted per *borrower* (a queued task, a worker, a shared tree, the
sender itself). The receiver wraps each received slot in a fresh per-transfer *holder* (a ctypes
array exported from the mapping) and gives the codec ``np.frombuffer(holder)``: every numpy view
and the jax.Array that ``device_put`` makes from it (which aliases it on CPU and keeps the ndarray
alive, jax-ml/jax#37830) keep the holder alive, because a non-ndarray exporter ends numpy's base
chain. A ``weakref.finalize`` on the holder queues a "release" for the sender, which frees the
slot when the borrower's count drops to zero. So a slot is recycled only when the last array (or
numpy view) over it is gone, and never handed out twice while held; a dead borrower's counts are
dropped at once (:meth:`Arena.release_all`). Generations reject stale or doubled releases.

The modules: ``_handles`` (handles, size classes, the capacity a process may use), ``_arena``
(the sender's :class:`Arena` and passing a segment's fd), ``_mapper`` (the receiver's
:class:`Mapper`). The OS calls under them are ``jaxtransport._os``'s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._handles import (
    ALIGN,
    DEFAULT_SHM_THRESHOLD,
    MIN_CAPACITY,
    PAGE,
    SLAB,
    Handle,
    default_capacity,
    format_bytes,
    free_memory,
    size_class,
)

if TYPE_CHECKING:
    from ._arena import Arena, fd_socketpair, send_segment
    from ._mapper import Mapper, collect_deferred

# The sender's and the receiver's sides, imported on first use (PEP 562): a pool worker whose
# tasks and results need no shared memory never compiles them (Note [launch first] in
# ``jaxtransport.pool._launch``: where no ``.pyc`` is written, compiling is most of a start).
_LAZY = {
    "Arena": "._arena",
    "fd_socketpair": "._arena",
    "send_segment": "._arena",
    "Mapper": "._mapper",
    "collect_deferred": "._mapper",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ALIGN",
    "DEFAULT_SHM_THRESHOLD",
    "MIN_CAPACITY",
    "PAGE",
    "SLAB",
    "Arena",
    "Handle",
    "Mapper",
    "collect_deferred",
    "default_capacity",
    "fd_socketpair",
    "format_bytes",
    "free_memory",
    "send_segment",
    "size_class",
]
