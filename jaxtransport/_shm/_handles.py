"""Handles of slots, size classes, and how much shared memory a process may use."""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

from .. import _os
from .._copies import ALIGN
from .._errors import ShmHandleError

__all__ = [
    "ALIGN",
    "DEFAULT_SHM_THRESHOLD",
    "MIN_CAPACITY",
    "PAGE",
    "SLAB",
    "Handle",
    "default_capacity",
    "format_bytes",
    "free_memory",
    "size_class",
]

PAGE = mmap.PAGESIZE
SLAB = 2 << 20  # size classes below this share a segment of this size
# The default shm_threshold of Pool, Queue and Pipe: arrays of at least this many bytes travel
# through shared memory, smaller ones inside the pickle.
DEFAULT_SHM_THRESHOLD = 1 << 20
_MIN_CLASS = 4096


class Handle(NamedTuple):
    """A slot of a sender's arena: segment id, offset and length in it, and the slot's
    generation (a stale or doubled release names an old generation and is ignored). Travels as
    a plain tuple; :meth:`parse` validates one that arrived."""

    seg: int
    offset: int
    nbytes: int
    gen: int

    @classmethod
    def parse(cls, v: Any, what: str = "handle") -> Handle:
        """``v`` as a Handle; ShmHandleError (a CorruptTransferError's sibling: only the task
        that carried it fails) unless it is four non-negative ints."""
        if type(v) is cls:
            return v
        if isinstance(v, tuple) and len(v) == 4 and all(type(x) is int and x >= 0 for x in v):
            return cls(*v)
        raise ShmHandleError(
            f"Bad shared-memory handle {v!r} in a {what}: expected (segment, offset, nbytes, "
            "generation), four non-negative ints. The message is corrupt; only its task fails."
        )


def size_class(nbytes: int) -> int:
    """The slot size serving ``nbytes``: the next m * 2**k (m in 4..7), page-rounded."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    k = max(nbytes.bit_length() - 3, 0)
    m = -(-nbytes // (1 << k))  # ceil; 4 <= m <= 8
    cls = m << k
    return -(-cls // PAGE) * PAGE


def free_memory() -> int:
    """Bytes this process could still allocate (``_os.free_memory``: MemAvailable bounded by
    the cgroup limit on Linux, ``sysconf`` elsewhere)."""
    return _os.free_memory()


MIN_CAPACITY = 256 << 20


def default_capacity(share: float = 1.0) -> int:
    """Default cap on one sender's recycled shared memory: ``share`` of half the free memory
    (the budget of a whole pool: its senders split it), at least MIN_CAPACITY."""
    return max(int(free_memory() // 2 * share), MIN_CAPACITY)


def format_bytes(n: float) -> str:
    """``n`` bytes for an error message (``_os.format_bytes``, looked up when called: a process
    that only parses handles does not load the segments' module)."""
    return _os.format_bytes(n)
