"""Importance weights (client/learner/weights.py) and a batch's copy (client/learner/batch.py)."""

from __future__ import annotations

import numpy as np

from distore_ucx.client.learner.batch import Batch
from distore_ucx.client.learner.weights import importance_weights


def test_weights_are_normalised_by_the_tables_least_likely_item_not_the_batch():
    table = np.array([0.1, 0.2, 0.3, 0.4])  # every item's probability
    beta = 0.6
    batch = table[[1, 3]]  # the least likely item is not in the batch
    got = importance_weights(batch, np.full(2, table.min()), beta)
    n = len(table)
    whole = (n * table) ** -beta
    np.testing.assert_allclose(got, (n * batch) ** -beta / whole.max())
    assert got.max() < 1.0


def test_weights_without_the_tables_minimum_fall_back_to_the_batchs_largest():
    probs = np.array([0.25, 0.5])
    got = importance_weights(probs, np.zeros(2), 1.0)
    np.testing.assert_allclose(got, [1.0, 0.5])


def test_a_clone_shares_no_memory_with_the_batch():
    data = {"obs": np.arange(6.0).reshape(3, 2)}
    batch = Batch(data, np.arange(3, dtype=np.uint64), np.full(3, 1 / 3), 3, np.ones(3))
    copy = batch.clone()
    batch.data["obs"][:] = -1
    batch.keys[:] = 9
    batch.weights[:] = 0
    assert copy.data["obs"][2, 1] == 5.0 and copy.keys.tolist() == [0, 1, 2]
    assert copy.weights.tolist() == [1.0, 1.0, 1.0] and len(copy) == 3
