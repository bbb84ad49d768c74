"""Reads kept between requests, keyed on the store's revision (tuner/db.py: every committed write
bumps it): an entry is served only to a reader that read the same (epoch, n), so it is never
older than the database that reader saw. Bounded (least recently used out first), thread-safe
(the API's endpoints run in a thread pool)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from tuner.store import Revision

V = TypeVar("V")


class RevisionCache(Generic[V]):
    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[Revision, V]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(
        self,
        key: Hashable,
        revision: Revision,
        build: Callable[[], V],
        keep_if: Callable[[V], bool] | None = None,
    ) -> V:
        """The value of `key` at `revision`: kept, or built now (outside the lock) and kept
        (unless `keep_if` says no: a value too big to keep)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found[0] == revision:
                self._entries.move_to_end(key)
                self.hits += 1
                return found[1]
            self.misses += 1
        value = build()
        if keep_if is None or keep_if(value):
            with self._lock:
                self._keep(key, revision, value)
        return value

    def get_many(
        self, keys: list[Hashable], revision: Revision, build: Callable[[list[Hashable]], dict[Hashable, V]]
    ) -> dict[Hashable, V]:
        """The values of `keys` at `revision`; those not kept are built together, by one call."""
        out: dict[Hashable, V] = {}
        with self._lock:
            for key in keys:
                found = self._entries.get(key)
                if found is not None and found[0] == revision:
                    self._entries.move_to_end(key)
                    out[key] = found[1]
            self.hits += len(out)
            self.misses += len(keys) - len(out)
        missing = [k for k in keys if k not in out]
        if missing:
            built = build(missing)
            with self._lock:
                for key in missing:
                    self._keep(key, revision, built[key])
            out |= {k: built[k] for k in missing}
        return out

    def _keep(self, key: Hashable, revision: Revision, value: V) -> None:
        kept = self._entries.get(key)
        # A reader that saw an older revision does not replace what a newer one kept.
        if kept is None or kept[0].epoch != revision.epoch or kept[0].n <= revision.n:
            self._entries[key] = (revision, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
