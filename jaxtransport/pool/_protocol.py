"""Every message between a Pool's parent and its workers, as named records, and their validation.

A message travels as a plain tuple ``(kind, *fields)`` pickled with the standard pickler
(protocol 5); ``kind`` is a whole word. :func:`dumps` writes a record, :func:`loads` reads one
back and validates it: the kind must be one the reader accepts and every field must have its
type, so a malformed message raises :class:`~jaxtransport.CorruptTransferError` naming what is
wrong, and the caller decides whom it fails (the task it belongs to, or the worker that sent it),
never a thread.

parent -> worker                                  worker -> parent
``Task``        run one chunk                     ``Ready``     the initializer ran (or failed)
``DefineTree``  a SharedTree, once per worker     ``Result``    one chunk's results (or error)
``DropTree``    forget a SharedTree               ``Release``   slots of the parent it dropped
``Release``     slots of the worker it dropped    ``Forget``    its segments the parent may unmap
``Forget``      segments the worker may unmap     ``Leaving``   it exits (maxtasksperchild)
``Stop``        exit now                          ``Garbled``   it received a malformed message
                                                  ``Landing``   part of a large result is in its
                                                                slot, the rest still copying

Which task a worker is running is not a message: it writes the chunk id into a shared cell
before it starts a chunk (Note [started] in ``_worker``), which the parent reads when it dies.

Entries (what a pickle's ``_entry(k)`` stands for) are the records of ``jaxtransport._entries``,
shared with ``jaxtransport.multiprocessing``; a shared-memory handle is
:class:`~jaxtransport._shm.Handle`. A message's kind is ``KIND_OF[type(msg)]``. A failed
task's error travels as an ``ErrorReport``: the pickled exception and, separately, its class
name, message and formatted traceback, so the receiver can still say what happened when the
exception itself does not unpickle there.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

from .._entries import as_int as _int
from .._entries import as_seq as _seq
from .._entries import corrupt as _bad
from .._entries import parse_handles
from .._errors import ShmHandleError
from .._nojax import PICKLE_PROTOCOL

__all__ = [
    "KIND_OF",
    "RELEASE_FLUSH_S",
    "TO_PARENT",
    "TO_WORKER",
    "DefineTree",
    "DropTree",
    "ErrorReport",
    "Forget",
    "Garbled",
    "Landing",
    "Leaving",
    "Ready",
    "Release",
    "Result",
    "Stop",
    "Task",
    "dumps",
    "loads",
]

# Timing both ends of the pipe share.
RELEASE_FLUSH_S = 0.05  # how often releases and unmapped segments are passed on


def _bytes(v: Any, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise _bad(f"{what} must be bytes, got {type(v).__name__}")
    return v


def _ints(v: Any, what: str) -> list[int]:
    return [_int(x, what) for x in _seq(v, what)]


# --------------------------------------------------------------------------------------------
# messages


class ErrorReport(NamedTuple):
    """A failure in another process: the exception pickled (may fail to unpickle here), and
    what to say when it does not."""

    exc: bytes
    type_name: str
    message: str
    traceback: str

    @classmethod
    def parse(cls, v: Any) -> ErrorReport:
        if not isinstance(v, tuple) or len(v) != 4:
            raise _bad("an error report must be a 4-tuple")
        _bytes(v[0], "pickled exception")
        if not all(isinstance(s, str) for s in v[1:]):
            raise _bad("an error report's type, message and traceback must be str")
        return cls(*v)


class Task(NamedTuple):
    chunk_id: int
    data: bytes
    entries: list
    releases: list

    @classmethod
    def check(cls, m):
        chunk_id, data, entries, releases = m
        # Inline for the common case (a call per field costs more than the task on the tiny-task
        # path); the helpers name what is wrong.
        if type(chunk_id) is not int:
            _int(chunk_id, "chunk id")
        if type(data) is not bytes:
            _bytes(data, "task pickle")
        if type(entries) is not list:
            _seq(entries, "entries")
        if type(releases) is list and not releases:
            return m  # the common case: nothing else to check
        return m._replace(releases=parse_handles(releases))


class DefineTree(NamedTuple):
    tree_id: int
    data: bytes
    entries: list

    @classmethod
    def check(cls, m):
        _int(m.tree_id, "tree id"), _bytes(m.data, "tree pickle"), _seq(m.entries, "entries")
        return m


class DropTree(NamedTuple):
    tree_id: int

    @classmethod
    def check(cls, m):
        _int(m.tree_id, "tree id")
        return m


class Release(NamedTuple):
    handles: list

    @classmethod
    def check(cls, m):
        return m._replace(handles=parse_handles(m.handles))


class Forget(NamedTuple):
    seg_ids: list

    @classmethod
    def check(cls, m):
        return m._replace(seg_ids=_ints(m.seg_ids, "segment ids"))


class Stop(NamedTuple):
    @classmethod
    def check(cls, m):
        return m


class Ready(NamedTuple):
    ok: bool
    error: Any  # ErrorReport or None

    @classmethod
    def check(cls, m):
        if type(m.ok) is not bool:
            raise _bad("ready.ok must be a bool")
        return m if m.ok else m._replace(error=ErrorReport.parse(m.error))


class Result(NamedTuple):
    """``ok``: ``data``/``entries`` encode the list of results; else ``data`` is an
    ErrorReport. ``unheld``: indices of the task's entries the worker never held (their slots
    are the parent's to release). ``seconds``: how long the chunk ran."""

    chunk_id: int
    ok: bool
    data: Any
    entries: list
    releases: list
    unheld: list
    seconds: float

    @classmethod
    def check(cls, m):
        chunk_id, ok, _data, entries, releases, unheld, seconds = m
        if type(chunk_id) is not int:
            _int(chunk_id, "chunk id")
        if type(ok) is not bool:
            raise _bad("result.ok must be a bool")
        if type(seconds) is not float:
            raise _bad("result.seconds must be a float")
        if type(entries) is not list:
            _seq(entries, "entries")
        if not releases and type(unheld) is list and not unheld:
            return m  # the common case: nothing else to check
        return m._replace(releases=parse_handles(releases), unheld=_ints(unheld, "unheld entries"))


class Landing(NamedTuple):
    """The first ``upto`` bytes of entry ``position`` (``entry``, as it will be in the result) of
    the chunk's result have landed in the worker's slot; the rest is still being copied (Note
    [a result put while it lands] in ``_codec``). The entry itself is validated where it is
    used, as the result's are."""

    chunk_id: int
    position: int
    entry: tuple
    upto: int

    @classmethod
    def check(cls, m):
        _int(m.chunk_id, "chunk id"), _int(m.position, "entry position"), _int(m.upto, "bytes landed")
        if not isinstance(m.entry, tuple):
            raise _bad(f"landing.entry must be a tuple, got {type(m.entry).__name__}")
        return m


class Leaving(NamedTuple):
    @classmethod
    def check(cls, m):
        return m


class Garbled(NamedTuple):
    """The worker received a message it could not read (it names the problem); whatever that
    message carried is lost, so the parent retires the worker."""

    description: str

    @classmethod
    def check(cls, m):
        if not isinstance(m.description, str):
            raise _bad("garbled.description must be a str")
        return m


# Each message's kind: a whole word, the first item of its tuple on the wire.
KIND_OF: dict[type, str] = {
    Task: "task",
    DefineTree: "define-tree",
    DropTree: "drop-tree",
    Release: "release",
    Forget: "forget",
    Stop: "stop",
    Ready: "ready",
    Result: "result",
    Leaving: "leaving",
    Garbled: "garbled",
    Landing: "landing",
}
TO_WORKER = {KIND_OF[c]: c for c in (Task, DefineTree, DropTree, Release, Forget, Stop)}
TO_PARENT = {KIND_OF[c]: c for c in (Ready, Result, Release, Forget, Leaving, Garbled, Landing)}


# Note [bulk bytes after the pickle]
# A task's, result's or tree's ``data`` (itself a pickle, up to the shared-memory threshold)
# of at least TRAIL_MIN bytes is not pickled into its message: the message pickles its length
# in that field and the bytes follow the pickle in the same frame (``pickle.loads`` ignores
# what follows a pickle). The sender writes the two buffers with one gathering write and the
# receiver reads ``data`` as a view of the frame, so a 300 KB task is not copied into and out
# of a second pickle on each side. ``loads`` checks the length against the frame.
TRAIL_MIN = 64 << 10


class Pieces(tuple):
    """One message as buffers to write in order, as one frame: its pickle, then its bulk bytes."""


def dumps(msg: Any) -> bytes | Pieces:
    """The wire form of a message record: ``(kind, *fields)`` pickled (Note [bulk bytes after
    the pickle] for a large ``data``)."""
    data = getattr(msg, "data", None)
    if type(data) is bytes and len(data) >= TRAIL_MIN:
        return Pieces(
            (pickle.dumps((KIND_OF[type(msg)], *msg._replace(data=len(data))), protocol=PICKLE_PROTOCOL), data)
        )
    return pickle.dumps((KIND_OF[type(msg)], *msg), protocol=PICKLE_PROTOCOL)


_tuple_new = tuple.__new__
_pickle_dumps = pickle.dumps
_TASK = KIND_OF[Task]
_RESULT = KIND_OF[Result]


def task(chunk_id: int, data: Any, entries: list, releases: list) -> bytes | Pieces:
    """``dumps(Task(chunk_id, data, entries, releases))``, without making the record (the
    dispatch of each chunk)."""
    if type(data) is bytes and len(data) < TRAIL_MIN:
        return _pickle_dumps((_TASK, chunk_id, data, entries, releases), PICKLE_PROTOCOL)
    return dumps(Task(chunk_id, data, entries, releases))


def result(
    chunk_id: int, ok: bool, data: Any, entries: list, releases: list, unheld: list, seconds: float
) -> bytes | Pieces:
    """``dumps(Result(...))``, without making the record (a worker's result of each chunk)."""
    if type(data) is bytes and len(data) < TRAIL_MIN:
        return _pickle_dumps((_RESULT, chunk_id, ok, data, entries, releases, unheld, seconds), PICKLE_PROTOCOL)
    return dumps(Result(chunk_id, ok, data, entries, releases, unheld, seconds))


def loads(raw: bytes, table: dict) -> tuple:
    """Read and validate one message of a kind in ``table`` (TO_WORKER or TO_PARENT).

    Raises CorruptTransferError for anything else: bytes that do not unpickle, an unknown kind,
    a wrong number of fields or a field of the wrong type."""
    try:
        msg = pickle.loads(raw)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupt message
        raise _bad(f"it does not unpickle ({type(e).__name__}: {e})") from None
    if not isinstance(msg, tuple) or not msg or not isinstance(msg[0], str):
        raise _bad(f"expected a tuple (kind, ...), got {type(msg).__name__}")
    cls = table.get(msg[0])
    if cls is None:
        raise _bad(f"unknown kind {msg[0]!r} (expected one of {sorted(table)})")
    if len(msg) - 1 != len(cls._fields):
        raise _bad(f"{msg[0]!r} needs {len(cls._fields)} fields, got {len(msg) - 1}")
    rec = _tuple_new(cls, msg[1:])  # cls._make without its length check (done above)
    if type(getattr(rec, "data", None)) is int:  # the bytes that end the frame
        n = rec.data
        if not 0 <= n <= len(raw):
            raise _bad(f"{msg[0]!r} says {n} bytes follow its pickle in a frame of {len(raw)}")
        rec = rec._replace(data=memoryview(raw)[len(raw) - n :])
    try:
        return cls.check(rec)
    except ShmHandleError as e:
        raise _bad(str(e)) from None
