"""The slots of one table on one storage node, and what each holds.

A slot is FREE (reusable), ALLOCATED (an insert is writing it or waiting
for the control plane) or LIVE (the control plane acknowledged its item).
LIVE slots keep the item's key, generation and insert priority (and a
step's episode, position and flags, in a table of slices): after the
control plane restarts, the node re-sends them, because the node's slot
table is the truth about which bytes it holds.

Slots are numbered in the order they were carved from the arena, and the
arena gives a table new slots only above its existing ones (storage/arena.py),
so offsets ascend with their number and offset -> number is a binary
search, done for a whole batch in one native call (native/slot_table.h), as
are allocation from the free stack, acknowledgement and frees.
Thread safety: one asyncio thread uses a SlotTable.
"""

from __future__ import annotations

import numpy as np

from .._native_loader import _native

FREE, ALLOCATED, LIVE = 0, 1, 2  # native/slot_table.h's kSlotFree, kSlotAllocated, kSlotLive

_COLUMNS = {"offset": np.uint64, "state": np.uint8, "key": np.uint64,
            "generation": np.uint64, "priority": np.float64}
# Steps of episodes (a table of slices), made at the first commit of steps.
_STEP_COLUMNS = {"episode": np.uint64, "position": np.uint32, "step_flags": np.uint8}


class SlotTable:
    """Slots of `slot_size` bytes: offsets, states and LIVE items' metadata."""

    def __init__(self, slot_size: int, initial: int = 1024):
        self.slot_size = slot_size
        self.n = 0  # slots carved so far
        self.cols = {name: np.zeros(initial, dt) for name, dt in _COLUMNS.items()}
        self._free = np.empty(initial, np.int64)  # a stack of FREE slot numbers
        self._nfree = 0

    @property
    def free_slots(self) -> int:
        """Slots ready for reuse."""
        return self._nfree

    @property
    def end(self) -> int:
        """Offset just past the highest slot (0 without slots): new slots go above it."""
        return int(self.cols["offset"][self.n - 1]) + self.slot_size if self.n else 0

    def reuse(self, k: int) -> np.ndarray:
        """Up to k FREE slots, now ALLOCATED: their offsets."""
        k = min(k, self._nfree)
        offsets = _native.slot_reuse(self._free, self._nfree, k, self.cols["state"],
                                     self.cols["offset"])
        self._nfree -= k
        return offsets

    def carve(self, offsets: np.ndarray) -> None:
        """Record freshly carved slots (ascending offsets, above every earlier one), ALLOCATED."""
        offsets = _u64(offsets)
        k = len(offsets)
        if self.n + k > len(self.cols["state"]):
            new = max(self.n + k, 2 * len(self.cols["state"]))
            for name, col in self.cols.items():
                grown = np.zeros(new, col.dtype)
                grown[: self.n] = col[: self.n]
                self.cols[name] = grown
        _native.slot_carve(self.cols["offset"], self.cols["state"], self.n, self.slot_size,
                           offsets)
        self.n += k

    def index(self, offsets: np.ndarray) -> np.ndarray:
        """Slot numbers of `offsets`; ValueError if any is not a slot of this table."""
        return _native.slot_index(self.cols["offset"], self.n, _u64(offsets))

    def commit(self, offsets: np.ndarray, keys, generations, priorities,
               steps: tuple | None = None) -> None:
        """ALLOCATED slots whose items the control plane acknowledged: LIVE.
        `steps`: for steps of episodes, their (episodes, positions, flags),
        kept so that a restored control plane learns where each step sits."""
        c = self.cols
        k = len(offsets)
        idx = _native.slot_commit(c["offset"], self.n, c["state"], c["key"], c["generation"],
                                  c["priority"], _u64(offsets), _u64(keys, k), _u64(generations, k),
                                  _f64(priorities, k))
        if steps is not None:
            if "episode" not in self.cols:
                size = len(self.cols["state"])
                for name, dt in _STEP_COLUMNS.items():
                    self.cols[name] = np.zeros(size, dt)
            for name, values in zip(_STEP_COLUMNS, steps):
                self.cols[name][idx] = values

    def steps_of(self, offsets: np.ndarray) -> tuple | None:
        """(episodes, positions, flags) of the slots at `offsets`, or None for
        a table of items."""
        if "episode" not in self.cols:
            return None
        idx = self.index(offsets)
        return tuple(self.cols[name][idx] for name in _STEP_COLUMNS)

    def release(self, offsets: np.ndarray, live_only: bool = False) -> int:
        """Make slots FREE; returns how many were not FREE already (a repeated
        free is ignored, so a slot is never handed out twice). `live_only`:
        leave ALLOCATED slots alone (a late free from the control plane must
        not take a slot that an insert in flight has reused)."""
        offsets = _u64(offsets)
        need = self._nfree + len(offsets)  # room for all of them, before any is pushed
        if need > len(self._free):
            grown = np.empty(max(need, 2 * len(self._free)), np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        freed = _native.slot_release(self.cols["offset"], self.n, self.cols["state"], offsets,
                                     live_only, self._free, self._nfree)
        self._nfree += freed
        return freed

    def live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """LIVE slots: (keys, offsets, generations, priorities)."""
        idx = np.flatnonzero(self.cols["state"][: self.n] == LIVE)
        c = self.cols
        return c["key"][idx], c["offset"][idx], c["generation"][idx], c["priority"][idx]

    def live_steps(self) -> tuple | None:
        """LIVE slots' (episodes, positions, flags), in live()'s order; None
        for a table of items."""
        if "episode" not in self.cols:
            return None
        idx = np.flatnonzero(self.cols["state"][: self.n] == LIVE)
        return tuple(self.cols[name][idx] for name in _STEP_COLUMNS)


def _u64(values, k: int | None = None) -> np.ndarray:
    """`values` for a native slot call taking uint64: a 1-d array (of k
    values when k is given) as it is, since the call converts its dtype or
    order; anything else through np.asarray, a scalar repeated k times."""
    return _column(values, np.uint64, k)


def _f64(values, k: int) -> np.ndarray:
    """`values` for a native slot call taking k float64 values (see _u64)."""
    return _column(values, np.float64, k)


def _column(values, dtype, k: int | None) -> np.ndarray:
    if type(values) is np.ndarray and values.ndim == 1 and (k is None or len(values) == k):
        # As it is: the native call converts another dtype or order (a copy)
        # itself, at a fraction of asarray's and the flag checks' cost
        # (reuse + commit + release of 7 slots 6.1 -> 5.1 us).
        return values
    a = np.asarray(values, dtype)
    if a.ndim == 0 and k is not None:
        return np.full(k, a, dtype)
    if k is None or a.shape == (k,):
        return a
    raise ValueError(f"slot table: {a.size} values for {k} offsets: one value per offset")
