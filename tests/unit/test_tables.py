"""The control plane's table: FIFO eviction, uniform sampling, leases, node loss."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.control.items import FREE, LIVE, RETIRED
from distore_ucx.control.leases import Leases
from distore_ucx.control.tables import Table
from distore_ucx.errors import ConfigError
from distore_ucx.spec import TableSpec

SPEC = TableSpec.parse(((8,), "uint8"))


def add(table, keys, node=1):
    keys = np.asarray(keys, np.uint64)
    return table.add(node, keys, keys * np.uint64(64), keys + np.uint64(1000), np.ones(len(keys)))


def live_keys(table):
    return set(table.store.key[table.live[: table.size]].tolist())


def test_fifo_evicts_oldest_first_and_frees_their_slots():
    t = Table("t", 10, SPEC)
    assert len(add(t, range(10)).nodes) == 0
    freed = add(t, range(10, 13))
    assert live_keys(t) == set(range(3, 13))
    assert sorted(freed.offsets.tolist()) == [0, 64, 128]
    assert t.deletes == 3 and t.inserts == 13 and t.size == 10


def test_batch_larger_than_capacity_keeps_the_newest():
    t = Table("t", 5, SPEC)
    add(t, range(12))
    assert live_keys(t) == set(range(7, 12))


def test_eviction_order_is_fifo_over_many_batches():
    t = Table("t", 100, SPEC)
    rng = np.random.default_rng(3)
    next_key = 0
    for _ in range(200):
        k = int(rng.integers(1, 40))
        add(t, range(next_key, next_key + k))
        next_key += k
        assert live_keys(t) == set(range(max(0, next_key - 100), next_key))


def test_uniform_sampling_is_uniform_chi_square():
    t = Table("t", 50, SPEC, seed=11)
    add(t, range(50))
    recs, probs = t.sample(100_000)
    assert np.allclose(probs, 1 / 50)
    counts = np.bincount(t.store.key[recs].astype(np.int64), minlength=50)
    expected = 100_000 / 50
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 49 degrees of freedom: P(chi2 > 85.4) = 0.001
    assert chi2 < 85.4, chi2
    assert t.samples == 100_000


def test_leased_items_are_retired_not_freed_until_released():
    t = Table("t", 4, SPEC, seed=1)
    add(t, range(4))
    recs, _ = t.sample(64)
    t.lease(recs)
    freed = add(t, range(4, 8))  # evicts every sampled item
    assert len(freed.nodes) == 0  # all leased: nothing freed yet
    assert (t.store.state[np.unique(recs)] == RETIRED).all()
    freed = t.unlease(recs)
    assert sorted(freed.offsets.tolist()) == [0, 64, 128, 192][: len(freed.offsets)]
    assert len(freed.offsets) == len(np.unique(recs))
    assert (t.store.state[np.unique(recs)] == FREE).all()


def test_unlease_of_live_items_frees_nothing():
    t = Table("t", 4, SPEC)
    add(t, range(4))
    recs, _ = t.sample(8)
    t.lease(recs)
    assert len(t.unlease(recs).nodes) == 0
    assert (t.store.state[recs] == LIVE).all()
    assert t.leased() == 0


def test_dropping_a_node_removes_only_its_items():
    t = Table("t", 100, SPEC, seed=2)
    add(t, range(0, 30), node=1)
    add(t, range(30, 60), node=2)
    assert t.drop_node(1) == 30
    assert live_keys(t) == set(range(30, 60))
    recs, _ = t.sample(1000)
    assert (t.store.node[recs] == 2).all()
    add(t, range(60, 130), node=2)  # FIFO skips the dropped records
    assert live_keys(t) == set(range(30, 130))


def test_store_grows_past_its_initial_size():
    t = Table("t", 5000, SPEC)
    add(t, range(3000))
    add(t, range(3000, 6000))
    assert t.size == 5000 and live_keys(t) == set(range(1000, 6000))


def test_unknown_sampler_or_remover():
    with pytest.raises(ConfigError, match="sampler"):
        Table("t", 1, SPEC, sampler="magic")
    with pytest.raises(ConfigError, match="remover"):
        Table("t", 1, SPEC, remover="magic")


def test_leases_expire():
    leases = Leases(timeout=5.0)
    a = leases.grant("t", np.arange(3), now=100.0)
    leases.grant("t", np.arange(2), now=103.0)
    assert [lease.recs.tolist() for lease in leases.expired(now=105.5)] == [[0, 1, 2]]
    assert leases.take([a]) == []
    assert len(leases) == 1
