"""The learner's default number of batches sampled ahead: bounded by items and bytes."""

from __future__ import annotations

import pytest

from distore_ucx.client.learner.sample_stream import SAMPLE_AHEAD_BYTES, resolve_sample_ahead
from distore_ucx.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("DISTORE_SAMPLE_AHEAD", raising=False)


@pytest.mark.parametrize("batch, item_bytes, expected", [
    (32, 112_912, 8),         # W1: 256 items, the cap of 8 batches
    (64, 112_912, 4),         # bounded by 256 items
    (8, 3_145_792, 8),        # W2: 8 batches of 25 MB fit in 256 MiB
    (4, 10_485_824, 6),       # W3: 256 MiB holds 6 batches of 42 MB, not 8
    (32, 10_485_824, 1),      # one batch is already past 256 MiB: no sampling ahead
    (128, 64, 2),
    (256, 64, 1),
    (1, 64, 8),
])
def test_default_is_bounded_by_items_and_bytes(batch, item_bytes, expected):
    ahead = resolve_sample_ahead(None, batch, False, item_bytes)
    assert ahead == expected
    assert ahead == 1 or ahead * batch * item_bytes <= SAMPLE_AHEAD_BYTES


def test_env_and_explicit_values_are_not_bounded_by_bytes(monkeypatch):
    assert resolve_sample_ahead(3, 32, False, 10_485_824) == 3
    monkeypatch.setenv("DISTORE_SAMPLE_AHEAD", "5")
    assert resolve_sample_ahead(None, 4, False, 10_485_824) == 5


def test_consuming_tables_neverresolve_sample_ahead():
    assert resolve_sample_ahead(None, 4, True, 64) == 1
    with pytest.raises(ConfigError, match="cannot be sampled ahead"):
        resolve_sample_ahead(2, 4, True, 64)
