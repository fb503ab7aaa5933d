"""The storage node's arena: one registered region carved into slots.

Each table gets slots of its own fixed size, taken from a shared bump
pointer and recycled through its SlotTable (storage/slots.py), which also
keeps what each acknowledged slot holds; a slot is freed only when the
control plane says so, which it does only once no lease covers it.
Thread safety: one asyncio thread uses an Arena.
"""

from __future__ import annotations

import numpy as np

from .._native_loader import _native
from ..errors import StorageFull
from ..spec import SLOT_HEADER
from .slots import SlotTable


class Arena:
    """Slots in one UCX-registered region, remote READ only."""

    def __init__(self, runtime, size: int, hugepages: bool = True, node_name: str = "node",
                 write_protect: bool = True):
        if write_protect:
            # Peers read through a read-only mapping: UCX's software
            # transports ignore registration access flags, so only this turns
            # a remote write into a fault instead of changed data.
            self.region = _native.MemoryRegion.write_protected(runtime.context, size)
        else:
            self.region = runtime.map_region(size, remote_read=True, hugepages=hugepages)
        self.size = size
        self.node_name = node_name
        self._bump = 0
        self._tables: dict[str, SlotTable] = {}
        self._generation = 0
        self.used_bytes = 0

    @property
    def base(self) -> int:
        """Virtual address of the region (what remote reads are relative to)."""
        return self.region.address

    def allocate(self, table: str, slot_size: int, k: int) -> np.ndarray:
        """Offsets of k free slots of `slot_size` bytes for `table`; all or nothing."""
        slots = self._tables.setdefault(table, SlotTable(slot_size))
        if slots.slot_size != slot_size:
            raise StorageFull(
                f"table {table!r} changed its slot size ({slots.slot_size} -> {slot_size}) on "
                f"node {self.node_name}: recreate it under a new name"
            )
        rest = k - min(k, slots.free_slots)
        if self._bump + rest * slot_size > self.size:
            held = sorted(((t.n * t.slot_size, name) for name, t in self._tables.items()
                           if t.n), reverse=True)  # carved slots stay with their table
            holders = ", ".join(f"table {name!r} ({b} bytes)" for b, name in held)
            top = held[0][1] if held else table
            raise StorageFull(
                f"node {self.node_name}: arena full ({self.used_bytes} of {self.size} bytes "
                f"used) while inserting {k} items of {slot_size} bytes into table {table!r}; "
                f"the space is held by {holders or 'no table yet'}. "
                + (f"One item of table {table!r} is larger than this whole arena: make "
                   "items smaller, or " if slot_size > self.size else
                   f"Lower table {table!r}'s capacity, or " if top == table else
                   f"Table {top!r} holds the most: give it a smaller capacity, or ")
                + "start more storage nodes or give nodes a larger --arena"
            )
        reused = slots.reuse(k)
        fresh = self._bump + np.arange(rest, dtype=np.uint64) * np.uint64(slot_size)
        slots.carve(fresh)
        self._bump += rest * slot_size
        self.used_bytes += k * slot_size
        return np.concatenate([reused, fresh]) if len(reused) else fresh

    def commit(self, table: str, offsets: np.ndarray, keys, generations, priorities) -> None:
        """The control plane acknowledged these slots' items: remember what they hold."""
        self._tables[table].commit(offsets, keys, generations, priorities)

    def free(self, table: str, offsets: np.ndarray) -> None:
        """Return slots to the table's free list (the control plane released them)."""
        slots = self._tables.get(table)
        if slots is None or len(offsets) == 0:
            return
        try:
            freed = slots.release(offsets)
        except ValueError:
            raise ValueError(f"node {self.node_name}: free of slots never allocated in table "
                             f"{table!r}") from None
        self.used_bytes -= freed * slots.slot_size

    def tables(self) -> dict[str, SlotTable]:
        """Every table that has slots here, by name."""
        return dict(self._tables)

    def write(self, offsets: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Write items (header + packed rows) into slots; returns their generations."""
        k = len(offsets)
        gens = self._generation + 1 + np.arange(k, dtype=np.uint64)
        self._generation += k
        header = np.empty((k, 2), dtype=np.uint64)
        header[:, 0] = keys
        header[:, 1] = gens
        # Payload first, header last: two batched copies, no staging copy.
        _native.scatter_rows(self.region, offsets + np.uint64(SLOT_HEADER), rows)
        _native.scatter_rows(self.region, offsets, header.view(np.uint8))
        return gens
