"""A lock two processes share, placed in shared memory: an unnamed POSIX semaphore
(``sem_init(pshared=1)``) where libc has one, else a ``multiprocessing`` lock (a named
semaphore, unlinked at once) made by the caller's context.

The semaphore lives in the caller's block of shared memory, so nothing is named anywhere and
nothing is left if a process dies. macOS has ``sem_init`` but it fails (ENOSYS); there, and in
``JAXTRANSPORT_PLATFORM=portable``, :func:`init_semaphore` says False and the caller passes a
``ctx.Lock()`` to the other process instead (it pickles while a process is spawned).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from . import _mode

__all__ = ["SEM_BYTES", "SemLock", "init_semaphore", "semaphores"]

SEM_BYTES = 64  # room for a sem_t (32 bytes on glibc x86-64 and arm64)

_libc = None


def semaphores():
    """libc with the process-shared semaphore calls typed, or None (absent, or not in auto
    mode). Probed once."""
    global _libc
    if _libc is None:
        lib: ctypes.CDLL | None = None
        if _mode.mode() == _mode.AUTO:
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                if not hasattr(lib, "sem_trywait"):
                    name = ctypes.util.find_library("pthread")
                    lib = ctypes.CDLL(name, use_errno=True) if name else None
                if lib is not None:
                    for fn in ("sem_init", "sem_wait", "sem_trywait", "sem_post"):
                        getattr(lib, fn).argtypes = [ctypes.c_void_p] + (
                            [ctypes.c_int, ctypes.c_uint] if fn == "sem_init" else []
                        )
                        getattr(lib, fn).restype = ctypes.c_int
                if lib is not None:  # macOS has sem_init, and it fails (ENOSYS): try one
                    probe = (ctypes.c_char * SEM_BYTES)()
                    if lib.sem_init(ctypes.addressof(probe), 1, 1) != 0:
                        lib = None
                    else:
                        getattr(lib, "sem_destroy", lambda _a: 0)(ctypes.addressof(probe))
            except (OSError, AttributeError):
                lib = None
        _libc = lib or False
    return _libc or None


def init_semaphore(addr: int) -> bool:
    """Make an unlocked process-shared semaphore at ``addr`` (SEM_BYTES of shared memory);
    False where that is not possible here."""
    lib = semaphores()
    return lib is not None and lib.sem_init(addr, 1, 1) == 0


class SemLock:
    """The semaphore at ``addr`` as a lock: ``acquire(blocking)``, ``release``, ``with``."""

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
