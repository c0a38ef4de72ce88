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
- starting processes (``_starts``): the standard spawn and forkserver contexts, whose children
  are told the start method jaxtransport chose (Note [the child's start method]).

``JAXTRANSPORT_PLATFORM`` (``_mode``) selects a column on any host: ``portable`` or ``inband``
(unset, ``auto``: feature detection). Spawned workers inherit it. Callers import this package's
names, never its modules, and never test ``sys.platform``.
"""

from __future__ import annotations

import threading
import warnings

from ._channels import (
    DONTWAIT,
    fd_passing,
    framing,
    is_stream,
    message_socketpair,
    recv_fd,
    recv_message,
    send_fd,
    send_message,
    stream_locks,
)
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

__all__ = [
    "DONTWAIT",
    "ENV",
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
    "in_band",
    "init_semaphore",
    "is_stream",
    "kill_probes",
    "message_socketpair",
    "mode",
    "nowait_receiver",
    "nowait_sender",
    "nvidia_gpu_count",
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
    passed to another process (no fd passing, or no segments)."""
    return not fd_passing() or segment_kind() is None


def _in_band_reason() -> str:
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
