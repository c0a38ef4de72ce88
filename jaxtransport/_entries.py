"""What a pickle's ``_entry(k)`` stands for (``_wire``), as named records, and their validation.

An entry travels as a plain tuple ``(kind, *fields)`` inside a message (a Pool's task or result,
a ``jaxtransport.multiprocessing`` packet) and is read back here with :func:`parse_entry`:

``NpEntry``   a numpy array in the sender's slot
``JaxEntry``  a jax.Array: codec metadata and the layout of its buffers, all in one slot
``RefEntry``  an array that lives in a slot of the *receiver's* own arena (sent back unchanged)
``TreeEntry`` a SharedTree, defined once per worker

A shared-memory handle is :class:`~jaxtransport._shm.Handle`. Anything malformed raises
:class:`~jaxtransport.CorruptTransferError` naming what is wrong. The validators here
(:func:`corrupt`, :func:`as_int`, :func:`as_seq`, :func:`parse_handles`) are also those of the
Pool's messages (``pool/_protocol``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._errors import CorruptTransferError
from ._shm import Handle

__all__ = [
    "JaxEntry",
    "NpEntry",
    "RefEntry",
    "TreeEntry",
    "as_int",
    "as_seq",
    "corrupt",
    "parse_entry",
    "parse_handles",
]


def corrupt(what: str) -> CorruptTransferError:
    """The error for a malformed message or entry, saying ``what`` is wrong."""
    return CorruptTransferError(f"Corrupt pool message: {what}")


def as_int(v: Any, what: str) -> int:
    """``v`` when it is exactly an int, else the error naming ``what``."""
    if type(v) is not int:
        raise corrupt(f"{what} must be an int, got {type(v).__name__}")
    return v


def as_seq(v: Any, what: str) -> tuple | list:
    """``v`` when it is a tuple or list, else the error naming ``what``."""
    if not isinstance(v, (tuple, list)):
        raise corrupt(f"{what} must be a list, got {type(v).__name__}")
    return v


def parse_handles(v: Any, what: str = "releases") -> list[Handle]:
    """A list of handles, each validated (see ``Handle.parse``)."""
    return [Handle.parse(h, what) for h in as_seq(v, what)]


class NpEntry(NamedTuple):
    """A numpy array of ``dtype``/``shape`` in the sender's slot ``handle``."""

    dtype: Any
    shape: tuple
    handle: Handle


class JaxEntry(NamedTuple):
    """A jax.Array: codec metadata and ``layout`` ((offset, nbytes) per buffer) in one slot."""

    meta: tuple
    layout: tuple
    handle: Handle


class RefEntry(NamedTuple):
    """An array that lives in the *receiver's* own slot ``handle`` (sent back unchanged)."""

    sub: str  # "np" or "jax"
    info: Any  # (dtype, shape) for "np", the codec metadata for "jax"
    handle: Handle


class TreeEntry(NamedTuple):
    """A SharedTree, defined once per worker by the Pool's ``DefineTree``."""

    tree_id: int


def _shape(v: Any) -> tuple:
    if not isinstance(v, tuple) or any(type(d) is not int or d < 0 for d in v):
        raise corrupt(f"array shape must be a tuple of non-negative ints, got {v!r}")
    return v


def parse_entry(e: Any) -> NpEntry | JaxEntry | RefEntry | TreeEntry:
    """One wire entry as its record; CorruptTransferError when malformed."""
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str):
        raise corrupt(f"an entry must be a tuple (kind, ...), got {type(e).__name__}")
    kind, fields = e[0], e[1:]
    if kind == "np" and len(fields) == 3:
        return NpEntry(fields[0], _shape(fields[1]), Handle.parse(fields[2], "array entry"))
    if kind == "jax" and len(fields) == 3:
        layout = as_seq(fields[1], "buffer layout")
        for pair in layout:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise corrupt(f"buffer layout entries must be (offset, nbytes), got {pair!r}")
            as_int(pair[0], "buffer offset"), as_int(pair[1], "buffer size")
        return JaxEntry(as_seq(fields[0], "array metadata"), tuple(layout), Handle.parse(fields[2], "array entry"))  # type: ignore[arg-type]
    if kind == "ref" and len(fields) == 3 and fields[0] in ("np", "jax"):
        info = fields[1]
        if fields[0] == "np" and not (isinstance(info, tuple) and len(info) == 2):
            raise corrupt(f"a returned numpy array needs (dtype, shape), got {info!r}")
        if fields[0] == "np":
            info = (info[0], _shape(info[1]))
        return RefEntry(fields[0], info, Handle.parse(fields[2], "returned array"))
    if kind == "tree" and len(fields) == 1:
        return TreeEntry(as_int(fields[0], "tree id"))
    raise corrupt(f"unknown entry {kind!r} with {len(fields)} fields")
