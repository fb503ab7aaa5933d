"""Rate limiters: Reverb's admission rules, and their settings."""

from __future__ import annotations

import math

import pytest

import distore_ucx as ds
from distore_ucx.errors import ConfigError
from distore_ucx.rate_limiters import RateLimiter


def test_min_size_blocks_samples_until_enough_items():
    rl = ds.MinSize(3)
    assert rl.can_insert(size=0, inserts=0, samples=0, n=1000)
    assert not rl.can_sample(size=2, inserts=2, samples=0, n=1)
    assert rl.can_sample(size=3, inserts=3, samples=10**6, n=1)


def test_sample_to_insert_ratio():
    rl = ds.SampleToInsertRatio(samples_per_insert=2.0, min_size_to_sample=10, error_buffer=4.0)
    # offset = 20; diff must stay within [16, 24]
    assert rl.can_insert(size=5, inserts=5, samples=0, n=5)  # below min size: always
    assert not rl.can_sample(size=9, inserts=9, samples=0, n=1)
    assert rl.can_sample(size=10, inserts=10, samples=0, n=4)  # diff 20 - 4 = 16
    assert not rl.can_sample(size=10, inserts=10, samples=0, n=5)  # 15 < 16
    assert rl.can_insert(size=10, inserts=10, samples=0, n=2)  # 24
    assert not rl.can_insert(size=10, inserts=10, samples=0, n=3)  # 26 > 24
    assert rl.can_insert(size=12, inserts=12, samples=4, n=2)  # 28 - 4 = 24
    state = rl.state(size=10, inserts=10, samples=3)
    assert state["diff"] == 17 and state["min_diff"] == 16 and state["max_diff"] == 24


def test_queue():
    rl = ds.Queue(4)
    assert rl.can_insert(size=0, inserts=0, samples=0, n=4)
    assert not rl.can_insert(size=4, inserts=4, samples=0, n=1)
    assert rl.can_sample(size=4, inserts=4, samples=0, n=4)
    assert not rl.can_sample(size=4, inserts=4, samples=0, n=5)
    assert rl.admits_insert_batch(4) and not rl.admits_insert_batch(5)


def test_wire_round_trip_keeps_infinities():
    for rl in (ds.MinSize(2), ds.Queue(7), ds.SampleToInsertRatio(1.5, 100, 30)):
        assert RateLimiter.from_wire(rl.to_wire()) == rl
    assert math.isinf(RateLimiter.from_wire(ds.MinSize().to_wire()).max_diff)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ds.SampleToInsertRatio(0, 1, 1), "samples_per_insert"),
        (lambda: ds.SampleToInsertRatio(4, 1, 1), "error_buffer"),
        (lambda: ds.MinSize(0), "min_size_to_sample"),
        (lambda: ds.Queue(0), "queue size"),
        (lambda: RateLimiter.from_wire({"kind": "x"}), "malformed"),
    ],
)
def test_bad_settings(make, message):
    with pytest.raises(ConfigError, match=message):
        make()
