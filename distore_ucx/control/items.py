"""The control plane's item records: columns of numpy arrays.

Where each item's bytes are (node, slot offset, generation) and its lease
count; key, priority, sequence and times sampled live in the native
TableCore under the same record id. 29 bytes an item here (a 24-byte place
record, a 4-byte lease count, a 1-byte state); `locations` joins the place
records with the core's keys into protocol.ITEM_LOCATION records for a
sample reply, in one native call. (An ItemStore without a key source, used
on its own, keeps a key column of its own.) A record is LIVE (sampleable),
RETIRED (out of the table but its slot still leased by a learner) or FREE
(reusable). Record ids are never reused while a lease covers them.

Memory: new ids come from a high-water mark, so the free list holds only
released ids (4 bytes each), not one entry per record; the columns double
while small but grow no further than `limit` (the table's capacity plus
headroom) until more records than that are needed (items evicted while
leased), then by an eighth at a time.
"""

from __future__ import annotations

import numpy as np

from ..protocol import ITEM_LOCATION

FREE, LIVE, RETIRED = 0, 1, 2

# Where an item is: ITEM_LOCATION without the key (the table core holds
# keys). One structured column, so that a sample reply gathers its rows in
# one pass; `pad` stays 0 (it travels as ITEM_LOCATION's pad).
PLACE = np.dtype([("node", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("generation", "<u8")])
_PLACE_FIELDS = ("node", "offset", "generation")


class ItemStore:
    """Columns of item records; `alloc` and `release` take whole batches.

    `keys`: the table's native TableCore, which holds each record's key
    (`record_keys`, `locations`); without it the store keeps a key column.
    """

    def __init__(self, initial: int = 1024, limit: int | None = None, keys=None):
        columns = {"place": PLACE, "leases": np.uint32, "state": np.uint8}
        if keys is None:
            columns["key"] = np.uint64
        self.cols: dict[str, np.ndarray] = {
            name: np.zeros(initial, dtype=dt) for name, dt in columns.items()
        }
        self._keys = keys
        self._places = None  # the place column as (n, 3) uint64 words (`locations`)
        self._limit = limit
        self._next = 0  # ids >= this were never handed out
        self._free = np.empty(0, dtype=np.uint32)  # released ids (a stack)
        self._nfree = 0

    def __getattr__(self, name: str) -> np.ndarray:
        # The columns by name: node, offset and generation are views of the
        # place column (assignments write through). There is no `key` column
        # when the table core holds the keys: `keys(recs)` reads them.
        cols = self.__dict__["cols"]
        if name in _PLACE_FIELDS:
            return cols["place"][name]
        try:
            return cols[name]
        except KeyError:
            raise AttributeError(name) from None

    def keys(self, recs: np.ndarray) -> np.ndarray:
        """The keys of records `recs` (ids, or a mask over every record;
        uint64, a copy): the key last given to each, whether or not it is
        still in the table.

        >>> store.keys(store.state == LIVE)
        """
        recs = np.asarray(recs)
        if recs.dtype == np.bool_:
            recs = np.flatnonzero(recs)
        recs = np.ascontiguousarray(recs, np.int64)
        if self._keys is not None:
            return self._keys.record_keys(recs)
        return self.cols["key"][recs]

    @property
    def location(self) -> np.ndarray:
        """Every record as protocol.ITEM_LOCATION (a copy; `locations` for some)."""
        return self.locations(np.arange(self.capacity, dtype=np.int64))

    def set_keys(self, recs: np.ndarray, keys: np.ndarray) -> None:
        """Record the keys of new records (kept by the table core when it is the
        key source: it takes them at insert)."""
        if self._keys is None:
            self.cols["key"][recs] = keys

    def locations(self, recs: np.ndarray) -> np.ndarray:
        """protocol.ITEM_LOCATION records of `recs`, as a sample reply sends them."""
        recs = np.ascontiguousarray(recs, np.int64)
        if self._keys is not None:
            place = self.cols["place"]
            if self._places is None or self._places.base is not place:  # made, or regrown
                self._places = place.view(np.uint64).reshape(-1, 3)
            # frombuffer: the same records as .view(ITEM_LOCATION), without
            # numpy's Python-level check of a view to a structured dtype.
            return np.frombuffer(self._keys.locations(self._places, recs), ITEM_LOCATION)
        out = np.zeros(len(recs), ITEM_LOCATION)
        place = self.cols["place"][recs]
        for name in _PLACE_FIELDS:
            out[name] = place[name]
        out["key"] = self.cols["key"][recs]
        return out

    @property
    def capacity(self) -> int:
        """Records allocated (used or free)."""
        return len(self.cols["state"])

    def alloc(self, k: int) -> np.ndarray:
        """Ids of k FREE records (grows the columns if needed); released ids first."""
        reuse = min(k, self._nfree)
        self._nfree -= reuse
        ids = np.empty(k, dtype=np.int64)
        ids[:reuse] = self._free[self._nfree : self._nfree + reuse][::-1]
        fresh = k - reuse
        if fresh:
            if self._next + fresh > self.capacity:
                self._grow(self._next + fresh)
            ids[reuse:] = np.arange(self._next, self._next + fresh, dtype=np.int64)
            self._next += fresh
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Mark records FREE and reusable."""
        if len(ids) == 0:
            return
        self.cols["state"][ids] = FREE
        need = self._nfree + len(ids)
        if need > len(self._free):
            grown = np.empty(max(need, 2 * len(self._free), 1024), dtype=np.uint32)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : need] = ids
        self._nfree = need

    def extra_nbytes(self) -> dict[str, int]:
        """Bytes held besides the columns (the free list), for memory reports."""
        return {"free_list": int(self._free.nbytes)}

    def _grow(self, at_least: int) -> None:
        old = self.capacity
        new = max(at_least, 2 * old)
        if self._limit is not None:
            if at_least <= self._limit:
                new = min(new, self._limit)
            else:
                new = max(at_least, old + old // 8)
        for name, col in self.cols.items():
            grown = np.zeros(new, dtype=col.dtype)
            grown[:old] = col
            self.cols[name] = grown
