"""The shared cells of one pool worker and the process-shared lock over them (Note [taking back
a chunk] in ``_worker``).

Five int64 cells live in one block of ``multiprocessing``'s shared heap (an unlinked file, gone
with its users), followed by the lock where the OS allows it there: an unnamed POSIX semaphore
(``sem_init(pshared=1)``, ``_os.init_semaphore``), so nothing is named in /dev/shm and nothing
is left if a process dies. Where process-shared semaphores do not exist (macOS, or
``JAXTRANSPORT_PLATFORM=portable``), the block carries a ``multiprocessing`` lock instead (a
named semaphore unlinked at once), which travels with it to the worker at spawn.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .. import _os

STARTED_ID, STARTED_SEQ, TAKEN_UPTO, SKIPPED_SEQ, HAS_LOCK = 0, 1, 2, 3, 4
_CELLS = 5
_SEM_WORDS = _os.SEM_BYTES // 8


class Block:
    """What the parent makes for one worker before it starts and passes to it as a ``Process``
    argument: the cells (and the semaphore, ``HAS_LOCK``), or the cells and ``lock``."""

    __slots__ = ("cells", "lock")

    def __init__(self, cells: Any, lock: Any = None):
        self.cells, self.lock = cells, lock

    def __getstate__(self) -> tuple:
        return (self.cells, self.lock)

    def __setstate__(self, state: tuple) -> None:
        self.cells, self.lock = state


def new_block(ctx) -> Block:
    """A block for one worker, made in the parent before the worker starts; pass it to the
    worker as a ``Process`` argument and wrap it with :class:`Cells` on both sides."""
    cells = ctx.RawArray("q", _CELLS + _SEM_WORDS)
    cells[STARTED_ID] = -1  # _processes.STARTING until worker_main runs
    cells[HAS_LOCK] = int(_os.init_semaphore(ctypes.addressof(cells) + 8 * _CELLS))
    return Block(cells, None if cells[HAS_LOCK] else ctx.Lock())


class Cells:
    """The cells, and ``lock``: ``acquire(blocking)``/``release``."""

    __slots__ = ("block", "lock")

    def __init__(self, block: Block):
        self.block = block.cells
        lib = _os.semaphores()
        if block.cells[HAS_LOCK] == 1 and lib is not None:
            self.lock: Any = _os.SemLock(lib, ctypes.addressof(block.cells) + 8 * _CELLS)
        else:
            self.lock = block.lock

    def __getitem__(self, i: int) -> int:
        return self.block[i]

    def __setitem__(self, i: int, v: int) -> None:
        self.block[i] = v
