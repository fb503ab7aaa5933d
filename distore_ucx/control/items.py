"""The control plane's item records: columns of numpy arrays, grown by doubling.

Where each item's bytes are (node, slot offset, generation) and its lease
count; priorities, sequence and times sampled live in the native TableCore
under the same record id. About 30 bytes an item here. A record is LIVE
(sampleable), RETIRED (out of the table but its slot still leased by a
learner) or FREE (reusable). Record ids are never reused while a lease
covers them.
"""

from __future__ import annotations

import numpy as np

from ..protocol import ITEM_LOCATION

FREE, LIVE, RETIRED = 0, 1, 2

# Location fields share one structured column, so that a sample reply
# gathers them with one fancy index and sends them as one buffer.
_COLUMNS = {
    "location": ITEM_LOCATION,
    "leases": np.uint32,
    "state": np.uint8,
}
_LOCATION_FIELDS = ("node", "offset", "generation", "key")


class ItemStore:
    """Columns of item records; `alloc` and `release` take whole batches."""

    def __init__(self, initial: int = 1024):
        self.cols: dict[str, np.ndarray] = {
            name: np.zeros(initial, dtype=dt) for name, dt in _COLUMNS.items()
        }
        self._free = np.arange(initial - 1, -1, -1, dtype=np.int64)
        self._nfree = initial

    def __getattr__(self, name: str) -> np.ndarray:
        cols = self.__dict__["cols"]
        if name in _LOCATION_FIELDS:
            return cols["location"][name]  # a view: assignments write through
        try:
            return cols[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def capacity(self) -> int:
        """Records allocated (used or free)."""
        return len(self.cols["state"])

    def alloc(self, k: int) -> np.ndarray:
        """Ids of k FREE records (grows the columns if needed)."""
        if k > self._nfree:
            self._grow(self.capacity + k)
        self._nfree -= k
        return self._free[self._nfree : self._nfree + k][::-1].copy()

    def release(self, ids: np.ndarray) -> None:
        """Mark records FREE and reusable."""
        if len(ids) == 0:
            return
        self.cols["state"][ids] = FREE
        need = self._nfree + len(ids)
        if need > len(self._free):
            grown = np.empty(max(need, 2 * len(self._free)), dtype=np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : need] = ids
        self._nfree = need

    def _grow(self, at_least: int) -> None:
        old = self.capacity
        new = max(at_least, 2 * old)
        for name, col in self.cols.items():
            grown = np.zeros(new, dtype=col.dtype)
            grown[:old] = col
            self.cols[name] = grown
        fresh = np.arange(new - 1, old - 1, -1, dtype=np.int64)
        free = np.empty(max(len(self._free), self._nfree + len(fresh)), dtype=np.int64)
        free[: len(fresh)] = fresh
        free[len(fresh) : len(fresh) + self._nfree] = self._free[: self._nfree]
        self._free = free
        self._nfree += len(fresh)
