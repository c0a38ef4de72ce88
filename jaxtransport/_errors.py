"""Every error type jaxtransport raises, in one place.

Each class subclasses the nearest builtin (or JAX) error so that existing handlers keep working,
and each one pickles: errors cross process boundaries (a worker's error is re-raised in the
parent), so every class defines ``__reduce__`` over its constructor arguments.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

__all__ = [
    "ArrayDeletedError",
    "BrokenExecutorError",  # defined on first use (_define_broken)
    "CorruptTransferError",
    "DeviceUnavailableError",
    "DtypeUnavailableError",
    "LockOrderError",
    "MainGuardError",
    "PlacementError",
    "PoolStateError",
    "PoolTerminatedError",
    "RemoteTraceback",  # defined on first use (_define_remote_traceback)
    "ShmCapacityError",
    "ShmHandleError",
    "TracerTransportError",  # noqa: F822 - defined on first use (_define_tracer_error)
    "TransportError",
    "UnsupportedArrayError",
    "WorkerLostError",  # defined on first use (_define_broken)
]


_DEFINE_LOCK = threading.Lock()


def _define_tracer_error() -> type:
    # JAX is imported here, on first use, not when jaxtransport is: a Pool worker that runs
    # numpy-only tasks never imports it (TracerTransportError can only be raised where JAX is).
    with _DEFINE_LOCK:
        defined = globals().get("TracerTransportError")
        if defined is None:
            defined = _tracer_error_class()
            globals()["TracerTransportError"] = defined
    return defined


def _tracer_error_class() -> type:
    import jax

    class TracerTransportError(jax.errors.ConcretizationTypeError):
        """A traced value (a JAX ``Tracer``) was about to leave its process.

        Tracers are abstract placeholders that exist only while ``jit``, ``grad``, ``vmap``, ``scan``,
        ``shard_map`` ... trace a function; they have no value to send. Subclasses
        ``jax.errors.ConcretizationTypeError`` so that ``except ConcretizationTypeError`` still
        catches it. The message names the tracer's shape and dtype, the transformation being
        traced, where in the user's data it sits (``path``) and the fixes.

        Attributes:
          path: the key path of the tracer inside the object that was being sent (for example
            ``"args[0]['params']['w']"``), or ``None`` when it is not known.
          description: shape/dtype/transformation summary of the tracer.
        """

        def __init__(self, description: str, path: str | None = None, *, where: str | None = None):
            self.description = description
            self.path = path
            self.where = where
            located = f" at {path}" if path else ""
            via = f" ({where})" if where else ""
            hint_path = (
                "" if path else "\nTo find where it sits in your data, call jaxtransport.check_transportable(obj)."
            )
            message = (
                f"Cowardly refusing to transport a traced value{located}{via}: {description}.\n"
                "A Tracer only exists while a JAX transformation traces a function; it has no "
                "concrete value that another process could receive.\n"
                "Fix: return the concrete result from the transformed function and send it from "
                "outside (after jit/grad/vmap/... has returned), or call out of the traced "
                "function with jax.experimental.io_callback (or jax.debug.callback for side "
                f"effects only), which receives concrete arrays.{hint_path}"
            )
            # Bypass ConcretizationTypeError.__init__ (which wants a live tracer); point at the
            # JAX error page of the class users know.
            TypeError.__init__(
                self,
                f"{message}\nSee https://docs.jax.dev/en/latest/errors.html#jax.errors.ConcretizationTypeError",
            )

        def __reduce__(self) -> tuple:
            return (_rebuild_tracer_error, (self.description, self.path, self.where))

    TracerTransportError.__module__ = __name__
    TracerTransportError.__qualname__ = "TracerTransportError"  # pickled by this name
    return TracerTransportError


def __getattr__(name: str) -> type:
    # PEP 562: ``TracerTransportError`` subclasses a JAX class, so it is defined on first access;
    # ``WorkerLostError`` and ``BrokenExecutorError`` subclass ``concurrent.futures``' class,
    # which imports ``logging`` and more: a pool worker, which raises neither, never loads it
    # (its start is the Pool's first result: Note [launch first] in ``pool._launch``);
    # ``RemoteTraceback`` subclasses ``multiprocessing.pool``'s, which only the parent's
    # manager needs, after the workers started.
    if name == "TracerTransportError":
        return _define_tracer_error()
    if name in _BROKEN:
        return _define_broken(name)
    if name == "RemoteTraceback":
        return _define_remote_traceback()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rebuild_tracer_error(description: str, path: str | None, where: str | None) -> BaseException:
    return _define_tracer_error()(description, path, where=where)


class TransportError(RuntimeError):
    """Base class for jaxtransport's runtime errors (not for tracers, see above)."""

    def __reduce__(self) -> tuple:
        return (type(self), self.args)


class ArrayDeletedError(TransportError):
    """The array was deleted (``x.delete()``) or donated to a jitted call before being sent."""


class UnsupportedArrayError(TransportError, TypeError):
    """An array that cannot be transported (for example one spanning other hosts' devices)."""


class CorruptTransferError(TransportError, ValueError):
    """A received array's description does not fit the data that arrived with it.

    The metadata of every array (dtype, shape, shard indices, sharding, PRNG implementation) is
    checked against its buffers before anything is allocated: a dtype no JAX array can have,
    negative or absurd dimensions, shard indices outside the shape, overlapping or not covering
    it, a buffer whose size is not its shard's, missing or extra buffers. The message names what
    is wrong. Raised instead of returning an array that is partly uninitialised memory, or
    reserving memory the buffers cannot fill. Usually a bug or a damaged channel between the two
    processes (or two jaxtransport versions that disagree); the data is not usable.
    """


class DeviceUnavailableError(TransportError):
    """A process could not open its accelerator because another process holds it (a TPU chip
    is open to one process at a time). The message names the fix (``worker_env``,
    ``devices_per_worker``); the runtime's own error is the ``__cause__``."""


class DtypeUnavailableError(TransportError, TypeError):
    """The receiver cannot represent the dtype bit-exactly (e.g. float64 with x64 disabled)."""


class PlacementError(TransportError, ValueError):
    """An unknown placement policy was requested."""


# --------------------------------------------------------------------------------------------
# jaxtransport.Pool and its shared memory


_BROKEN = {
    "WorkerLostError": """A pool worker died (SIGKILL, the OOM killer, ``os._exit``, a segfault) while it ran a task.

    Raised by the pending call instead of hanging (what ``multiprocessing.Pool`` does,
    python/cpython#66587). Subclasses ``concurrent.futures.process.BrokenProcessPool`` so that
    code written for ``ProcessPoolExecutor`` catches it too. The pool replaces the worker and
    keeps running other tasks; if workers keep dying before they are ready (a crashing
    initializer, a broken environment) the pool reports itself broken with this error.
    """,
    "BrokenExecutorError": """A ``jaxtransport.Executor``'s pool is broken (its workers keep dying at start, or its
    initializer failed): no call can run. A ``concurrent.futures.process.BrokenProcessPool``,
    as ``ProcessPoolExecutor`` raises. Create a new executor after fixing the cause.""",
}


def _define_broken(name: str) -> type:
    """``WorkerLostError`` or ``BrokenExecutorError``, a ``TransportError`` and a
    ``BrokenProcessPool``, made once (on first access) and then a module attribute as any."""
    with _DEFINE_LOCK:
        defined = globals().get(name)
        if defined is None:
            from concurrent.futures.process import BrokenProcessPool

            body = {"__doc__": _BROKEN[name], "__module__": __name__}
            defined = type(name, (TransportError, BrokenProcessPool), body)
            defined.__qualname__ = name  # pickled by this name
            globals()[name] = defined
    return defined


if TYPE_CHECKING:
    from concurrent.futures.process import BrokenProcessPool

    class WorkerLostError(TransportError, BrokenProcessPool): ...

    class BrokenExecutorError(TransportError, BrokenProcessPool): ...


class PoolStateError(TransportError, ValueError):
    """A Pool was used after ``close()``/``terminate()``, or a pool object was misused (``join``
    before ``close``, a SharedTree of another pool or already released). Subclasses ValueError
    like ``multiprocessing.Pool``'s "Pool not running"."""


class MainGuardError(TransportError):
    """A pool or process was started by code that every spawned worker runs again: the top level
    of the main script, outside ``if __name__ == "__main__":``. spawn and forkserver run the
    main script in each new process (as ``__mp_main__``), so an unguarded start would start
    processes from processes. A RuntimeError, as ``multiprocessing``'s own message for this."""


class PoolTerminatedError(TransportError):
    """The pool was terminated (``terminate()``, leaving a ``with`` block, garbage collection or
    interpreter exit) before this task's result arrived."""


class ShmCapacityError(TransportError, MemoryError):
    """Shared memory for a transfer could not be reserved: the pool's ``shm_capacity`` is reached
    by arrays still alive in the receivers, or the system is out of memory. The message names
    the bytes needed, the bytes in use and free, and the fixes."""


class ShmHandleError(TransportError, ValueError):
    """A shared-memory handle that cannot be honoured arrived: it names a segment this process
    never received or that was freed, or it points outside its segment (truncated or out of
    bounds). Only the task that carried it fails."""


class LockOrderError(RuntimeError):
    """A debug check (``JAXTRANSPORT_CHECK_LOCKS=raise``, see ``jaxtransport._lockorder``) saw a
    thread take two of jaxtransport's locks against their written order: two threads doing
    that at once deadlock. A bug in jaxtransport; the message names both locks and the stack."""

    def __reduce__(self) -> tuple:
        return (type(self), self.args)


def _define_remote_traceback() -> type:
    """``RemoteTraceback``, made once (on first access: its base is in ``multiprocessing.pool``,
    which a pool worker and a Pool's start otherwise never import) and then a module attribute
    as any."""
    with _DEFINE_LOCK:
        defined = globals().get("RemoteTraceback")
        if defined is None:
            from multiprocessing.pool import RemoteTraceback as _Base  # type: ignore[attr-defined]

            class RemoteTraceback(_Base):
                """Carries a worker's formatted traceback; attached as ``__cause__`` of re-raised
                errors. A subclass of ``multiprocessing.pool.RemoteTraceback``, so handlers
                written for the stock pool catch it."""

                def __init__(self, tb: str):
                    super().__init__(tb)
                    self.tb = tb

                def __str__(self) -> str:
                    return self.tb

                def __reduce__(self) -> tuple:
                    return (type(self), (self.tb,))

            RemoteTraceback.__module__ = __name__
            RemoteTraceback.__qualname__ = "RemoteTraceback"  # pickled by this name
            defined = globals()["RemoteTraceback"] = RemoteTraceback
    return defined


if TYPE_CHECKING:

    class RemoteTraceback(Exception):
        tb: str

        def __init__(self, tb: str) -> None: ...
