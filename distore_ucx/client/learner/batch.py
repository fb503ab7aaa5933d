"""A sampled batch: what `Learner.sample()` hands out.

Its data are views into one slot of the learner's ring (client/learner/ring.py),
valid until the slot comes round again; `clone()` keeps a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Batch:
    """A sampled batch.

    data: {field: array [n, ...]} (or one array for an unnamed spec), views
    into the learner's buffer; keys: uint64 [n]; probabilities: float64 [n],
    each item's probability when it was sampled; table_size: the table's
    size at sampling time; weights: importance weights
    (P(i) / P_min)^-beta when the learner was given `beta`, else None, where
    P_min is the smallest probability of any item in the table when the
    batch was drawn: the same as (N * P(i))^-beta / max_j (N * P(j))^-beta
    over the whole table, TorchRL's and the PER paper's normalisation (the
    table's least likely item weighs 1; weights never depend on the batch).
    """

    data: Any
    keys: np.ndarray
    probabilities: np.ndarray
    table_size: int
    weights: np.ndarray | None = None
    # A batch of slices (a table made with slice_len T): data fields are
    # [B, T, ...] (each still one C-contiguous array), `keys`,
    # `probabilities` and `weights` are the slices' (their start steps'),
    # and per step: `step_keys` [B, T] (uint64), `positions` [B, T] (each
    # step's position in its episode, uint32), `is_first` [B, T] (it starts
    # its episode) and `is_last` [B, T] (it ends its episode: done or
    # truncated, as the writer said), `mask` [B, T] (a real step; False for
    # the rows that pad a short slice, on a table with slice_pad: they
    # repeat the slice's last step, with is_first and is_last False). None
    # for a batch of items.
    step_keys: np.ndarray | None = None
    positions: np.ndarray | None = None
    is_first: np.ndarray | None = None
    is_last: np.ndarray | None = None
    mask: np.ndarray | None = None

    def clone(self) -> Batch:
        """A copy that stays valid after the learner reuses its buffer (on the
        same device, in the same framework)."""
        if isinstance(self.data, dict):
            data = {k: _copy(v) for k, v in self.data.items()}
        else:
            data = _copy(self.data)
        copies = [None if a is None else a.copy() for a in (
            self.weights, self.step_keys, self.positions, self.is_first, self.is_last,
            self.mask)]
        return Batch(data, self.keys.copy(), self.probabilities.copy(), self.table_size,
                     *copies)

    def __len__(self) -> int:
        return len(self.keys)


def _copy(x):
    # numpy and CuPy arrays copy(); torch tensors clone().
    return x.clone() if hasattr(x, "clone") else x.copy()
