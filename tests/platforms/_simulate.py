"""Hide what Linux adds (:func:`hide`); ``sitecustomize`` calls it in every process that starts
with this directory on ``sys.path`` (PYTHONPATH: the test process and every worker it spawns),
so that jaxtransport must find its portable paths by feature detection, as on macOS or Windows. Not a jaxtransport switch:
``JAXTRANSPORT_PLATFORM`` stays unset; this only takes the facilities away.

``JAXTRANSPORT_SIMULATE``:

- ``macos``: no ``memfd_create``, ``posix_fallocate``, ``sched_getaffinity``, ``pidfd_open``;
  no ``SOCK_SEQPACKET`` (a Unix socketpair of that type fails with EPROTONOSUPPORT, as on
  macOS); no ``MAP_POPULATE``; ``madvise`` rejects Linux's advice values (EINVAL); libc's
  ``sem_init`` fails with ENOSYS (as macOS's does); ``/proc`` and ``/sys`` cannot be opened or
  listed by jaxtransport's own modules (the tests' leak checks still read them).
- ``windows``: all that, and no fd passing: no ``AF_UNIX``, ``send_fds``, ``recv_fds``,
  ``SCM_RIGHTS``, no ``fcntl`` module; ``socket.socketpair()`` is a TCP loopback pair (what
  CPython's Windows build gives). Only ``spawn`` works then (forkserver needs Unix sockets).

What is not simulated (jaxtransport still uses it on the simulated hosts, and a real Mac or
Windows may differ): ``select.poll``, ``os.writev``, ``MSG_DONTWAIT``, ``sendmsg``/``recvmsg``,
``multiprocessing.reduction.DupFd`` (Windows duplicates handles instead), the kernel's page
faults and socket buffers, and Python's own platform modules (``_posixshmem`` on Linux is a
thin layer over the same ``shm_open`` as macOS's, but macOS caps names at 31 bytes).
"""

import builtins
import ctypes
import errno
import mmap
import os
import socket
import sys


def _ours() -> bool:
    """Whether the caller two frames up is jaxtransport's own code."""
    try:
        name = sys._getframe(2).f_globals.get("__name__", "")
    except ValueError:
        return False
    return name == "jaxtransport" or name.startswith("jaxtransport.")


def _hidden_path(path) -> bool:
    try:
        p = os.fsdecode(path)
    except TypeError:
        return False
    return p.startswith(("/proc", "/sys"))


def _hide_proc() -> None:
    real_open, real_listdir = builtins.open, os.listdir

    def open_(file, *args, **kwargs):
        if _hidden_path(file) and _ours():
            raise FileNotFoundError(errno.ENOENT, "hidden by the platform simulation", file)
        return real_open(file, *args, **kwargs)

    def listdir(path="."):
        if _hidden_path(path) and _ours():
            raise FileNotFoundError(errno.ENOENT, "hidden by the platform simulation", path)
        return real_listdir(path)

    builtins.open = open_
    os.listdir = listdir


_POSIX_MADV = ("MADV_NORMAL", "MADV_RANDOM", "MADV_SEQUENTIAL", "MADV_WILLNEED", "MADV_DONTNEED", "MADV_FREE")
_LINUX_MADV = {n for n in dir(mmap) if n.startswith("MADV_") and n not in _POSIX_MADV}
_LINUX_MADV_VALUES = {getattr(mmap, n) for n in _LINUX_MADV} | {22, 23}


class _Mmap(mmap.mmap):
    def madvise(self, option, start=0, length=None):
        if option in _LINUX_MADV_VALUES:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().madvise(option, start, *(() if length is None else (length,)))


def _hide_linux() -> None:
    for name in ("memfd_create", "posix_fallocate", "sched_getaffinity", "sched_setaffinity", "pidfd_open"):
        if hasattr(os, name):
            delattr(os, name)
    for name in [n for n in dir(os) if n.startswith("MFD_")]:
        delattr(os, name)
    for name in ["MAP_POPULATE", *_LINUX_MADV]:
        if hasattr(mmap, name):
            delattr(mmap, name)
    mmap.mmap = _Mmap
    if hasattr(socket, "SOCK_SEQPACKET"):
        seqpacket = socket.SOCK_SEQPACKET.value
        delattr(socket, "SOCK_SEQPACKET")
        real_socketpair = socket.socketpair

        def socketpair(family=None, type=socket.SOCK_STREAM, proto=0):
            if int(type) & 0xF == seqpacket:
                raise OSError(errno.EPROTONOSUPPORT, os.strerror(errno.EPROTONOSUPPORT))
            return real_socketpair(family, type, proto)

        socket.socketpair = socketpair
    # libc's sem_init fails, as macOS's does (ENOSYS): a ctypes function that returns -1.
    real_getitem = ctypes.CDLL.__getitem__
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, use_errno=True)

    def _enosys(_addr, _pshared, _value):
        ctypes.set_errno(errno.ENOSYS)
        return -1

    failing = proto(_enosys)

    def getitem(self, name):
        if name == "sem_init":
            return failing
        return real_getitem(self, name)

    ctypes.CDLL.__getitem__ = getitem
    _hide_proc()


def _tcp_socketpair(family=socket.AF_INET, type=socket.SOCK_STREAM, proto=0):
    """A connected TCP loopback pair, as CPython's socketpair() on Windows."""
    lsock = socket.socket(socket.AF_INET, type, proto)
    try:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        a = socket.socket(socket.AF_INET, type, proto)
        try:
            a.connect(lsock.getsockname())
            b, _ = lsock.accept()
        except BaseException:
            a.close()
            raise
    finally:
        lsock.close()
    return a, b


def _hide_fd_passing() -> None:
    for name in ("AF_UNIX", "send_fds", "recv_fds", "SCM_RIGHTS"):
        if hasattr(socket, name):
            delattr(socket, name)
    socket.socketpair = _tcp_socketpair
    sys.modules["fcntl"] = None  # import fcntl -> ImportError


def hide(kind: str) -> None:
    """Take away what Linux adds, as on ``kind`` ("macos" or "windows"; "" does nothing)."""
    if kind not in ("", "macos", "windows"):
        raise ValueError(f"JAXTRANSPORT_SIMULATE={kind!r}: expected macos or windows")
    if kind in ("macos", "windows"):
        _hide_linux()
    if kind == "windows":
        _hide_fd_passing()
