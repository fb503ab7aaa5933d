"""Importance weights of a prioritized batch (`Batch.weights`).

w_i = (P(i) / P_min)^-beta, P(i) the probability item i was drawn with and
P_min the smallest probability of any item in the table at that draw, which
every sample reply carries (`min_probability`): TorchRL's and the PER
paper's normalisation, so the table's least likely item weighs 1 and an
item's weight never depends on the rest of its batch (docs/semantics.md,
"Importance weights").
"""

from __future__ import annotations

import numpy as np


def importance_weights(probs: np.ndarray, min_probs: np.ndarray, beta: float) -> np.ndarray:
    """(P(i) / P_min)^-beta, P_min the table's smallest probability when each
    item was drawn (see Batch.weights). A reply without it (an older control
    plane) falls back to the batch's own largest weight.

    >>> importance_weights(np.array([0.1, 0.4]), np.array([0.1, 0.1]), 1.0)
    array([1.  , 0.25])
    """
    if (min_probs > 0).all():
        return (probs / min_probs) ** -beta
    w = probs ** -beta
    return w / w.max()
