"""Contexts whose processes start with the start method jaxtransport chose, whatever this
process's own default is (Note [the child's start method]).

Note [the child's start method]
``multiprocessing``'s spawn and forkserver start methods send each child *preparation data*
(CPython ``Lib/multiprocessing/spawn.py``, ``get_preparation_data``) before the process
object, and its ``"start_method"`` entry is this process's *default* start method
(``multiprocessing.get_start_method()``), not the method the child is started with. The child's
``spawn.prepare()`` calls ``set_start_method()`` with it before any other code runs there. Inside
a loky worker (joblib's default backend, scikit-learn's ``n_jobs``) the default is ``"loky"``, a
context that exists only where loky is imported; a fresh child has no such context and dies at
start-up with ``ValueError: cannot find context for 'loky'`` (any context a library registers
does the same). jaxtransport chose spawn or forkserver itself, so its children are told that
method, and their own default start method is it.

How: the Popen classes of spawn (``popen_spawn_posix.py``; ``popen_spawn_win32.py``) and
forkserver (``popen_forkserver.py``) call ``spawn.get_preparation_data`` through their module's
global ``spawn`` (``_launch``; ``__init__`` on Windows), on CPython 3.10 to 3.13. The Popen
classes here are those classes with that one function run over a copy of its module's globals
in which ``spawn`` is a view of the module whose ``get_preparation_data`` puts the chosen
method in. Nothing global changes: other code that starts processes in this process (loky,
the user's own ``multiprocessing``) is untouched. The forkserver's server process gets only
``sys_path`` and the main path from the preparation data (``forkserver.ensure_running``); each
child it forks gets the full data through ``popen_forkserver``, so it is covered here. Where a
future CPython no longer makes that call (the probe in :func:`_told_popen`), the stock Popen is
used: the behaviour before this module, correct wherever the default start method is a
standard one; tests/test_multiprocessing.py (run on the newest and the oldest Python in CI)
then fails, which is the signal to revisit this module.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.spawn
import sys
import threading
import types
from typing import Any

__all__ = ["ForkServerContext", "ForkServerProcess", "SpawnContext", "SpawnProcess", "start_context"]


class _SpawnView:
    """``multiprocessing.spawn`` as a chosen start method's Popen sees it: the same module,
    except that the preparation data names ``method``."""

    def __init__(self, method: str):
        self._method = method

    def get_preparation_data(self, name: str) -> dict:
        data = multiprocessing.spawn.get_preparation_data(name)
        data["start_method"] = self._method
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing.spawn, name)


def _stock_popen(method: str) -> type:
    """The standard library's Popen class of ``method`` on this platform (as
    ``multiprocessing.context``'s Process classes import it)."""
    if method == "forkserver":
        from multiprocessing import popen_forkserver

        return popen_forkserver.Popen
    if sys.platform == "win32":
        from multiprocessing import popen_spawn_win32  # type: ignore[attr-defined,unused-ignore]

        return popen_spawn_win32.Popen  # type: ignore[attr-defined,unused-ignore]
    from multiprocessing import popen_spawn_posix

    return popen_spawn_posix.Popen


def _told_popen(method: str) -> type:
    """``method``'s Popen class whose children are told ``method`` (Note [the child's start
    method]); the stock class when this CPython's Popen does not call
    ``spawn.get_preparation_data`` where expected."""
    stock = _stock_popen(method)
    for attr in ("_launch", "__init__"):
        fn: Any = stock.__dict__.get(attr)
        code = getattr(fn, "__code__", None)
        if code is None or not {"spawn", "get_preparation_data"} <= set(code.co_names):
            continue
        if fn.__globals__.get("spawn") is not multiprocessing.spawn:
            continue
        scope = dict(fn.__globals__)  # the Popen module's globals, with ``spawn`` replaced
        scope["spawn"] = _SpawnView(method)
        told = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        told.__kwdefaults__ = fn.__kwdefaults__
        told.__qualname__ = fn.__qualname__
        told.__doc__ = fn.__doc__
        return type(stock.__name__, (stock,), {attr: told, "__module__": __name__, "__qualname__": f"_told_{method}"})
    return stock


_popens: dict[str, type] = {}
_popens_lock = threading.Lock()


def _popen(method: str) -> type:
    with _popens_lock:
        cls = _popens.get(method)
        if cls is None:
            cls = _popens[method] = _told_popen(method)
        return cls


# The Process classes are module-level (their instances are pickled into the child, which
# imports them by name); each mirrors ``multiprocessing.context``'s class of the same name.
class SpawnProcess(multiprocessing.context.SpawnProcess):
    """A spawn ``Process`` whose child is told "spawn" (Note [the child's start method])."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _popen("spawn")(process_obj)


_ForkServerBase: Any = getattr(multiprocessing.context, "ForkServerProcess", multiprocessing.process.BaseProcess)


class ForkServerProcess(_ForkServerBase):
    """A forkserver ``Process`` whose child is told "forkserver" (Note [the child's start
    method]); POSIX only, as the start method."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _popen("forkserver")(process_obj)


_ForkServerContextBase: Any = getattr(multiprocessing.context, "ForkServerContext", multiprocessing.context.BaseContext)


class SpawnContext(multiprocessing.context.SpawnContext):
    """The standard spawn context, whose ``Process`` is :class:`SpawnProcess`."""

    Process = SpawnProcess


class ForkServerContext(_ForkServerContextBase):
    """The standard forkserver context, whose ``Process`` is :class:`ForkServerProcess`."""

    _name = "forkserver"
    Process = ForkServerProcess


_CONTEXTS: dict[str, type] = {"spawn": SpawnContext, "forkserver": ForkServerContext}
_contexts: dict[str, multiprocessing.context.BaseContext] = {}
_contexts_lock = threading.Lock()


def start_context(method: str) -> multiprocessing.context.BaseContext:
    """The standard context of ``method`` ("spawn" or "forkserver"; ValueError where it is not
    available), except that its ``Process`` (and so its ``Manager`` and ``Pool``) tells each
    child that start method (Note [the child's start method]). Its locks, queues and the rest
    are the standard context's."""
    if method not in _CONTEXTS:
        raise ValueError(f"start method must be 'spawn' or 'forkserver', got {method!r}")
    with _contexts_lock:
        ctx = _contexts.get(method)
        if ctx is None:
            multiprocessing.get_context(method)  # ValueError where it is not available here
            ctx = _contexts[method] = _CONTEXTS[method]()
        return ctx
