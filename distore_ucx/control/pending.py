"""A restore's checkpointed items that no node has re-sent yet, and which
items a table keeps when a checkpoint holds more than its capacity.

While a control plane restores its checkpoint, each table holds the
checkpointed items as `Pending` (keys, priorities, use counts, insertion
sequences) until their nodes re-send them; `survivors` picks which items a
table's remover would keep, for a checkpoint (or a checkpoint of a restore
in progress) that holds more items than fit. table_restore.py uses both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..selectors import Selector
from .checkpoint import TableImage


@dataclass
class Pending:
    """Checkpointed items no node has re-sent yet (a restore in progress).

    Arrays sorted by key; `claimed` marks those a node has re-sent.
    `retired` (sorted) holds keys that had left the table while leased:
    a node that still holds one gets it freed, never resurrected.
    """

    keys: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    sequences: np.ndarray
    retired: np.ndarray
    claimed: np.ndarray
    steps: tuple | None = None  # a table of slices: (episodes, positions, flags), by key

    @classmethod
    def from_image(cls, image: TableImage, keep: np.ndarray | None = None) -> Pending:
        """The image's items; only those where `keep` is true, the others
        joining `retired` (None: all)."""
        keys, retired = image.keys, image.retired
        if keep is not None:
            keys, retired = keys[keep], np.concatenate([retired, keys[~keep]])
        order = np.argsort(keys)  # keys are unique: no need for a stable sort
        pick = order if keep is None else np.flatnonzero(keep)[order]
        steps = None if image.steps is None else tuple(a[pick] for a in image.steps)
        return cls(keys[order], image.priorities[pick], image.times_sampled[pick],
                   image.sequences[pick], np.sort(retired), np.zeros(len(order), dtype=bool),
                   steps)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Index of each key among the unclaimed ones, or -1."""
        if len(self.keys) == 0:
            return np.full(len(keys), -1, np.int64)
        # Sorted needles walk the keys in order, which stays in the caches
        # once the keys outgrow them (random needles miss on every probe).
        order = np.argsort(keys, kind="stable")
        idx = np.empty(len(keys), np.int64)
        idx[order] = np.searchsorted(self.keys, keys[order])
        np.minimum(idx, len(self.keys) - 1, out=idx)
        return np.where((self.keys[idx] == keys) & ~self.claimed[idx], idx, -1)

    def is_retired(self, keys: np.ndarray) -> np.ndarray:
        """Which keys had left the table while leased (a mask): never restored."""
        if len(self.retired) == 0:
            return np.zeros(len(keys), dtype=bool)
        idx = np.minimum(np.searchsorted(self.retired, keys), len(self.retired) - 1)
        return self.retired[idx] == keys

    @property
    def unclaimed(self) -> int:
        """Checkpointed items no node has re-sent yet."""
        return int(len(self.keys) - np.count_nonzero(self.claimed))


def survivors(remover: Selector, priorities: np.ndarray, sequences: np.ndarray, n: int,
              rng: np.random.Generator) -> np.ndarray:
    """Which `n` of these items a remover keeps when it must evict the rest
    (a mask): FIFO the newest, LIFO the oldest, a min-heap the highest
    priorities and a max-heap the lowest (ties: the oldest go first, as in
    the native heap), uniform at random, prioritized at random with
    eviction odds proportional to priority ** alpha."""
    m = len(priorities)
    keep = np.zeros(m, dtype=bool)
    if n >= m:
        keep[:] = True
        return keep
    if n <= 0:
        return keep
    kind = remover.kind
    if kind == "fifo":
        evict_first = np.argsort(sequences)
    elif kind == "lifo":
        evict_first = np.argsort(sequences)[::-1]  # sequences are unique
    elif kind == "min_heap":
        evict_first = np.lexsort((sequences, priorities))
    elif kind == "max_heap":
        evict_first = np.lexsort((sequences, -priorities))
    elif kind == "prioritized":
        # Efraimidis-Spirakis: the largest log(u) / w are a draw without
        # replacement with odds proportional to w; w = 0 is evicted last.
        w = np.power(priorities, remover.alpha)
        with np.errstate(divide="ignore"):
            score = np.where(w > 0, np.log(rng.random(m)) / np.where(w > 0, w, 1.0), -np.inf)
        evict_first = np.argsort(-score, kind="stable")
    else:  # uniform
        evict_first = rng.permutation(m)
    keep[evict_first[m - n:]] = True
    return keep
