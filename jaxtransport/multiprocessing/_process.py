"""Processes that start with the devices jaxtransport's device plan gives them.

A child that inherits its parent's environment reaches for the accelerator its parent holds (a
TPU chip is open to one process at a time): ``jaxtransport.multiprocessing``'s processes start
with what :func:`jaxtransport._devices.plan` says instead (``JAX_PLATFORMS=cpu`` on a TPU host
whose chips the parent holds or may take; nothing changed elsewhere). The variables reach the
child twice: in the environment it is started with (spawn: before its interpreter imports
anything, JAX included), and first in its pickled process object, applied before the rest of
that object (its ``args``, which may hold jax.Arrays) is unpickled: a forkserver's children
inherit the server's environment, not the parent's.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import _devices, _procenv

__all__ = ["child_env", "device_process_class"]


def child_env() -> dict[str, str | None]:
    """The variables a process started from this one applies first (the device plan for one
    process, announced once)."""
    plan = _devices.plan(None)
    plan.announce()
    return plan.env(0)


def _rebuild(cls: type, env: dict[str, str | None], std: type | None = None) -> Any:
    _procenv.apply_environ(env)
    if std is not None:  # a class device_process_class made: made again here
        cls = device_process_class(std)
    return object.__new__(cls)


class DeviceEnvMixin:
    """Mixed into a ``multiprocessing`` process class: see the module docstring."""

    _jt_env: dict[str, str | None] | None = None

    def start(self) -> None:
        env = child_env()
        self._jt_env = env
        with _procenv.environ_overlay(env):
            super().start()  # type: ignore[misc]

    def __reduce__(self) -> tuple:
        # (callable, args, state): pickle rebuilds the object, so applies the variables, before
        # it unpickles the state (target, args, kwargs).
        std = getattr(type(self), "_jt_std", None)
        cls = DeviceEnvMixin if std is not None else type(self)
        return (_rebuild, (cls, self._jt_env or {}, std), self.__dict__)


@functools.cache
def device_process_class(std: type) -> type:
    """``std`` (a start method's ``Process`` class) with :class:`DeviceEnvMixin`."""
    return type(std.__name__, (DeviceEnvMixin, std), {"_jt_std": std})
