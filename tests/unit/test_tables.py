"""The control plane's table: eviction, sampling, leases, node loss."""

from __future__ import annotations

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.control.items import FREE, LIVE, RETIRED
from distore_ucx.control.leases import Leases
from distore_ucx.control.tables import Table
from distore_ucx.errors import ConfigError
from distore_ucx.spec import TableSpec

SPEC = TableSpec.parse(((8,), "uint8"))


def add(table, keys, node=1, priorities=None):
    keys = np.asarray(keys, np.uint64)
    prios = np.ones(len(keys)) if priorities is None else np.asarray(priorities, np.float64)
    return table.add(node, keys, keys * np.uint64(64), keys + np.uint64(1000), prios)


def live_keys(table):
    s = table.store
    return set(s.keys(s.state == LIVE).tolist())


def test_fifo_evicts_oldest_first_and_frees_their_slots():
    t = Table.make("t", 10, SPEC)
    assert len(add(t, range(10)).freed.nodes) == 0
    freed, _ = add(t, range(10, 13))
    assert live_keys(t) == set(range(3, 13))
    assert sorted(freed.offsets.tolist()) == [0, 64, 128]
    assert t.deletes == 3 and t.inserts == 13 and t.size == 10


def test_batch_larger_than_capacity_keeps_the_newest():
    t = Table.make("t", 5, SPEC)
    add(t, range(12))
    assert live_keys(t) == set(range(7, 12))


def test_eviction_order_is_fifo_over_many_batches():
    t = Table.make("t", 100, SPEC)
    rng = np.random.default_rng(3)
    next_key = 0
    for _ in range(200):
        k = int(rng.integers(1, 40))
        add(t, range(next_key, next_key + k))
        next_key += k
        assert live_keys(t) == set(range(max(0, next_key - 100), next_key))


def test_leased_items_are_retired_not_freed_until_released():
    t = Table.make("t", 4, SPEC, seed=1)
    add(t, range(4))
    recs, _, _ = t.sample(64)  # leases every sampled record
    freed, _ = add(t, range(4, 8))  # evicts every sampled item
    assert len(freed.nodes) == 4 - len(np.unique(recs))
    assert (t.store.state[np.unique(recs)] == RETIRED).all()
    freed = t.unlease(recs)
    assert len(freed.offsets) == len(np.unique(recs))
    assert (t.store.state[np.unique(recs)] == FREE).all()


def test_unlease_of_live_items_frees_nothing():
    t = Table.make("t", 4, SPEC)
    add(t, range(4))
    recs, _, _ = t.sample(8)
    assert len(t.unlease(recs).nodes) == 0
    assert (t.store.state[recs] == LIVE).all()
    assert t.leased() == 0


def test_dropping_a_node_removes_only_its_items():
    t = Table.make("t", 100, SPEC, seed=2)
    add(t, range(0, 30), node=1)
    add(t, range(30, 60), node=2)
    assert t.drop_node(1) == 30
    assert live_keys(t) == set(range(30, 60))
    recs, _, _ = t.sample(1000)
    assert (t.store.node[recs] == 2).all()
    t.unlease(recs)
    add(t, range(60, 130), node=2)  # FIFO skips the dropped records
    assert live_keys(t) == set(range(30, 130))


def test_max_times_sampled_retires_items_after_their_last_use():
    t = Table.make("t", 100, SPEC, sampler=ds.Fifo(), max_times_sampled=2, seed=0)
    add(t, range(3))
    recs, probs, freed = t.sample(5)
    assert t.store.keys(recs).tolist() == [0, 0, 1, 1, 2]
    assert np.all(probs == 1.0)
    assert live_keys(t) == {2}
    assert len(freed.nodes) == 0  # leased by this very sample
    assert len(t.unlease(recs).nodes) == 2  # keys 0 and 1 freed once released
    assert not t.can_sample(2) and t.can_sample(1)


def test_store_grows_past_its_initial_size():
    t = Table.make("t", 5000, SPEC)
    add(t, range(3000))
    add(t, range(3000, 6000))
    assert t.size == 5000 and live_keys(t) == set(range(1000, 6000))


def test_priority_updates_skip_evicted_keys():
    t = Table.make("t", 10, SPEC, sampler=ds.MaxHeap())
    add(t, range(20))  # keys 0..9 evicted
    assert t.update_priorities(np.array([5, 15], np.uint64), np.array([9.0, 7.0])) == 1
    recs, _, _ = t.sample(1)
    assert t.store.keys(recs).tolist() == [15]


def test_queue_forces_fifo_exactly_once_and_checks_capacity():
    t = Table.make("q", 10, SPEC, rate_limiter=ds.Queue(10))
    assert (t.sampler.kind, t.remover.kind, t.max_times_sampled) == ("fifo", "fifo", 1)
    with pytest.raises(ConfigError, match="Fifo sampler"):
        Table.make("q", 10, SPEC, sampler=ds.Uniform(), rate_limiter=ds.Queue(10))
    with pytest.raises(ConfigError, match="smaller than the queue size"):
        Table.make("q", 5, SPEC, rate_limiter=ds.Queue(10))


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError):
        ds.Selector.from_wire("magic", "sampler")
    with pytest.raises(ConfigError, match="alpha"):
        ds.Prioritized(-1)
    with pytest.raises(ConfigError, match="max_times_sampled"):
        Table.make("t", 1, SPEC, max_times_sampled=-1)


def test_leases_expire():
    leases = Leases(timeout=5.0)
    a = leases.grant("t", np.arange(3), now=100.0)
    leases.grant("t", np.arange(2), now=103.0)
    assert [lease.recs.tolist() for lease in leases.expired(now=105.5)] == [[0, 1, 2]]
    assert leases.take([a]) == ([], 0)
    assert len(leases) == 1
