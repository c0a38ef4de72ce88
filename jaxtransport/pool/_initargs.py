"""A pool's initializer and its arguments on their way to each worker (Note [initargs]).

The parent wraps them in an :class:`InitCall` (``_processes`` puts it in the worker
``Process``'s arguments); the worker rebuilds them with :func:`loads_in_child` (``_worker``).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler

from .._pickling import PICKLE_PROTOCOL
from .._usercode import Pickler

__all__ = ["InitCall", "dumps_for_child", "loads_in_child"]


class InitCall:
    """A pool's ``initializer(*initargs)``, pickled for each worker as that worker starts.

    Note [initargs]
    ~~~~~~~~~~~~~~~
    The stock pools put ``initargs`` in the worker ``Process``'s arguments, so they are
    pickled by ``multiprocessing`` while it spawns the child: objects that may be shared only
    by inheritance (a ``multiprocessing.Queue``, ``Lock``, ``Value``, a ``Connection``,
    jaxtransport's own queues) pass ``assert_spawning`` and hand their fds to the child. An
    ``InitCall`` travels the same way, in the worker's ``Process`` arguments. It reduces to
    ``(blob, inherited)``: ``blob`` is ``(initializer, initargs)`` pickled by jaxtransport's
    pickler (``__main__`` initializers and lambdas keep the stock module semantics, Note [user
    code]), except that every ``multiprocessing`` (or ``jaxtransport.multiprocessing``)
    object in it, and every object ``ForkingPickler`` has a reducer of its own for (ctypes
    values in shared memory, Connections, sockets), is left out as a persistent id and put in
    ``inherited``, which ``multiprocessing`` pickles itself in the same pickle as the rest of
    the ``Process`` (one memo: a heap arena or a pipe appears once, as the spawn's list of
    fds to pass requires). The child rebuilds ``inherited`` while it starts, as the stock pools
    do, and unpickles ``blob`` in the worker loop, after its environment is set. Every worker,
    including one started later to replace another, gets its initargs pickled anew, as the
    stock pools do; an argument that cannot be pickled raises from ``Pool()`` itself.
    """

    __slots__ = ("initargs", "initializer")

    def __init__(self, initializer, initargs):
        self.initializer = initializer
        self.initargs = tuple(initargs)

    def __reduce__(self):
        inherited: list = []
        blob = dumps_for_child((self.initializer, self.initargs), inherited)
        return tuple, ((blob, inherited),)


_INHERITED_MODULES = ("multiprocessing.", "jaxtransport.multiprocessing.")


class _ChildPickler(Pickler):
    """jaxtransport's pickler leaving ``multiprocessing`` objects out as persistent ids (Note
    [initargs]). One class for every call, not a class per call: a class lives in a reference
    cycle, and one made per call would keep what its methods close over (the caller's Queue,
    with its named semaphores) until the cyclic collector runs (python/cpython#104090)."""

    def __init__(self, file, inherited: list, mp_only: set):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.inherited: list | None = inherited
        self.mp_only = mp_only

    def persistent_id(self, o):
        t = type(o)
        if t in self.mp_only or t.__module__.startswith(_INHERITED_MODULES):
            self.inherited.append(o)  # type: ignore[union-attr]
            return len(self.inherited) - 1  # type: ignore[arg-type]
        return None


def dumps_for_child(obj, inherited: list) -> bytes:
    """``obj`` pickled by jaxtransport's pickler, its ``multiprocessing`` objects appended to
    ``inherited`` instead (Note [initargs]); :func:`loads_in_child` rebuilds it. The pickler
    keeps no reference to ``obj`` or ``inherited`` afterwards."""
    # ForkingPickler's public per-instance table: copyreg's plus multiprocessing's own reducers.
    mp_table = ForkingPickler(io.BytesIO()).dispatch_table
    mp_only = {t for t, r in mp_table.items() if copyreg.dispatch_table.get(t) is not r}
    f = io.BytesIO()
    pickler = _ChildPickler(f, inherited, mp_only)
    try:
        pickler.dump(obj)
    finally:
        pickler.inherited = None
        pickler.clear_memo()
    return f.getvalue()


class _ChildUnpickler(pickle.Unpickler):
    def __init__(self, file, inherited: list):
        super().__init__(file)
        self.inherited = inherited

    def persistent_load(self, pid):
        return self.inherited[pid]


def loads_in_child(payload):
    """What :class:`InitCall` became in the worker: ``(initializer, initargs)``."""
    blob, inherited = payload
    return _ChildUnpickler(io.BytesIO(blob), inherited).load()
