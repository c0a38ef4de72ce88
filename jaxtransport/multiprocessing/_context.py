"""Contexts: ``multiprocessing``'s spawn and forkserver contexts with jaxtransport's Queue, Pipe
and Pool. Everything else (Lock, Event, Value, Manager, cpu_count, ...) is the standard library's,
from the same start method."""

from __future__ import annotations

import multiprocessing.process
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import _connection, _process, _queues
from ._methods import available_methods, check_method, default_method, set_default_method, std_context
from ._process import device_process_class

if TYPE_CHECKING:
    from multiprocessing.managers import SyncManager

    from .. import pool as _pool

__all__ = ["Process", "get_all_start_methods", "get_context", "get_start_method", "set_start_method"]


class JaxContext:
    """A start method's context (``multiprocessing.get_context(method)``) whose ``Queue``,
    ``JoinableQueue``, ``SimpleQueue``, ``Pipe`` and ``Pool`` move arrays through shared memory.
    Other attributes are the standard context's."""

    def __init__(self, method: str):
        self._name = method
        self._ctx = std_context(method)

    def get_context(self, method: str | None = None) -> JaxContext:
        if method is None:
            return self
        return get_context(method)

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._name

    @property
    def Process(self) -> type:
        """The start method's ``Process``, started with the device plan's variables (``_process``)."""
        return device_process_class(self._ctx.Process)  # type: ignore[attr-defined]

    def Queue(self, maxsize: int = 0, **kw: Any) -> _queues.Queue:
        return _queues.Queue(maxsize, ctx=self._ctx, **kw)

    def JoinableQueue(self, maxsize: int = 0, **kw: Any) -> _queues.JoinableQueue:
        return _queues.JoinableQueue(maxsize, ctx=self._ctx, **kw)

    def SimpleQueue(self, **kw: Any) -> _queues.SimpleQueue:
        return _queues.SimpleQueue(ctx=self._ctx, **kw)

    def Pipe(self, duplex: bool = True, **kw: Any) -> tuple[_connection.Connection, _connection.Connection]:
        return _connection.Pipe(duplex, **kw)

    def Pool(
        self,
        processes: int | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        **kw: Any,
    ) -> _pool.Pool:
        """``jaxtransport.Pool`` with this context's start method (its other options as keywords)."""
        from ..pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, start_method=self._name, **kw)

    def Manager(self) -> SyncManager:
        """The standard ``SyncManager`` started with this start method (its proxies pickle values
        with the standard pickler: no shared memory)."""
        return self._ctx.Manager()

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        raise RuntimeError("a context's start method is fixed; use jaxtransport.multiprocessing.set_start_method")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._ctx, name)

    def __repr__(self) -> str:
        return f"<jaxtransport.multiprocessing context {self._name!r}>"


_contexts: dict[str, JaxContext] = {}


def get_context(method: str | None = None) -> JaxContext:
    """The context of ``method`` ("spawn" or "forkserver"; None: the default, see
    ``set_start_method``). "fork" is refused: JAX's threads do not survive fork()."""
    if method is None:
        method = default_method()
    else:
        method = check_method(method, "jaxtransport.multiprocessing.get_context")
    ctx = _contexts.get(method)
    if ctx is None:
        ctx = _contexts[method] = JaxContext(method)
    return ctx


def set_start_method(method: str, force: bool = False) -> None:
    """The start method of this module's top-level ``Process``, queues and ``Pool`` ("spawn",
    the default, or "forkserver"). Independent of ``multiprocessing.set_start_method``."""
    set_default_method(check_method(method, "jaxtransport.multiprocessing.set_start_method"))


def get_start_method(allow_none: bool = False) -> str:
    return default_method()


def get_all_start_methods() -> list[str]:
    return available_methods()


class Process(multiprocessing.process.BaseProcess):
    """``multiprocessing.Process`` started with this module's start method (spawn by default;
    never fork), with the devices jaxtransport's device plan gives a child (on a host whose TPU
    this process holds or may take: ``JAX_PLATFORMS=cpu``). Subclass it or pass ``target=`` as
    usual."""

    _start_method = None

    def start(self) -> None:
        """Start the process (``multiprocessing.Process.start``), with the device plan's variables."""
        _process.start(self, super().start)

    def __reduce__(self) -> tuple:
        return _process.reduce(self)

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return get_context().Process._Popen(process_obj)  # type: ignore[attr-defined]

    @staticmethod
    def _after_fork() -> Any:
        return get_context().Process._after_fork()  # type: ignore[attr-defined]
