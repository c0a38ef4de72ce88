"""The start methods of ``jaxtransport.multiprocessing`` and its default one.

Below ``_context`` (the contexts and ``Process``) and ``_queues`` (whose queues, made without a
context, take their semaphores from the default start method's), so that neither imports the
other for it.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

from .. import _os
from .._procenv import fork_refused

__all__ = ["METHODS", "available_methods", "check_method", "default_method", "set_default_method", "std_context"]

METHODS = ("spawn", "forkserver")

_default_method = "spawn"  # set_start_method's choice (one process-wide value)


def check_method(method: str | None, what: str) -> str:
    """``method`` if it is a start method this module allows here (None: "spawn"); ValueError
    naming ``what`` otherwise ("fork" with why it is refused)."""
    if method is None:
        return "spawn"
    if method == "fork":
        raise ValueError(fork_refused(what, "method"))
    if method not in METHODS:
        raise ValueError(f"{what}: start method must be 'spawn' or 'forkserver', got {method!r}")
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"{what}: start method {method!r} is not available on this platform")
    return method


def default_method() -> str:
    """The default start method (``set_start_method``'s, "spawn" until it is called)."""
    return _default_method


def set_default_method(method: str) -> None:
    """Make ``method`` (already checked with :func:`check_method`) the default."""
    global _default_method
    _default_method = method


def available_methods() -> list[str]:
    return [m for m in METHODS if m in multiprocessing.get_all_start_methods()]


def std_context(method: str | None = None) -> BaseContext:
    """The standard library's context of ``method`` (None: the default start method), whose
    processes are told that start method (Note [the child's start method] in ``_os``)."""
    return _os.start_context(default_method() if method is None else method)
