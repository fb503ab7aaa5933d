"""`distore demo` refuses an arena it cannot run on, before starting anything."""

from __future__ import annotations

import pytest

from distore_ucx.demo import check_arena, min_arena
from distore_ucx.errors import ConfigError


def test_an_arena_below_what_the_demo_holds_in_flight_is_refused_naming_the_size(monkeypatch):
    monkeypatch.delenv("DISTORE_SAMPLE_AHEAD", raising=False)
    # Two requests of 8 batches of 32 items under lease, plus the writer's batch
    # (sampling ahead 4 batches: 12 MiB ended in StorageFull, 16 MiB ran).
    need = min_arena(2, 32)
    assert 28 << 20 < need <= 30 << 20
    with pytest.raises(ConfigError, match=r"--arena 28MiB is too small.*30MiB or more"):
        check_arena("28MiB", 2, 32)
    assert check_arena("30MiB", 2, 32) == 30 << 20


def test_the_least_arena_follows_the_learners_sample_ahead(monkeypatch):
    monkeypatch.setenv("DISTORE_SAMPLE_AHEAD", "4")
    assert 12 << 20 < min_arena(2, 32) <= 16 << 20


def test_more_nodes_or_smaller_batches_need_less_arena_each():
    assert min_arena(4, 32) < min_arena(2, 32) < min_arena(1, 32)
    assert min_arena(2, 8) < min_arena(2, 32)
