"""The shared cells of one pool worker and the process-shared lock over them (Note [taking back
a chunk] in ``_worker``).

Four int64 cells and an unnamed POSIX semaphore (``sem_init(pshared=1)``) live in one block of
``multiprocessing``'s shared heap (an unlinked file, gone with its users): nothing is named in
/dev/shm, so nothing is left there if a process dies. Where libc has no process-shared
semaphores (``sem_init`` missing or failing), ``lock`` is None and the parent never takes
chunks back (a stalled worker keeps them, as before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

STARTED_ID, STARTED_SEQ, TAKEN_UPTO, SKIPPED_SEQ, HAS_LOCK = 0, 1, 2, 3, 4
_CELLS = 5
_SEM_WORDS = 8  # 64 bytes for a sem_t (32 on glibc x86-64 and arm64)

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
        if lib is not None and not hasattr(lib, "sem_trywait"):
            name = ctypes.util.find_library("pthread")
            lib = ctypes.CDLL(name, use_errno=True) if name else None
        if lib is not None:
            for fn in ("sem_init", "sem_wait", "sem_trywait", "sem_post"):
                getattr(lib, fn).argtypes = [ctypes.c_void_p] + (
                    [ctypes.c_int, ctypes.c_uint] if fn == "sem_init" else []
                )
                getattr(lib, fn).restype = ctypes.c_int
        _libc = lib or False
    return _libc or None


def new_block(ctx):
    """A block for one worker, made in the parent before the worker starts; pass it to the
    worker as a ``Process`` argument and wrap it with :class:`Cells` on both sides."""
    block = ctx.RawArray("q", _CELLS + _SEM_WORDS)
    block[STARTED_ID] = -1  # _processes.STARTING until worker_main runs
    lib = _lib()
    block[HAS_LOCK] = int(lib is not None and lib.sem_init(ctypes.addressof(block) + 8 * _CELLS, 1, 1) == 0)
    return block


class Cells:
    """The cells, and ``lock`` (None when unavailable): ``acquire(blocking)``/``release``."""

    __slots__ = ("block", "lock")

    def __init__(self, block):
        self.block = block
        lib = _lib()
        usable = lib is not None and block[HAS_LOCK] == 1
        self.lock = _SemLock(lib, ctypes.addressof(block) + 8 * _CELLS) if usable else None

    def __getitem__(self, i: int) -> int:
        return self.block[i]

    def __setitem__(self, i: int, v: int) -> None:
        self.block[i] = v


class _SemLock:
    __slots__ = ("addr", "lib")

    def __init__(self, lib, addr: int):
        self.lib, self.addr = lib, addr

    def acquire(self, blocking: bool = True) -> bool:
        if not blocking:
            return self.lib.sem_trywait(self.addr) == 0
        while self.lib.sem_wait(self.addr) != 0:
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise OSError(e, os.strerror(e))
        return True

    def release(self) -> None:
        self.lib.sem_post(self.addr)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
