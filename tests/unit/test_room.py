"""Making room in a full arena: a table evicts its own items by its remover
(control/room.py), and retires evicted leased items (control/tables.py)."""

from __future__ import annotations

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.control.items import LIVE, RETIRED
from distore_ucx.control.room import Room
from distore_ucx.control.tables import Table
from distore_ucx.spec import TableSpec

SPEC = TableSpec.parse(((8,), "uint8"))


def add(table, keys, node, priorities=None):
    keys = np.asarray(keys, np.uint64)
    prios = np.ones(len(keys)) if priorities is None else np.asarray(priorities, np.float64)
    return table.add(node, keys, keys * np.uint64(64), keys + np.uint64(1000), prios)


def pick_for_room(table, node_id, n, rng):
    """What a node's first request for room on `node_id` is handed (one scan)."""
    return Room(rng).pick(table, node_id, n)


def keys_of(table, recs):
    return sorted(table.store.keys(recs).tolist())


@pytest.mark.parametrize("remover, expect", [
    (ds.Fifo(), [3, 5]),        # the oldest on node 1 but 1, which is leased
    (ds.Lifo(), [7, 9]),        # the newest on node 1
    (ds.MinHeap(), [7, 9]),     # the lowest priorities on node 1
    (ds.MaxHeap(), [1, 3]),     # the highest priorities on node 1
])
def test_pick_for_room_follows_the_remover_on_that_node_only(remover, expect):
    t = Table.make("t", 100, SPEC, remover=remover)
    keys = np.arange(10)
    for k in keys:  # odd keys on node 1, even keys on node 2, inserted in key order
        add(t, [k], node=1 if k % 2 else 2, priorities=[100.0 - k if k != 9 else 0.5])
    if remover.kind == "fifo":
        t.lease(t.core.lookup(np.array([1], np.uint64)))
    picked = pick_for_room(t, 1, 2, np.random.default_rng(0))
    assert keys_of(t, picked) == expect
    assert (t.store.node[picked] == 1).all()


def test_uniform_and_prioritized_pick_distinct_unleased_items_of_the_node():
    for remover in (ds.Uniform(), ds.Prioritized(1.0)):
        t = Table.make("t", 100, SPEC, remover=remover)
        add(t, np.arange(20), node=1, priorities=np.arange(1, 21))
        add(t, np.arange(20, 30), node=2)
        picked = pick_for_room(t, 1, 5, np.random.default_rng(1))
        assert len(set(picked.tolist())) == 5 and (t.store.node[picked] == 1).all()


def test_evict_counts_deletes_and_frees_every_slot():
    t = Table.make("t", 100, SPEC)
    add(t, np.arange(6), node=1)
    picked = pick_for_room(t, 1, 4, np.random.default_rng(0))
    freed = t.evict(picked)
    assert sorted(freed.offsets.tolist()) == [k * 64 for k in range(4)]
    assert t.size == 2 and t.deletes == 4
    assert (t.store.state[t.core.lookup(np.arange(4, 6, dtype=np.uint64))] == LIVE).all()


def test_add_reports_the_leased_items_it_evicted_for_marking():
    t = Table.make("t", 3, SPEC)
    add(t, [0, 1, 2], node=1)
    t.lease(t.core.lookup(np.array([0], np.uint64)))
    freed, r = add(t, [3, 4], node=2)  # evicts 0 (leased) and 1
    assert freed.offsets.tolist() == [64]
    assert r.nodes.tolist() == [1] and r.offsets.tolist() == [0]
    assert r.generations.tolist() == [1000]
    assert (t.store.state == RETIRED).sum() == 1


def test_room_hands_out_one_scans_candidates_over_many_requests():
    t = Table.make("t", 10_000, SPEC)  # Fifo remover
    add(t, np.arange(6000), node=1)
    add(t, np.arange(6000, 6100), node=2)
    room = Room(np.random.default_rng(0))
    got = [keys_of(t, room.pick(t, 1, 16)) for _ in range(4)]
    assert got == [list(range(i, i + 16)) for i in range(0, 64, 16)]
    assert room.scans == 1
    t.lease(t.core.lookup(np.array([64], np.uint64)))  # leased since the scan: skipped
    t.evict(t.core.lookup(np.arange(65, 70, dtype=np.uint64)))  # gone since: skipped
    assert keys_of(t, room.pick(t, 1, 3)) == [70, 71, 72]
    assert (t.store.node[room.pick(t, 2, 200)] == 2).all() and room.scans == 2
