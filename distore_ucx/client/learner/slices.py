"""A batch of a table of slices, as the caller sees it.

The learner reads a table of slices' batch as batch_size * slice_len rows,
each slice's steps in order (client/learner/reader.py); it hands it out as
batch_size slices of slice_len steps (docs/semantics.md, "Slices").
"""

from __future__ import annotations

import numpy as np

from ...protocol import STEP_LAST, STEP_PAD
from .batch import Batch


def as_slices(rows: Batch, steps: tuple[np.ndarray, np.ndarray], batch_size: int,
              slice_len: int) -> Batch:
    """A batch of rows as the caller sees a batch of slices: fields
    [B, T, ...] (views, still one C-contiguous array each), the slices'
    keys, probabilities and weights (their start steps'), and per step
    its key, position, episode markers and mask (not a padding row).
    `steps`: each row's (position, flags)."""
    t, b = slice_len, batch_size
    data = rows.data
    if isinstance(data, dict):
        data = {k: v.reshape(b, t, *v.shape[1:]) for k, v in data.items()}
    else:
        data = data.reshape(b, t, *data.shape[1:])
    positions, flags = steps
    positions, flags = positions.reshape(b, t), flags.reshape(b, t)
    step_keys = rows.keys.reshape(b, t)
    mask = (flags & STEP_PAD) == 0
    return Batch(data, step_keys[:, 0].copy(), rows.probabilities[::t].copy(),
                 rows.table_size, None if rows.weights is None else rows.weights[::t].copy(),
                 step_keys.copy(), positions.copy(), (positions == 0) & mask,
                 ((flags & STEP_LAST) != 0) & mask, mask)
