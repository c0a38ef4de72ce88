"""``SharedTree`` and the lifetime of shared trees.

A tree's arrays sit in the parent's arena under the borrower ``("tree", id)``; each worker that
received the tree holds one reference per slot under its own key (``lend``), dropped when the
worker drops its copy (``DropTree``) and its arrays die, or when the worker dies. A tree is
*freed* -- its own references dropped, workers told -- once it is released (``release()``, its
``with`` block, or garbage collection) and no submitted task uses it any more. Garbage collection
only queues the release (a finalizer may run in a thread that holds the engine's lock); the
manager thread applies it.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any

from .. import _shm
from .._errors import PoolStateError
from . import _protocol


class TreeRec:
    __slots__ = ("enc", "freed", "key", "nbytes", "owner", "released", "tree_id", "users", "workers")

    def __init__(self, tree_id: int, owner: Any):
        self.tree_id = tree_id
        self.key = ("tree", tree_id)
        self.owner = owner  # the engine: a tree only travels with its own pool's tasks
        self.enc: Any = None
        self.users = 0  # submitted chunks not finished
        self.released = self.freed = False
        self.workers: set = set()  # keys of the workers that have it
        self.nbytes = 0


class SharedTree:
    """A pytree whose arrays were copied once into a Pool's shared memory (``Pool.share``).

    Pass it anywhere inside task arguments, to any number of tasks: only a small id travels, and
    in the worker it unpickles as the tree itself, as if freshly received: each message (a task,
    or one chunk of ``map``'s tasks) gets its own containers and its own ``jax.Array`` and numpy
    leaves, read-only, over the one shared copy (on CPU no copy at all; an accelerator gets a
    host-to-device copy per message). So a task that donates a leaf (``jax.jit(...,
    donate_argnums=...)``) or changes the tree's dicts and lists affects no other task; within
    one message the tree is one object wherever it appears, as pickle makes it. Each worker
    maps the memory and checks the tree once, until :meth:`release` or pool close; a message
    then costs one ``device_put`` per jax.Array leaf (~10-25 us on CPU) and the unpickling of
    the leaves below ``shm_threshold``.
    The memory is freed when it is released and every worker has dropped it. Also a context
    manager (releases on exit) and released automatically when garbage-collected.

    Attributes: ``tree`` (the parent's original tree), ``nbytes`` (bytes in shared memory).
    """

    def __init__(self, book: TreeBook, rec: TreeRec, tree: Any):
        self._book = book
        self._rec = rec
        self._tree_id = rec.tree_id
        self.tree = tree
        self._finalizer = weakref.finalize(self, book.queue_release, rec)

    @property
    def tree_id(self) -> int:
        """The small id that travels in place of the tree (unique within its pool)."""
        return self._tree_id

    @property
    def nbytes(self) -> int:
        return self._rec.nbytes

    @property
    def released(self) -> bool:
        return self._rec.released

    def release(self) -> None:
        """Stop using this tree: workers drop their mapping of it, and the shared memory is freed
        once every worker has dropped its arrays. Tasks already submitted still see it.
        Calling it again is harmless."""
        if self._finalizer.detach() is not None:
            self._book.release(self._rec)

    def __enter__(self) -> SharedTree:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __reduce__(self):
        raise PoolStateError(
            "A SharedTree only travels as (part of) an argument of its own jaxtransport.Pool's "
            "tasks; it cannot be pickled otherwise. Pass shared.tree to send the tree itself."
        )

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"<jaxtransport.SharedTree {self._tree_id} ({_shm.format_bytes(self.nbytes)} shared, {state})>"


class TreeBook:
    """The engine's shared trees. Methods marked "lock held" run under the engine's lock."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.recs: dict[int, TreeRec] = {}
        self.ids = itertools.count(1)
        self.collected: collections.deque = collections.deque()  # released by the GC

    def new(self) -> TreeRec:
        return TreeRec(next(self.ids), self.engine)

    def add(self, rec: TreeRec) -> None:
        with self.engine.lock:
            self.recs[rec.tree_id] = rec

    def check_usable(self, trees) -> None:
        for tree in trees:
            if tree._rec.owner is not self.engine:
                raise PoolStateError(f"{tree!r} belongs to another jaxtransport.Pool; share() it with this pool.")
            if tree._rec.released:
                raise PoolStateError(f"{tree!r} was released; share() the tree again to use it in new tasks.")

    def use(self, trees) -> None:
        """Lock held: a chunk using these trees was submitted."""
        for tree in trees:
            tree._rec.users += 1

    def done(self, trees) -> None:
        """Lock held: a chunk using these trees finished."""
        for tree in trees:
            rec = tree._rec
            rec.users -= 1
            self._maybe_free(rec)

    def define_in(self, w, trees) -> None:
        """Lock held: send ``w`` every tree of ``trees`` it does not have yet."""
        engine = self.engine
        for tree in trees:
            rec = tree._rec
            if rec.tree_id in w.trees or rec.enc is None:
                continue
            segs = engine.new_segments(w, rec.enc.segs)
            engine.arena.lend(rec.enc.handles, w.key)
            w.trees.add(rec.tree_id)
            rec.workers.add(w.key)
            w.post(_protocol.dumps(_protocol.DefineTree(rec.tree_id, rec.enc.data, rec.enc.entries)), segs)

    def forget_worker(self, w) -> None:
        """Lock held: ``w`` is gone."""
        for rec in self.recs.values():
            rec.workers.discard(w.key)

    def _maybe_free(self, rec: TreeRec) -> None:
        if rec.released and rec.users <= 0 and not rec.freed:
            rec.freed = True
            self.recs.pop(rec.tree_id, None)
            drop = _protocol.dumps(_protocol.DropTree(rec.tree_id))
            for w in self.engine.workers:
                if rec.tree_id in w.trees:
                    w.trees.discard(rec.tree_id)
                    w.post(drop)
            self.engine.arena.release_all(rec.key)

    def release(self, rec: TreeRec) -> None:
        with self.engine.lock:
            if rec.released:
                return
            rec.released = True
            self._maybe_free(rec)

    def queue_release(self, rec: TreeRec) -> None:
        """From a finalizer (any thread, any locks held): the manager applies it."""
        self.collected.append(rec)
        self.engine.wake()

    def drain_collected(self) -> None:
        while self.collected:
            try:
                rec = self.collected.popleft()
            except IndexError:
                return
            self.release(rec)
