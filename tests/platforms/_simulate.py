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

  And none of the POSIX I/O Windows lacks (:func:`_hide_posix_io`): no ``select.poll`` or
  epoll, ``os.writev``, ``os.killpg``, ``MSG_DONTWAIT``; for jaxtransport's own code no
  ``sendmsg``/``recvmsg``, no ``os.read``/``write``/``dup`` of a socket, ``select()`` of sockets
  only, and ``os.kill`` that terminates whatever the signal (as Windows' does);
  ``multiprocessing.connection.wait`` takes at most 63 objects, as on Windows.

What is not simulated (a real Mac or Windows may differ): how Windows hands a socket to a
child (``DupSocket``: the simulation's ``multiprocessing`` still pickles sockets with its POSIX
``DupFd``), process handles (sentinels are still fds), named pipes, the kernel's page faults
and socket buffers, and Python's own platform modules (``_posixshmem`` on Linux is a thin
layer over the same ``shm_open`` as macOS's, but macOS caps names at 31 bytes).
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


class _HiddenFromUs:
    """A method of ``socket.socket`` that jaxtransport's own code cannot see (AttributeError, as
    on Windows), while the standard library's POSIX code under the simulation keeps it."""

    def __init__(self, name: str, real):
        self.name, self.real = name, real

    def __get__(self, obj, cls=None):
        if _ours():
            raise AttributeError(f"'socket' object has no attribute {self.name!r} (hidden: as on Windows)")
        return self.real if obj is None else self.real.__get__(obj, cls)


def _is_socket(fd) -> bool:
    import stat

    try:
        fd = fd if isinstance(fd, int) else fd.fileno()
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _hide_posix_io() -> None:
    """What Windows has none of: ``select.poll`` (and epoll), ``os.writev``/``readv``,
    ``os.killpg``, ``MSG_DONTWAIT``, ``sendmsg``/``recvmsg`` (hidden from jaxtransport only:
    multiprocessing's POSIX code under the simulation still uses them). And what differs for
    jaxtransport's own calls: a socket is no file descriptor (``os.read``/``write``/``dup`` of
    one fail with EBADF), ``select()`` takes sockets only (ENOTSOCK), and ``os.kill`` terminates
    the process whatever the signal number (``os.kill(pid, 0)`` is no probe)."""
    import select
    import signal

    for name in ("poll", "epoll", "devpoll", "kqueue"):
        if hasattr(select, name):
            delattr(select, name)
    for name in ("writev", "readv", "killpg"):
        if hasattr(os, name):
            delattr(os, name)
    if hasattr(socket, "MSG_DONTWAIT"):
        delattr(socket, "MSG_DONTWAIT")
    for name in ("sendmsg", "recvmsg", "recvmsg_into"):
        setattr(socket.socket, name, _HiddenFromUs(name, getattr(socket.socket, name)))

    def guard_fd(real):
        def call(fd, *args):
            if _ours() and _is_socket(fd):
                raise OSError(errno.EBADF, "a socket is not a file descriptor (as on Windows)")
            return real(fd, *args)

        return call

    os.read, os.write, os.dup = guard_fd(os.read), guard_fd(os.write), guard_fd(os.dup)
    real_select, real_kill = select.select, os.kill

    def select_(rlist, wlist, xlist, *timeout):
        if _ours() and not all(_is_socket(f) for f in (*rlist, *wlist, *xlist)):
            raise OSError(errno.ENOTSOCK, "select() takes sockets only (as on Windows)")
        return real_select(rlist, wlist, xlist, *timeout)

    def kill(pid, sig):
        if _ours():
            return real_kill(pid, signal.SIGKILL)  # TerminateProcess, as Windows' os.kill
        return real_kill(pid, sig)

    select.select = select_
    os.kill = kill
    import multiprocessing.connection as mpc

    real_wait = mpc.wait

    def wait(object_list, timeout=None):
        object_list = list(object_list)
        if len(object_list) > 63:  # WaitForMultipleObjects' limit, as CPython's wait() there
            raise ValueError(f"need at most 63 handles, got a sequence of length {len(object_list)}")
        return real_wait(object_list, timeout)

    mpc.wait = wait


def hide(kind: str) -> None:
    """Take away what Linux adds, as on ``kind`` ("macos" or "windows"; "" does nothing)."""
    if kind not in ("", "macos", "windows"):
        raise ValueError(f"JAXTRANSPORT_SIMULATE={kind!r}: expected macos or windows")
    if kind in ("macos", "windows"):
        _hide_linux()
    if kind == "windows":
        _hide_fd_passing()
        _hide_posix_io()
