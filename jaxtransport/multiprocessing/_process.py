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
from collections.abc import Callable
from typing import Any

from .. import _devices, _procenv

__all__ = ["child_env", "device_process_class", "reduce", "start"]


def child_env() -> dict[str, str | None]:
    """The variables a process started from this one applies first (the device plan for one
    process, announced once)."""
    plan = _devices.plan(None)
    plan.announce()
    return plan.env(0)


def _rebuild(cls: type | None, env: dict[str, str | None], std: type | None = None) -> Any:
    _procenv.apply_environ(env)
    if std is not None:  # a class device_process_class made: made again here
        cls = device_process_class(std)
    return object.__new__(cls)  # type: ignore[arg-type]


def start(process: Any, std_start: Callable[[], None]) -> None:
    """``process.start()``: ``std_start`` (the standard ``start``) with the device plan's
    variables in the environment, kept for :func:`reduce` to send along."""
    env = child_env()
    process._jt_env = env
    with _procenv.environ_overlay(env):
        std_start()


def reduce(process: Any) -> tuple:
    """``process.__reduce__()``: (callable, args, state), so that pickle rebuilds the object, and
    with it applies the variables, before it unpickles the state (target, args, kwargs)."""
    std = getattr(type(process), "_jt_std", None)
    cls = type(process) if std is None else None
    return (_rebuild, (cls, getattr(process, "_jt_env", None) or {}, std), process.__dict__)


@functools.cache
def device_process_class(std: type) -> type:
    """``std`` (a start method's ``Process`` class) started and pickled as above."""

    def start_(self: Any) -> None:
        start(self, lambda: std.start(self))  # type: ignore[attr-defined]

    return type(std.__name__, (std,), {"_jt_std": std, "start": start_, "__reduce__": reduce})
