"""``jaxtransport.multiprocessing``: a drop-in for ``multiprocessing`` whose queues and pipes move
JAX and numpy arrays through shared memory (as ``torch.multiprocessing`` does for tensors).

    import jaxtransport.multiprocessing as mp

    q = mp.Queue()
    p = mp.Process(target=actor, args=(q,))   # spawn by default; "forkserver" too; never fork
    p.start()
    batch = q.get(timeout=60)                 # its arrays alias the producer's shared memory

``Queue``, ``JoinableQueue``, ``SimpleQueue`` and ``Pipe`` have the standard API. Every
``jax.Array`` and ``numpy.ndarray`` of at least ``shm_threshold`` bytes (default 1 MiB), anywhere
in a message, is copied once by the sender into recycled shared memory (the same encoder and
arena as ``jaxtransport.Pool``: dtypes, weak types, PRNG keys, shardings with
``placement="preserve"``); only a small packet with the segments' fds travels. A received CPU
array aliases that memory (no copy), read-only for jax arrays; the memory goes back to the sender
when the last array over it is gone.

What the sender sees: ``put()``/``send()`` pickle and copy in the caller, so a Tracer raises
TracerTransportError there with its key path, before anything is queued. When the receivers hold
all the memory the sender may use (``set_shm_capacity``, default half the free memory), ``put()``
waits while they keep releasing memory, up to its ``timeout`` (or 10 s without any release),
then raises ShmCapacityError naming how much is held by messages not yet taken.

What a dead or stuck peer looks like:

- A producer that died (even SIGKILLed): the messages it had sent can still be taken, and their
  arrays stay valid (the memory lives while someone maps it); messages still in its feeder thread
  are lost. ``get(timeout=...)`` raises ``queue.Empty`` when nothing comes; on a Pipe, ``recv()``
  raises EOFError once every process holding the other end has closed it or died.
- A consumer that died: its arrays' memory returns to the producer (the producer checks, when it
  runs short, whether the process holding a slot still exists); nothing is left in ``/dev/shm``
  (segments are memfds without a name). A message it had taken off the queue but not yet
  rebuilt is lost. Messages nobody takes keep their memory until the producer exits.
- A stopped consumer (SIGSTOP, a debugger): the producer's puts wait as above, then raise
  ShmCapacityError; they never block forever. A stopped producer blocks nobody: there is no lock.
- Garbage on a queue or pipe (something other than this module wrote to it): ``get()``/``recv()``
  raise TransportError for that message, close any fds that came with it, and later messages
  are unaffected.

``Pool`` is ``jaxtransport.Pool``; ``Manager`` and every other name (``Lock``, ``Event``,
``Value``, ``cpu_count``, ...) are the standard library's, from the same start method.
Importing this module registers nothing: ``multiprocessing`` and ``pickle`` are unchanged.
"""

from __future__ import annotations

import multiprocessing as _std
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._connection import Connection as Connection
from ._connection import Pipe as _Pipe
from ._context import JaxContext as JaxContext
from ._context import Process as Process
from ._context import get_all_start_methods as get_all_start_methods
from ._context import get_context as get_context
from ._context import get_start_method as get_start_method
from ._context import set_start_method as set_start_method
from ._queues import JoinableQueue as _JoinableQueue
from ._queues import Queue as _Queue
from ._queues import SimpleQueue as _SimpleQueue
from ._sharing import set_shm_capacity as set_shm_capacity

if TYPE_CHECKING:
    from multiprocessing.managers import SyncManager

    from ..pool import Pool as _JtPool

__all__ = [
    "Connection",
    "JaxContext",
    "JoinableQueue",
    "Manager",
    "Pipe",
    "Pool",
    "Process",
    "Queue",
    "SimpleQueue",
    "get_all_start_methods",
    "get_context",
    "get_start_method",
    "set_shm_capacity",
    "set_start_method",
]


def Queue(maxsize: int = 0, **kw: Any) -> _Queue:
    """A queue on the default context: ``multiprocessing.Queue``'s API, with jax/numpy arrays of
    at least ``shm_threshold`` bytes (default 1 MiB) through shared memory. Keywords:
    ``shm_threshold``, ``placement``. The class it returns is documented below (``Queue``)."""
    return get_context().Queue(maxsize, **kw)


def JoinableQueue(maxsize: int = 0, **kw: Any) -> _JoinableQueue:
    return get_context().JoinableQueue(maxsize, **kw)


def SimpleQueue(**kw: Any) -> _SimpleQueue:
    return get_context().SimpleQueue(**kw)


def Pipe(duplex: bool = True, **kw: Any) -> tuple[Connection, Connection]:
    """``(conn1, conn2)``, as ``multiprocessing.Pipe``; see :class:`Connection`."""
    return _Pipe(duplex, **kw)


def Pool(
    processes: int | None = None,
    initializer: Callable[..., Any] | None = None,
    initargs: Iterable[Any] = (),
    maxtasksperchild: int | None = None,
    **kw: Any,
) -> _JtPool:
    """``jaxtransport.Pool`` started with the default start method."""
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild, **kw)


def Manager() -> SyncManager:
    """The standard library's ``SyncManager``, started with the default start method."""
    return get_context().Manager()


def __getattr__(name: str) -> Any:
    # Lock, Event, Value, Barrier, cpu_count, active_children, current_process, ...: the
    # standard library's, from the default context.
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(get_context(), name)
    except AttributeError:
        pass
    try:
        return getattr(_std, name)
    except AttributeError:
        raise AttributeError(f"module 'jaxtransport.multiprocessing' has no attribute {name!r}") from None
