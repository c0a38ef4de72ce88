"""CPU count and affinity, free memory, the open-file limit and process liveness: from Linux's
``/proc`` and ``sched_getaffinity`` (``sched_setaffinity``) where they exist, from
``os.sysconf``, ``os.cpu_count`` and ``os.kill(pid, 0)`` on other POSIX hosts, from
``multiprocessing``'s process sentinels where ``os.kill`` is no probe (Windows).

Every read of ``/proc`` and ``/sys`` in jaxtransport goes through this module, so a host without
them (macOS) or a test hiding them takes the portable answers."""

from __future__ import annotations

import os
from typing import Any

from . import _mode
from ._pipes import kill_probes

__all__ = [
    "cpu_affinity",
    "cpu_count",
    "free_memory",
    "has_proc",
    "nvidia_gpu_count",
    "process_token",
    "set_cpu_affinity",
    "wait_for_exit",
]


def _linux_proc() -> bool:
    if _mode.mode() != _mode.AUTO:
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False


_HAS_PROC: bool | None = None


def has_proc() -> bool:
    """Whether ``/proc`` is readable (probed once)."""
    global _HAS_PROC
    if _HAS_PROC is None:
        _HAS_PROC = _linux_proc()
    return _HAS_PROC


def cpu_count() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (Linux),
    else every CPU of the machine."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None and _mode.mode() == _mode.AUTO:
        try:
            return len(getaffinity(0))
        except OSError:  # pragma: no cover
            pass
    return os.cpu_count() or 1


def cpu_affinity() -> frozenset[int] | None:
    """The CPUs this process may run on (its affinity mask), or None where the OS has no affinity
    masks to read and set (macOS, Windows; and the portable columns, Note [platforms])."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None or not hasattr(os, "sched_setaffinity") or _mode.mode() != _mode.AUTO:
        return None
    try:
        return frozenset(getaffinity(0))
    except OSError:  # pragma: no cover
        return None


def set_cpu_affinity(cpus) -> bool:
    """Restrict this process to ``cpus`` (its calling thread, and every thread it starts from
    now on: threads already running keep their mask). False, changing nothing, where the OS has
    no affinity masks (see :func:`cpu_affinity`) or refuses this set."""
    if cpu_affinity() is None:
        return False
    try:
        os.sched_setaffinity(0, set(cpus))
    except (OSError, ValueError):
        return False
    return True


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name != "MemAvailable":
                    continue  # a loop ending in an `if` (Note [loops that end in a test])
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) > 1 << 60:
                return None
            with open(usage_path) as f:
                return max(int(raw) - int(f.read().strip()), 0)
        except (OSError, ValueError):
            continue
    return None


def _sysconf(name: str) -> int | None:
    try:
        v = os.sysconf(name)
    except (AttributeError, ValueError, OSError):
        return None
    return v if v > 0 else None


def free_memory() -> int:
    """Bytes this process could still allocate. Linux: MemAvailable, bounded by the cgroup
    limit. Elsewhere: the available physical pages where ``sysconf`` knows them, else half the
    physical memory (macOS has no count of available pages), else 8 GiB."""
    if has_proc():
        avail = _meminfo_available()
        if avail is not None:
            cg = _cgroup_free()
            return min(avail, cg) if cg is not None else avail
    page = _sysconf("SC_PAGE_SIZE") or 4096
    avail_pages = _sysconf("SC_AVPHYS_PAGES")
    if avail_pages is not None:
        return avail_pages * page
    phys = _sysconf("SC_PHYS_PAGES")
    if phys is not None:
        return phys * page // 2
    return 8 << 30


def _proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_token(pid: int) -> int | None:
    """A token of the live process ``pid`` (None when it is gone): two reads return the same
    token only for the same process. Linux: its start time (clock ticks since boot), so a
    reused pid reads differently. Other POSIX hosts: 0 while a process of that pid exists
    (``os.kill(pid, 0)``): a reused pid is not told apart there. Where ``os.kill`` is no
    probe (Windows: it terminates), 0: taken as alive (only shared-memory slots ask, and
    there are none there)."""
    if has_proc():
        return _proc_start(pid)
    if not kill_probes():
        return 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0
    except OSError:
        return None
    return 0


def wait_for_exit(pid: int, poll_s: float = 0.5, sentinel: Any = None) -> None:
    """Block until process ``pid`` is gone: a pidfd where the OS has one (Linux 5.3+), else
    ``sentinel`` (``multiprocessing``'s sentinel of that process, readable once it is gone)
    where ``os.kill`` is no probe (Windows), else a ``kill(pid, 0)`` every ``poll_s``
    seconds. Never returns where none of these can tell."""
    fd = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None and _mode.mode() == _mode.AUTO:
        try:
            fd = pidfd_open(pid)
        except OSError:
            fd = None
    if fd is not None:
        import select

        select.select([fd], [], [])
        return
    if not kill_probes():
        if sentinel is None:
            import threading

            threading.Event().wait()  # nothing tells here: never report the process gone
        from multiprocessing.connection import wait

        wait([sentinel])
        return
    import time

    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(poll_s)


def nvidia_gpu_count() -> int:
    """The NVIDIA GPUs the driver lists (Linux ``/proc/driver/nvidia/gpus``); 0 elsewhere."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def fd_limit() -> int:
    """This process's soft limit on open files (1024 where it cannot be read)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if 0 < soft < (1 << 20) else 1 << 20
