"""No loop in the package can let a KeyboardInterrupt skip a ``with`` exit or a ``finally``.

CPython checks for signals on a loop's back edge (``JUMP_BACKWARD``). From 3.12 its compiler
can leave that jump, and the conditional jump before it, out of the exception table even when
the loop sits inside a ``with`` or ``try`` block: a loop whose body ends in an ``if`` (``for x
in xs: if x.t: use(x)``) or a ``while not ready: wait()``. A KeyboardInterrupt raised there
leaves the frame without running the block's exit, so ``with lock:`` leaves the lock held and
``finally`` does not run (python/cpython#108214, #130279: open). That is how a Ctrl-C left a
Pool's engine lock held for ever on Python 3.13.0 (``Engine._enqueue``; found by
``test_pool_lifecycle``'s Ctrl-C test, which hung about one run in 40).

This test compiles every module of the package with the running interpreter and fails on any
such hole in front of a cleanup that matters: a ``with`` exit, a ``finally``, a bare ``except``
or an ``except BaseException``. Holes in front of handlers a KeyboardInterrupt never enters
(``except OSError``, the hidden handlers of comprehensions and generator expressions) are
allowed. The fix for a hole is a loop shape the compiler covers (``if not x.t: continue``), or
the loop moved into a function of its own.
"""

from __future__ import annotations

import dis
import os
import pathlib
import sys
import types

import pytest

from .conftest import ROOT, run_python

PKG = pathlib.Path(ROOT) / "jaxtransport"

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="before 3.11 a frame's blocks are a stack, not an exception table"
)

# The names an `except` clause must match for it to matter here: those that take a
# KeyboardInterrupt, and the other exits that are not Exceptions. A clause that matches none of
# them (`except OSError:`) never runs for an interrupt, so a hole in front of it alone changes
# nothing.
_CATCH_INTERRUPTS = {"BaseException", "KeyboardInterrupt", "SystemExit", "GeneratorExit"}


def _entries(code: types.CodeType) -> list:
    return list(dis.Bytecode(code).exception_entries)


def _entry_at(entries: list, offset: int):
    for e in entries:  # 3.11+: the entries do not overlap; the one that covers an offset is used
        if e.start <= offset < e.end:
            return e
    return None


def _chain(entries: list, offset: int) -> list[int]:
    """The handlers an exception raised at ``offset`` may pass through, innermost first (an
    unmatched ``except`` re-raises from its own code, which the next entry out covers)."""
    out: list[int] = []
    e = _entry_at(entries, offset)
    while e is not None and e.target not in out:
        out.append(e.target)
        e = _entry_at(entries, e.target)
    return out


def _matters(instrs: list, target: int) -> bool:
    """Would a KeyboardInterrupt run cleanup code in the handler at ``target``?"""
    i = next(k for k, x in enumerate(instrs) if x.offset == target)
    head = instrs[i : i + 8]
    names = [x.opname for x in head]
    if names[0] == "SWAP":  # an inlined comprehension restoring its loop variable, then re-raising
        return False
    if "CALL_INTRINSIC_1" in names[:3]:  # a generator's StopIteration-to-RuntimeError wrapper
        return False
    if names[:4] == ["LOAD_CONST", "STORE_FAST", "DELETE_FAST", "RERAISE"]:  # `except E as e`'s cleanup
        return False
    if names[:3] == ["COPY", "POP_EXCEPT", "RERAISE"]:  # leaving a handler: pops, then re-raises
        return False
    if "WITH_EXCEPT_START" in names:
        return True
    if "CHECK_EXC_MATCH" in names:  # an `except X:` clause: does X take a KeyboardInterrupt?
        stop = names.index("CHECK_EXC_MATCH")
        matched = {x.argval for x in head[:stop] if isinstance(x.argval, str)}
        return bool(matched & _CATCH_INTERRUPTS)
    return True  # a finally, or a bare except


def holes(code: types.CodeType) -> list[str]:
    """Each back edge of ``code`` (and the code nested in it) where an interrupt would skip a
    handler that covers its loop's head."""
    found: list[str] = []
    entries = _entries(code)
    instrs = list(dis.get_instructions(code))
    for k, ins in enumerate(instrs):
        if ins.opname != "JUMP_BACKWARD" or not entries:
            continue
        inside = _chain(entries, ins.argval)  # the handlers around the loop's head
        if not inside:
            continue
        # The signal check runs at the jump; which instruction the exception is then said to be
        # raised at has changed between versions: the jump or the one before it. Both must be
        # covered by every handler that covers the head.
        for probe in (ins, instrs[k - 1]):
            skipped = [t for t in inside if t not in _chain(entries, probe.offset)]
            if any(_matters(instrs, t) for t in skipped):
                line = ins.positions.lineno if ins.positions else None
                found.append(f"{code.co_filename}:{line} in {code.co_qualname}")
                break
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            found += holes(c)
    return found


def _sources() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def _in_with(body: str) -> str:
    """A function whose body is ``with self.lock:`` around ``body`` (indented 8)."""
    return "def f(self, xs):\n    with self.lock:\n" + body


def _holes_in(text: str) -> list[str]:
    return holes(compile(text, "<probe>", "exec"))


def test_the_check_finds_the_hole_that_left_the_pools_lock_held():
    # The shape Engine._enqueue had; the check must see it where this compiler makes the hole,
    # and the two shapes used instead must be clean everywhere.
    bad = _in_with("        for x in xs:\n            if x.t:\n                self.use(x)\n        self.after()\n")
    wait = "def g(self):\n    with self.lock:\n        while not self.ok:\n            self.wait()\n"
    ok = _in_with("        for x in xs:\n            if not x.t:\n                continue\n            self.use(x)\n")
    if sys.version_info >= (3, 12):
        assert _holes_in(bad) and _holes_in(wait)
    assert not _holes_in(ok)
    # A handler that a KeyboardInterrupt never enters does not count.
    harmless = "def h(xs):\n    try:\n        for x in xs:\n            if x:\n                f(x)\n    except OSError:\n        pass\n"
    assert not _holes_in(harmless)


_RUN_INTERRUPTED = """
import itertools, os, signal, threading
# A run started in the background by a non-interactive shell (`cmd &`) inherits SIGINT
# ignored: Python then installs no handler, so install the default one here.
signal.signal(signal.SIGINT, signal.default_int_handler)
lock = threading.RLock()
exec(FUNC)
t = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
t.start()
try:
    f(None, itertools.repeat(0, 10**10))  # minutes of loop: the SIGINT lands in it
except KeyboardInterrupt:
    pass
t.join()
print("HELD" if lock._is_owned() else "FREE")
"""


def _held_after_ctrl_c(func_src: str) -> bool:
    """Run ``func_src`` (a ``def f(self, xs)`` over the module global ``lock``) in a fresh
    interpreter, Ctrl-C it mid-loop: is the lock still held once the KeyboardInterrupt left?"""
    out = run_python(f"FUNC = {func_src!r}\n" + _RUN_INTERRUPTED, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "HELD"


def test_the_check_agrees_with_a_real_ctrl_c():
    # The shape that hung the pool, run and interrupted for real: where this interpreter leaves
    # the lock held, the static check must flag the shape; the shape used instead never leaves it.
    bad = "def f(self, xs):\n    with lock:\n        for x in xs:\n            if x:\n                pass\n"
    ok = "def f(self, xs):\n    with lock:\n        for x in xs:\n            if not x:\n                continue\n            x = x\n"
    if _held_after_ctrl_c(bad):
        assert _holes_in(bad)
    assert not _holes_in(ok)
    assert not _held_after_ctrl_c(ok)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_interrupt_can_skip_a_cleanup(path):
    code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
    found = holes(code)
    assert not found, (
        "a KeyboardInterrupt at these loops' back edges would skip the `with` exit or `finally` "
        "around them (CPython leaves the jump out of the exception table; see this test's "
        "docstring for the shapes to use instead):\n" + "\n".join(found)
    )
