"""The parent's jax.Arrays already copied into its arena, kept so that sending one again goes by
handle (Note [the same array again]).

Note [the same array again]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
jax.Arrays are immutable, so once the parent has copied one into a slot of its arena, a later
task, map or SharedTree that sends the *same* array (a learner's parameters passed to every
``apply_async``) can name that slot instead of copying again. ``pin`` keeps the slot (one
reference of the borrower ``PIN``) while the array lives: a weak reference's callback queues the
release when it dies (``Arena.defer_release``: no lock from a callback). ``find`` gives the
recorded entry with a new reference for the task's borrower, if the slot is still live
(``Arena.acquire`` checks the generation, so a slot recycled since is never named). Pinned
memory is bounded by half the arena's capacity, oldest dropped first, and every pin is dropped
as soon as a caller waits for memory (``drop_all``). A deleted (donated) array is never sent
from its old slot; an array that is a worker's result is forwarded, not pinned (Note [a result
sent on] in ``_engine``). ``Pool.share`` does not pin what it copies, so that ``release()``
gives a SharedTree's memory back while the caller keeps the tree; it does take a reference on
a slot a task pinned before.

``Pins.lock`` guards the books only: nothing is called with it held (the arena is called after
it is released), and it is taken with no other lock held.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

from .. import _lockorder
from .._shm import Arena, Handle

PIN = "pin"  # the borrower whose references keep pinned slots


def _died(dead: collections.deque, arena: Arena, key: int, handle: Handle, _ref: Any) -> None:
    # A weakref callback, in any thread: atomic operations only.
    dead.append(key)
    arena.defer_release(handle, PIN)


class Pins:
    def __init__(self, arena: Arena):
        self.arena = arena
        self.lock = _lockorder.lock("Pins.lock")
        self.pins: dict[int, tuple[weakref.ref, Handle, tuple, int]] = {}  # id -> (ref, handle, entry, bytes)
        self.bytes = 0
        self.dead: collections.deque = collections.deque()

    def find(self, x: Any, borrower: Any) -> tuple[tuple, Handle] | None:
        """``(entry, handle)`` naming the slot ``x`` was copied into, with a reference for
        ``borrower``, when ``x`` is a live pinned jax.Array whose slot is still live; else None."""
        rec = self.pins.get(id(x))
        if rec is None or rec[0]() is not x:
            return None
        array: Any = x
        try:
            if array.is_deleted():
                return None  # donated: encoding it raises, as for any deleted array
        except Exception:  # noqa: BLE001 - not a jax.Array after all
            return None
        _ref, handle, entry, _n = rec
        if not self.arena.acquire(handle, borrower):
            return None
        return entry, handle

    def pin(self, x: Any, entry: tuple, handle: Handle) -> None:
        """Keep the slot ``handle`` (which ``entry`` names) while the jax.Array ``x`` lives."""
        nbytes = handle.nbytes
        budget = self.arena.capacity // 2
        rec = self.pins.get(id(x))
        if nbytes > budget or (rec is not None and rec[0]() is x):
            return
        try:
            ref = weakref.ref(x, functools.partial(_died, self.dead, self.arena, id(x), handle))
        except TypeError:
            return
        if not self.arena.acquire(handle, PIN):
            return
        dropped = []
        with self.lock:
            self._forget_dead()
            while True:  # not `while <test>:` (Note [loops that end in a test])
                if not (self.pins and self.bytes + nbytes > budget):
                    break
                dropped.append(self._unpin(next(iter(self.pins))))
            old = self.pins.get(id(x))
            if old is not None:
                dropped.append(self._unpin(id(x)))
            self.pins[id(x)] = (ref, handle, entry, nbytes)
            self.bytes += nbytes
        self._release(dropped)

    def drop_all(self) -> None:
        """Drop every pin (a caller waits for memory): arrays sent again are copied again."""
        if not self.pins:
            return
        with self.lock:
            self._forget_dead()
            dropped = [self._unpin(key) for key in list(self.pins)]
        self._release(dropped)

    def _forget_dead(self) -> None:
        # Lock held. Their releases were queued by ``_died``.
        while self.dead:
            try:
                key = self.dead.popleft()
            except IndexError:
                return
            rec = self.pins.get(key)
            if rec is not None and rec[0]() is None:
                del self.pins[key]
                self.bytes -= rec[3]

    def _unpin(self, key: int) -> Handle | None:
        # Lock held: the handle whose PIN reference to release once it is not.
        ref, handle, _entry, nbytes = self.pins.pop(key)
        self.bytes -= nbytes
        if ref() is None:
            return None  # its release is queued already
        # The weak reference goes with the record, and its callback with it: the release is ours.
        return handle

    def _release(self, handles: list) -> None:
        for h in handles:
            if h is not None:
                self.arena.release(h, PIN)
