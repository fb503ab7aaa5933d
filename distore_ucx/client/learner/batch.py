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
    """A sampled batch, as `Learner.sample` returns it.

    A batch of slices (a table made with `slice_len` T) has data fields of
    shape [B, T, ...] (each still one C-contiguous array), `keys`,
    `probabilities` and `weights` of the slices (their start steps'), and
    the per-step arrays below; a batch of items has None for those.

    Attributes:
        data: {field: array [n, ...]} (or one array for an unnamed spec),
            views into the learner's buffer: valid until the learner reuses
            it (`clone` keeps a copy).
        keys: The items' keys, uint64 [n].
        probabilities: Each item's probability when it was sampled, float64 [n].
        table_size: The table's size at sampling time.
        weights: Importance weights (P(i) / P_min)^-beta when the learner
            was given `beta`, else None, where P_min is the smallest
            probability of any item in the table when the batch was drawn:
            the same as (N * P(i))^-beta / max_j (N * P(j))^-beta over the
            whole table, TorchRL's and the PER paper's normalisation (the
            table's least likely item weighs 1; weights never depend on the
            batch).
        step_keys: Each step's key, uint64 [B, T].
        positions: Each step's position in its episode, uint32 [B, T].
        is_first: Whether the step starts its episode, bool [B, T].
        is_last: Whether it ends its episode (done or truncated, as the
            writer said), bool [B, T].
        mask: Whether it is a real step, bool [B, T]: False for the rows
            that pad a short slice (on a table with `slice_pad`), which
            repeat the slice's last step, with is_first and is_last False.
    """

    data: Any
    keys: np.ndarray
    probabilities: np.ndarray
    table_size: int
    weights: np.ndarray | None = None
    step_keys: np.ndarray | None = None
    positions: np.ndarray | None = None
    is_first: np.ndarray | None = None
    is_last: np.ndarray | None = None
    mask: np.ndarray | None = None

    def clone(self) -> Batch:
        """A copy that stays valid after the learner reuses its buffer.

        Returns:
            A `Batch` of copies, on the same device, in the same framework.
        """
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
