"""Locks two processes share.

A lock placed in shared memory: an unnamed POSIX semaphore
(``sem_init(pshared=1)``) where libc has one, else a ``multiprocessing`` lock (a named
semaphore, unlinked at once) made by the caller's context.

The semaphore lives in the caller's block of shared memory, so nothing is named anywhere and
nothing is left if a process dies. macOS has ``sem_init`` but it fails (ENOSYS); there, and in
``JAXTRANSPORT_PLATFORM=portable``, :func:`init_semaphore` says False and the caller passes a
``ctx.Lock()`` to the other process instead (it pickles while a process is spawned).

A lock over a byte range of a segment (:func:`try_lock_range`): a POSIX record lock
(``fcntl(F_SETLK)``), which the kernel releases when its holder dies, even by SIGKILL inside
the locked section. It is owned by the *process*, not the thread or the fd: a second thread
of the same process "gets" it too (callers serialise their threads themselves), and closing
*any* fd of the same file drops every lock the process holds on it (callers close segment fds
only under the same serialisation). Not an OFD lock: fds passed with SCM_RIGHTS share one
open file description, so OFD locks would not exclude the processes holding them. Linux has
record locks on memfd and shared-memory files; macOS refuses them on ``shm_open`` objects, and
``JAXTRANSPORT_PLATFORM=portable`` and ``inband`` say they are missing, as there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time

from . import _mode

__all__ = ["SEM_BYTES", "SemLock", "init_semaphore", "record_locks", "semaphores", "try_lock_range", "unlock_range"]

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
                    from ctypes.util import find_library  # only where libc lacks them (glibc < 2.34)

                    name = find_library("pthread")
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


_RANGE_TRIES_S = 0.002  # how long try_lock_range retries a range another process holds


def record_locks() -> bool:
    """Whether segments take POSIX record locks here (Linux, in auto mode)."""
    return _mode.mode() == _mode.AUTO and hasattr(os, "memfd_create")


def try_lock_range(fd: int, start: int, length: int) -> bool | None:
    """Take the record lock over ``[start, start + length)`` of ``fd``'s file, without waiting
    for long: True when held, False when another process kept it for ``_RANGE_TRIES_S`` (it is
    slow or stopped inside its section), None when this host cannot lock segments."""
    if not record_locks():
        return None
    import fcntl

    deadline = 0.0
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start, os.SEEK_SET)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EINTR):
                return None  # ENOLCK, EINVAL, EBADF, ENOTSUP: no record locks on this fd
        now = time.monotonic()
        if not deadline:
            deadline = now + _RANGE_TRIES_S
        elif now > deadline:
            return False
        time.sleep(0.00005)


def unlock_range(fd: int, start: int, length: int) -> None:
    """Release what :func:`try_lock_range` took."""
    import fcntl

    fcntl.lockf(fd, fcntl.LOCK_UN, length, start, os.SEEK_SET)
