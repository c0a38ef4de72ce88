"""The receiver's side: a :class:`Mapper` of one sender's segments, and per-transfer holders
(Note [slot lifetime] in ``jaxtransport._shm``)."""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import select
import socket
import time
import weakref
from typing import Any

from .. import _os
from .._errors import ShmHandleError
from ._arena import FD_MSG, close_quietly
from ._handles import ALIGN, Handle

__all__ = ["Mapper", "collect_deferred"]


# --------------------------------------------------------------------------------------------
# Receiver side


class _Mapped:
    __slots__ = ("addr", "fd", "mm", "size")

    def __init__(self, size, fd):
        self.size, self.fd, self.mm, self.addr = size, fd, None, 0


def collect_deferred() -> None:
    """Run jaxlib's deferred Python decrefs now.

    ``device_put`` drops its reference to a host buffer from a runtime thread, which jaxlib
    queues until the next JAX call or ``gc.collect()``: without this a dead array's slot could
    stay held while the process sits idle. Cheap; does nothing when JAX is not imported.
    """
    from .._nojax import jax_loaded

    if not jax_loaded():
        return
    from .._compat import collect_jax_garbage  # jaxlib's private hook, probed there

    collect_jax_garbage()


def _on_holder_dead(pending, registry, holders, addr, release) -> None:
    # Runs from a weakref finalizer, possibly in any thread: atomic operations only. The
    # release is queued before the holder leaves the registry, so that a reader who looks at
    # ``live`` then ``pending`` always sees a slot in one of them until its release is taken.
    pending.append(release)
    registry.pop(addr, None)
    holders.pop(addr, None)


class Mapper:
    """A receiver's view of one sender's segments. Not thread-safe: one thread receives.

    ``holder(handle)`` validates a handle and returns a fresh per-transfer holder object over
    the slot; when the holder (and every array over it) dies, the handle is queued in
    ``pending`` for the sender (``take_releases``). ``find(addr, nbytes)`` tells whether memory at
    ``addr`` is a live received slot (so it can be sent back as a handle, not a copy).
    """

    def __init__(
        self,
        sock: socket.socket | None,
        label: str = "the sender",
        wait_fd: float = 10.0,
        keep_fds: bool = False,
        max_kept: int | None = None,
    ):
        self.sock = sock
        self.keep_fds = keep_fds  # keep each segment's fd after mapping it (to pass it on)
        self.max_kept = max_kept  # ... for at most this many segments (None: the caller trims)
        self.label = label
        self.wait_fd = wait_fd
        self.segs: dict[int, _Mapped] = {}
        self.forgotten: set[int] = set()
        self.pending: collections.deque = collections.deque()
        self.live: dict[int, Handle] = {}  # addr -> handle of a live holder
        self.holders: dict[int, weakref.ref] = {}  # addr -> that holder, weakly

    def take_releases(self, limit: int | None = None) -> list:
        """Pop queued releases (at most ``limit``) for the sender. Safe beside another thread
        taking them too (each release goes to one of them)."""
        if self.live:
            collect_deferred()
        pending = self.pending
        n = len(pending)
        if limit is not None:
            n = min(n, limit)
        pop = pending.popleft
        out = []
        try:
            for _ in range(n):
                out.append(pop())
        except IndexError:  # another thread took some since len()
            pass
        return out

    def _drain(self, want: int | None, timeout: float) -> None:
        if self.sock is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            r, _, _ = select.select([self.sock], [], [], 0 if want is None else max(deadline - time.monotonic(), 0))
            if not r:
                return
            try:
                data, fds = _os.recv_fd(self.sock, FD_MSG.size)
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, EOFError):
                return
            if not data:
                return
            seg_id, size = FD_MSG.unpack(data)
            for extra in fds[1:]:
                os.close(extra)
            if not fds:
                continue
            if seg_id in self.forgotten:
                os.close(fds[0])
                continue
            old = self.segs.pop(seg_id, None)
            if old is not None:
                close_quietly(old)
            self.segs[seg_id] = _Mapped(size, fds[0])
            if want is not None and seg_id == want:
                return

    def _segment(self, seg_id: int) -> _Mapped:
        m = self.segs.get(seg_id)
        if m is None and seg_id not in self.forgotten:
            self._drain(seg_id, self.wait_fd)
            m = self.segs.get(seg_id)
        if m is None:
            raise ShmHandleError(
                f"Bad shared-memory handle: segment {seg_id} of {self.label} is unknown here "
                f"({'it was freed' if seg_id in self.forgotten else 'its fd never arrived'}). "
                "The memory this task referred to no longer exists; the task cannot run."
            )
        if m.mm is None:
            # Not populated: the sender allocated every page, so first accesses only fill
            # page-table entries, and only for what this receiver reads (Note [how a segment
            # gets its pages]).
            m.mm = mmap.mmap(m.fd, m.size, flags=mmap.MAP_SHARED)
            m.addr = _os.addr(m.mm)
            if not self.keep_fds or (
                self.max_kept is not None
                and sum(1 for s in self.segs.values() if s.fd is not None and s.mm is not None) > self.max_kept
            ):
                os.close(m.fd)
                m.fd = None
        return m

    def adopt(self, seg_id: int, fd: int) -> None:
        """Take ownership of ``fd``, an fd of segment ``seg_id`` that arrived with a message
        (SCM_RIGHTS), and keep it only if this segment is new here: a known (cached) or
        forgotten segment's duplicate is closed at once, so at most one fd per segment is ever
        open, and only until the segment is first mapped (``keep_fds``: while it is mapped).
        Raises ShmHandleError (fd closed) for something that is not a segment of a plausible
        size."""
        try:
            size = os.fstat(fd).st_size
        except OSError:
            size = -1
        if seg_id in self.segs or seg_id in self.forgotten or size <= 0:
            os.close(fd)
            if size <= 0:
                raise ShmHandleError(f"Bad shared-memory fd for segment {seg_id} of {self.label}: not a memory segment")
            return
        self.segs[seg_id] = _Mapped(size, fd)

    def mapping(self, seg_id: int) -> mmap.mmap:
        """The mapping of segment ``seg_id`` (mapped now if it is not yet). Raises ShmHandleError."""
        return self._segment(seg_id).mm  # type: ignore[return-value]  # mapped by _segment

    def holder(self, handle: Handle, release: Any = None):
        """A fresh ctypes array over the slot ``handle`` names. See Note [slot lifetime].

        Raises ShmHandleError for a malformed handle, an unknown segment, or a range outside it.
        """
        try:
            seg_id, offset, nbytes, gen = handle
            seg_id, offset, nbytes, gen = int(seg_id), int(offset), int(nbytes), int(gen)
        except (TypeError, ValueError):
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: expected (segment, offset, nbytes, generation)"
            ) from None
        m = self._segment(seg_id)
        if offset < 0 or nbytes < 0 or offset + nbytes > m.size or offset % ALIGN:
            raise ShmHandleError(
                f"Bad shared-memory handle {handle!r}: bytes [{offset}, {offset + nbytes}) are outside "
                f"segment {seg_id} of {self.label} ({m.size} bytes) or misaligned: the handle is "
                "truncated or corrupt. Only this task fails."
            )
        h = (ctypes.c_char * max(nbytes, 1)).from_buffer(m.mm, offset)  # type: ignore[arg-type]
        addr = m.addr + offset
        self.live[addr] = Handle(seg_id, offset, nbytes, gen)
        self.holders[addr] = weakref.ref(h)
        weakref.finalize(
            h, _on_holder_dead, self.pending, self.live, self.holders, addr, handle if release is None else release
        )
        return h

    def find(self, addr: int, nbytes: int) -> Handle | None:
        h = self.live.get(addr)
        if h is not None and h.nbytes == nbytes:
            return h
        return None

    def held_at(self, addr: int, nbytes: int) -> tuple[Handle, Any, int | None, int] | None:
        """``(handle, holder, fd, segment size)`` when memory at ``addr`` of ``nbytes`` bytes
        (up to ``ALIGN`` less than the slot: slots are rounded up) is exactly a live received
        slot, its holder still alive; ``fd`` is the segment's kept fd (None: not kept)."""
        h = self.live.get(addr)
        ref = self.holders.get(addr)
        holder = None if ref is None else ref()
        if h is None or holder is None or not 0 <= h.nbytes - nbytes < ALIGN:
            return None
        m = self.segs.get(h.seg)
        if m is None or m.mm is None:
            return None
        return h, holder, m.fd, m.size

    def unmap(self, seg_id: int) -> int:
        """Drop the mapping and fd of ``seg_id`` without forgetting the segment (a later message
        may bring its fd again); the bytes unmapped. The caller knows nothing is over it."""
        m = self.segs.pop(seg_id, None)
        if m is None:
            return 0
        close_quietly(m)
        return m.size

    def forget(self, seg_ids) -> None:
        for seg_id in seg_ids:
            self.forgotten.add(seg_id)
            m = self.segs.pop(seg_id, None)
            if m is not None:
                close_quietly(m)

    def close(self) -> None:
        """Close fds and drop mappings (arrays still aliasing a mapping keep it alive)."""
        self._drain(None, 0)
        for m in self.segs.values():
            close_quietly(m)
        self.segs.clear()
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
