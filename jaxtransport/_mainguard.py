"""Starting processes from code that every spawned child runs again: the missing main guard.

spawn and forkserver start each child by running the parent's main script again, as
``__mp_main__``; a pool started at the script's top level, outside ``if __name__ ==
"__main__":``, would be started again in every child. :func:`unguarded_start` tells, before any
process starts. A module of its own, importing nothing of jaxtransport's: ``Pool()`` asks it
before it starts its workers, which it does before importing anything heavier (Note [launch
first] in ``jaxtransport.pool._launch``). :func:`main_attr`, what a pickle names for an object
of the main script that travels by reference (Note [user code] in ``_usercode``), lives here
for the same reason: a pool worker reads such a task with plain ``pickle.loads``, without the
encoder.
"""

from __future__ import annotations

import ast
import os
import sys
import threading
import types
from typing import Any

__all__ = [
    "is_main_guard",
    "main_attr",
    "main_script",
    "resolve",
    "runs_unconditionally",
    "script_tree",
    "unguarded_start",
]


def is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either order)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    has_name = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    has_main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return has_name and has_main


def main_script(main: types.ModuleType) -> str | None:
    """The file a spawn/forkserver child runs as ``__mp_main__`` for this main module, or None
    when it runs none (``python -c``, the REPL, notebooks, ``python -m pkg`` whose main is
    ``pkg.__main__``): the rules of ``multiprocessing.spawn.get_preparation_data``."""
    if getattr(main, "__name__", None) == "__mp_main__":  # this process is such a child
        return getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:
        if spec_name == "__main__" or spec_name.endswith(".__main__"):
            return None
    path = getattr(main, "__file__", None)
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def resolve(root: Any, qualname: str) -> Any:
    """``root``'s attribute at the dotted ``qualname``."""
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main_attr(name: str) -> Any:
    """Rebuild a by-reference object: ``__main__``'s attribute ``name`` in this process (the
    reduction ``_usercode.main_reference`` writes)."""
    main = sys.modules.get("__main__")
    try:
        return resolve(main, name)
    except AttributeError:
        where = getattr(main, "__file__", None) or "this process's main module"
        raise AttributeError(
            f"jaxtransport: __main__.{name} is not defined in {where} as this process ran it. It "
            "travelled by reference because the main script binds it at top level (outside "
            '`if __name__ == "__main__":`); define it unconditionally at the top level of the '
            "script, or move it into an importable module."
        ) from None


_trees_lock = threading.Lock()
_trees: dict[str, ast.Module | None] = {}


def script_tree(path: str) -> ast.Module | None:
    """The syntax tree of the script at ``path`` (None: unreadable, or not Python), parsed once
    per process: ``unguarded_start`` reads it before a pool starts, ``_usercode`` for the names
    the script binds when the first task is pickled (a parse costs ~1 ms per 100 lines)."""
    key = os.path.abspath(path)
    with _trees_lock:
        if key not in _trees:
            try:
                with open(path, "rb") as f:
                    _trees[key] = ast.parse(f.read(), filename=path)
            except (OSError, SyntaxError, ValueError):
                _trees[key] = None
        return _trees[key]


def runs_unconditionally(stmts: list[ast.stmt], line: int) -> bool | None:
    """Whether the statement holding ``line`` runs whenever the module runs (True), or not
    surely (False: under the main guard, an ``if``, in a ``try`` that may catch the error)."""
    for s in stmts:
        if not (s.lineno <= line <= (s.end_lineno or s.lineno)):
            continue
        if isinstance(s, ast.If):
            if is_main_guard(s.test):  # its else branch runs in the children
                return not any(b.lineno <= line <= (b.end_lineno or b.lineno) for b in s.body)
            return False
        if isinstance(s, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            if line < s.body[0].lineno:
                return True  # the header
            return runs_unconditionally(s.body, line) is True
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            return False
        return True
    return None


_GUARD_FIX = (
    'Put the code that starts it under `if __name__ == "__main__":` (the functions and classes '
    "the tasks use stay at the top level), as the multiprocessing documentation's \"Safe importing "
    'of main module" asks.'
)


def unguarded_start(what: str) -> str | None:
    """Why starting ``what`` (processes) from the calling code would fail in every spawned child
    (a message for MainGuardError), or None. Two cases: this process is a spawn/forkserver child
    still running the parent's main script as ``__mp_main__`` (multiprocessing's own check, which
    raises a RuntimeError from ``Process.start``, reads the same flag); or the call comes from
    the top level of the main script, outside ``if __name__ == "__main__":``, which every child
    would run again. Costs a walk up the stack and, once per script, a parse of it."""
    import multiprocessing.process

    main = sys.modules.get("__main__")
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        script = "the main script"
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:  # runpy runs it in a temporary module named __mp_main__
            if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
                script = f"{frame.f_code.co_filename}, line {frame.f_lineno}"
            frame = frame.f_back
        return (
            f"{what} was started while this process was starting up: it is a worker spawned by "
            f"another process, running that process's main script ({script}) as `__mp_main__`, "
            f'and the script starts {what} outside `if __name__ == "__main__":`, so every worker '
            f"would start processes of its own. {_GUARD_FIX}"
        )
    path = main_script(main) if main is not None else None
    if path is None:
        return None
    path = os.path.abspath(path)
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == "<module>"
            and frame.f_globals.get("__name__") == "__main__"
            and os.path.abspath(code.co_filename) == path
        ):
            break
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    tree = script_tree(path)
    if tree is None or not runs_unconditionally(tree.body, line):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read().splitlines()[line - 1].strip()
    except (OSError, IndexError):
        source = ""
    shown = f" (`{source}`)" if source else ""
    return (
        f"{what} was started at the top level of {path}, line {line}{shown}, outside "
        '`if __name__ == "__main__":`. The spawn and forkserver start methods start each worker '
        "by running the main script again (as `__mp_main__`), so each worker would run this line "
        f"too and try to start {what} of its own while it starts up; the workers would die before "
        f"they are ready. {_GUARD_FIX}"
    )
