"""A Pool's lifecycle flags -- closed, terminated, broken -- under one lock (loky's
``_ExecutorFlags``). Readers may look at a flag without the lock (a stale read only delays a
decision to the next check); every change goes through a method here."""

from __future__ import annotations

from .. import _lockorder
from .._errors import PoolStateError

MAX_EARLY_DEATHS = 3  # consecutive workers dying before they are ready -> the pool is broken


class Lifecycle:
    def __init__(self):
        self.lock = _lockorder.lock("Lifecycle.lock")  # innermost: nothing is called with it held
        self.closed = False  # no new tasks; workers stop once the submitted ones are done
        self.terminated = False  # workers killed, pending tasks failed
        self.broken: BaseException | None = None  # why the pool cannot run tasks any more

    @property
    def stopped(self) -> bool:
        """Terminated or broken: nothing will run any more."""
        return self.terminated or self.broken is not None

    def close(self) -> None:
        with self.lock:
            self.closed = True

    def terminate(self) -> bool:
        """Mark terminated; True only for the first call (the one that does the work)."""
        with self.lock:
            if self.terminated:
                return False
            self.terminated = self.closed = True
            return True

    def set_broken(self, err: BaseException) -> bool:
        """Record why the pool broke; True only for the first call."""
        with self.lock:
            if self.broken is not None:
                return False
            self.broken = err
            return True

    def check_running(self) -> None:
        if self.broken is not None:
            raise PoolStateError(
                f"This jaxtransport.Pool is broken and accepts no tasks: {self.broken}"
            ) from self.broken
        if self.closed or self.terminated:
            raise PoolStateError("Pool not running: it was closed or terminated; create a new jaxtransport.Pool.")

    def describe(self) -> str:
        return "terminated" if self.terminated else "broken" if self.broken else "closed" if self.closed else "running"
