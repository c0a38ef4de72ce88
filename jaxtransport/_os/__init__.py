"""Everything jaxtransport asks of the operating system, one interface per facility.

Note [platforms]
Each facility has one small implementation per kind of host behind one interface, chosen once
per process by feature detection (never by platform name), so that a host lacking a Linux
facility takes the portable path, and a test can hide the Linux facilities to run it:

- segments (``_segments``): Linux ``memfd_create``; portable (macOS) ``shm_open``, the name
  unlinked at once; in-band (Windows) none.
- pages (``_segments``): Linux ``MADV_POPULATE_WRITE`` (or ``posix_fallocate`` +
  ``MAP_POPULATE``); portable a byte written per page.
- messages (``_channels``): Linux Unix ``SOCK_SEQPACKET``; portable Unix ``SOCK_STREAM``,
  length-prefixed, with process-shared locks where a socket is shared; in-band the platform's
  ``socketpair()``.
- fd passing (``_channels``): SCM_RIGHTS on Linux and portable; none in-band (arrays travel
  inside the pickles).
- the take-back lock (``_locks``): Linux ``sem_init(pshared=1)`` in shared memory; elsewhere a
  ``multiprocessing`` lock.
- slot-header locks (``_locks``): Linux POSIX record locks on the segment's file (released by
  the kernel when the holder dies); none elsewhere (macOS refuses them on ``shm_open``
  objects), where arrays are forwarded by copy.
- the Pool's pipes (``_pipes``, Note [pipe io]): POSIX ``select.poll``, ``sendmsg`` with
  ``MSG_DONTWAIT``, ``writev`` over ``multiprocessing`` Pipes; elsewhere (Windows, and in-band)
  socket pairs, non-blocking sockets, ``select()`` and ``multiprocessing.connection.wait``.
- CPUs, memory, liveness (``_procinfo``): Linux ``sched_getaffinity`` (and ``sched_setaffinity``,
  to pin a process to cores), ``/proc``, pidfd; elsewhere ``os.cpu_count``, ``sysconf``,
  ``kill(pid, 0)`` (and no pinning).
- a worker's C heap (``_heap``, Note [a warm heap in workers]): glibc ``mallopt`` and
  ``malloc_trim``; elsewhere the C library's own behaviour.
- starting processes (``_starts``): the standard spawn and forkserver contexts, whose children
  are told the start method jaxtransport chose (Note [the child's start method]).

``JAXTRANSPORT_PLATFORM`` (``_mode``) selects a column on any host: ``portable`` or ``inband``
(unset, ``auto``: feature detection). Spawned workers inherit it. Callers import this package's
names, never its modules, and never test ``sys.platform``; each name's module is imported on
first access (a worker loads only the facilities its tasks use).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import TYPE_CHECKING, Any

# Each name and the module that defines it, imported on first access (PEP 562): a process loads
# only the facilities it uses (a pool worker running numpy tasks: its pipes, the liveness
# watch, the take-back lock and the start method; not segments or fd passing until a task
# needs shared memory).
_NAMES = {
    "DONTWAIT": "_channels",
    "fd_passing": "_channels",
    "framing": "_channels",
    "is_stream": "_channels",
    "message_socketpair": "_channels",
    "packet_room": "_channels",
    "recv_fd": "_channels",
    "recv_message": "_channels",
    "send_fd": "_channels",
    "send_message": "_channels",
    "stream_locks": "_channels",
    "SEM_BYTES": "_locks",
    "SemLock": "_locks",
    "init_semaphore": "_locks",
    "record_locks": "_locks",
    "semaphores": "_locks",
    "try_lock_range": "_locks",
    "unlock_range": "_locks",
    "IDLE_TRIM_S": "_heap",
    "idle_trim_seconds": "_heap",
    "keep_heap_warm": "_heap",
    "trim_heap": "_heap",
    "ENV": "_mode",
    "mode": "_mode",
    "IOV": "_pipes",
    "Poller": "_pipes",
    "Wake": "_pipes",
    "advance": "_pipes",
    "kill_probes": "_pipes",
    "nowait_receiver": "_pipes",
    "nowait_sender": "_pipes",
    "parent_socket": "_pipes",
    "posix_io": "_pipes",
    "send_some": "_pipes",
    "wait_readable": "_pipes",
    "worker_pipe": "_pipes",
    "worker_reader_socket": "_pipes",
    "worker_writer": "_pipes",
    "cpu_affinity": "_procinfo",
    "cpu_count": "_procinfo",
    "fd_limit": "_procinfo",
    "free_memory": "_procinfo",
    "has_proc": "_procinfo",
    "nvidia_gpu_count": "_procinfo",
    "process_token": "_procinfo",
    "set_cpu_affinity": "_procinfo",
    "wait_for_exit": "_procinfo",
    "PAGE": "_segments",
    "addr": "_segments",
    "can_grow": "_segments",
    "capacity_failure": "_segments",
    "create_segment": "_segments",
    "format_bytes": "_segments",
    "grow_segment": "_segments",
    "populate": "_segments",
    "populate_method": "_segments",
    "segment_kind": "_segments",
    "start_context": "_starts",
}

if TYPE_CHECKING:
    from ._channels import (
        DONTWAIT,
        fd_passing,
        framing,
        is_stream,
        message_socketpair,
        packet_room,
        recv_fd,
        recv_message,
        send_fd,
        send_message,
        stream_locks,
    )
    from ._heap import IDLE_TRIM_S, idle_trim_seconds, keep_heap_warm, trim_heap
    from ._locks import SEM_BYTES, SemLock, init_semaphore, record_locks, semaphores, try_lock_range, unlock_range
    from ._mode import ENV, mode
    from ._pipes import (
        IOV,
        Poller,
        Wake,
        advance,
        kill_probes,
        nowait_receiver,
        nowait_sender,
        parent_socket,
        posix_io,
        send_some,
        wait_readable,
        worker_pipe,
        worker_reader_socket,
        worker_writer,
    )
    from ._procinfo import (
        cpu_affinity,
        cpu_count,
        fd_limit,
        free_memory,
        has_proc,
        nvidia_gpu_count,
        process_token,
        set_cpu_affinity,
        wait_for_exit,
    )
    from ._segments import (
        PAGE,
        addr,
        can_grow,
        capacity_failure,
        create_segment,
        format_bytes,
        grow_segment,
        populate,
        populate_method,
        segment_kind,
    )
    from ._starts import start_context


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DONTWAIT",
    "ENV",
    "IDLE_TRIM_S",
    "IN_BAND_THRESHOLD",
    "IOV",
    "PAGE",
    "SEM_BYTES",
    "Poller",
    "SemLock",
    "Wake",
    "addr",
    "advance",
    "can_grow",
    "capacity_failure",
    "cpu_affinity",
    "cpu_count",
    "create_segment",
    "describe",
    "fd_limit",
    "fd_passing",
    "format_bytes",
    "framing",
    "free_memory",
    "grow_segment",
    "has_proc",
    "idle_trim_seconds",
    "in_band",
    "init_semaphore",
    "is_stream",
    "keep_heap_warm",
    "kill_probes",
    "message_socketpair",
    "mode",
    "nowait_receiver",
    "nowait_sender",
    "nvidia_gpu_count",
    "packet_room",
    "parent_socket",
    "populate",
    "populate_method",
    "posix_io",
    "process_token",
    "record_locks",
    "recv_fd",
    "recv_message",
    "segment_kind",
    "semaphores",
    "send_fd",
    "send_message",
    "send_some",
    "set_cpu_affinity",
    "start_context",
    "stream_locks",
    "trim_heap",
    "try_lock_range",
    "unlock_range",
    "wait_for_exit",
    "wait_readable",
    "warn_in_band",
    "worker_pipe",
    "worker_reader_socket",
    "worker_writer",
]


IN_BAND_THRESHOLD = 1 << 62  # an shm_threshold no array reaches: everything inside the pickles


def in_band() -> bool:
    """Whether arrays must travel inside the pickles here: no shared memory that can be
    passed to another process (no fd passing, or no segments). Fixed for the life of the
    process (both are probed once), and asked by every message: worked out once."""
    global _in_band
    if _in_band is None:
        from ._channels import fd_passing
        from ._segments import segment_kind

        _in_band = not fd_passing() or segment_kind() is None
    return _in_band


_in_band: bool | None = None


def _in_band_reason() -> str:
    from ._channels import fd_passing
    from ._mode import ENV, mode

    if mode() == "inband":
        return f"{ENV}=inband is set"
    if not fd_passing():
        return "this platform cannot pass file descriptors between processes (no Unix sockets with SCM_RIGHTS)"
    return "this platform has neither memfd_create nor shm_open"


_warned = False
_warn_lock = threading.Lock()


def warn_in_band(what: str) -> None:
    """Warn, once per process, that ``what`` sends arrays in-band here, and why."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"{what}: {_in_band_reason()}, so jaxtransport sends arrays inside the pickles through "
        "the pipes, as multiprocessing does (correct, but a copy per transfer and no shared "
        "memory). Shared memory needs Linux (memfd) or a POSIX host with shm_open (macOS).",
        RuntimeWarning,
        stacklevel=3,
    )


def describe() -> dict:
    """What this process chose for each facility (for benchmarks and bug reports)."""
    from ._channels import fd_passing, framing
    from ._locks import record_locks, semaphores
    from ._mode import mode
    from ._pipes import posix_io
    from ._procinfo import cpu_count, has_proc
    from ._segments import populate_method, segment_kind

    return {
        "mode": mode(),
        "segments": segment_kind() or "none (in-band)",
        "populate": populate_method() if segment_kind() else "-",
        "messages": framing(),
        "fd_passing": fd_passing(),
        "pipes": "posix" if posix_io() else "sockets",
        "shared_lock": "sem_init" if semaphores() is not None else "multiprocessing.Lock",
        "header_locks": "fcntl record locks" if record_locks() else "none (forwarding copies)",
        "proc": has_proc(),
        "cpus": cpu_count(),
    }
