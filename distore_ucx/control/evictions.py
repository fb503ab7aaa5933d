"""What leaves a table, as the table hands it to the rest of the control plane.

An item that leaves (evicted by the remover, used up, released, dropped
with its node) either had no lease left, and its slot is freed on its node
at once (`Freed`), or a learner still holds a lease on it: it is retired
(`Retired`), its slot kept until the last lease ends and its header marked
retired on its node meanwhile (control/retirements.py). An insert gives
back both (`Evicted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class Freed:
    """Slots whose records left the control plane: (node ids, offsets)."""

    nodes: np.ndarray
    offsets: np.ndarray

    @classmethod
    def empty(cls) -> Freed:
        """No slots: one shared instance (every sample and release makes one;
        its arrays hold nothing to write, and `+` makes a new Freed)."""
        return _NO_SLOTS

    def __add__(self, other: Freed) -> Freed:
        return Freed(
            np.concatenate([self.nodes, other.nodes]), np.concatenate([self.offsets, other.offsets])
        )


_NO_SLOTS = Freed(np.empty(0, np.uint32), np.empty(0, np.uint64))
_NO_SLOTS.nodes.setflags(write=False)
_NO_SLOTS.offsets.setflags(write=False)


@dataclass
class Retired:
    """Leased items that left the table (evicted): their slots stay until
    the lease ends, and their nodes mark the slots' headers retired so that
    no read of them passes its header check (control/retirements.py)."""

    nodes: np.ndarray
    offsets: np.ndarray
    generations: np.ndarray
    recs: np.ndarray  # their records (a cold one's staged copies are found by it)

    @classmethod
    def empty(cls) -> Retired:
        return cls(np.empty(0, np.uint32), np.empty(0, np.uint64), np.empty(0, np.uint64),
                   np.empty(0, np.int64))

    def __add__(self, other: Retired) -> Retired:
        return Retired(*(np.concatenate([a, b]) for a, b in zip(
            (self.nodes, self.offsets, self.generations, self.recs),
            (other.nodes, other.offsets, other.generations, other.recs))))

    def __len__(self) -> int:
        return len(self.nodes)


class Evicted(NamedTuple):
    """What an add evicted: `freed`, slots to free now (their items were not
    leased); `leased`, items a learner holds a lease on, retired: the caller
    has their slots marked retired before it acknowledges the insert."""

    freed: Freed
    leased: Retired
