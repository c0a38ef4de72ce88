"""Which implementation of each OS facility this process uses (Note [platforms]).

``JAXTRANSPORT_PLATFORM`` is read once, the first time a facility is chosen: unset or ``auto``
(the default) lets feature detection choose per facility; ``portable`` takes the path written for
hosts without Linux's facilities (macOS: named POSIX shared memory unlinked at once, framed
stream sockets, no process-shared ``sem_init``, no ``/proc``) even where they exist; ``inband``
also gives up fd passing (Windows): arrays travel inside the pickles, as ``multiprocessing`` sends
them. Spawned workers inherit the variable with the rest of the environment.
"""

from __future__ import annotations

import os

__all__ = ["AUTO", "INBAND", "MODES", "PORTABLE", "mode"]

ENV = "JAXTRANSPORT_PLATFORM"
AUTO, PORTABLE, INBAND = "auto", "portable", "inband"
MODES = (AUTO, PORTABLE, INBAND)

_mode: str | None = None


def mode() -> str:
    """The switch: ``"auto"``, ``"portable"`` or ``"inband"`` (read once per process)."""
    global _mode
    if _mode is None:
        raw = os.environ.get(ENV, "").strip().lower() or AUTO
        if raw not in MODES:
            raise ValueError(f"{ENV}={raw!r} is not one of {', '.join(MODES)} (unset means auto)")
        _mode = raw
    return _mode
