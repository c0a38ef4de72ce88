"""Reversible entries in someone else's dispatch table (``copyreg``'s, Ray's serializers).

``register()`` and ``unregister()`` of :mod:`jaxtransport` and :mod:`jaxtransport.ray` share one
shape: remember what the table held for each type before our first entry went in, install ours,
and on unregister put back exactly what was there (or nothing, where nothing was). That shape
lives here once, so both stay idempotent and thread-safe the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

__all__ = ["Registration"]

_MISSING = object()  # "the table had no entry for this type"


class Registration:
    """Our entries in one dispatch table, and what they replaced.

    ``table`` returns the mapping to read and restore (called on each use: a table may be
    replaced, as Ray's is); ``put`` installs one of our entries (default: ``table()[cls] =
    value``) and ``drop`` removes one that had no predecessor (default: ``table().pop(cls)``),
    for tables that must be written through their owner's API.

    :meth:`install` and :meth:`restore` are idempotent; the first value a type had before any
    :meth:`install` is what :meth:`restore` puts back, however often :meth:`install` ran.
    ``lock`` (re-entrant) guards the saved entries; callers hold it around state of their own
    that must change together with the registration (the placement, patches).
    """

    def __init__(
        self,
        table: Callable[[], MutableMapping[type, Any]],
        *,
        put: Callable[[type, Any], None] | None = None,
        drop: Callable[[type], None] | None = None,
    ) -> None:
        self._table = table
        self._put = put or self._put_in_table
        self._drop = drop or self._drop_from_table
        self._saved: dict[type, Any] = {}
        self.lock = threading.RLock()

    def _put_in_table(self, cls: type, value: Any) -> None:
        self._table()[cls] = value

    def _drop_from_table(self, cls: type) -> None:
        self._table().pop(cls, None)

    def install(self, entries: Iterable[tuple[type, Any]]) -> None:
        """Install ``(type, value)`` entries, first saving what each type had before us."""
        with self.lock:
            table = self._table()
            for cls, value in entries:
                if cls not in self._saved:
                    self._saved[cls] = table.get(cls, _MISSING)
                self._put(cls, value)

    def restore(self) -> None:
        """Put back exactly what the table held before :meth:`install`; a no-op when nothing
        is installed."""
        with self.lock:
            table = self._table()
            for cls, previous in self._saved.items():
                if previous is _MISSING:
                    self._drop(cls)
                else:
                    table[cls] = previous
            self._saved.clear()

    @property
    def active(self) -> bool:
        """Whether :meth:`install` put entries in that :meth:`restore` has not taken out."""
        return bool(self._saved)
