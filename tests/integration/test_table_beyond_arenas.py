"""A table larger than its nodes' arenas evicts by its remover instead of failing.

Capacity 10x what the arenas hold: inserts keep being accepted, the table
holds what fits (as `table_info`'s `fits` says), samples never return an
evicted item, and every sampled item is the one its key names.
"""

from __future__ import annotations

import numpy as np
import pytest

import distore_ucx as ds

ITEM = 16 << 10  # bytes of payload
SPEC = {"key": ((), "uint64"), "x": ((ITEM // 8,), "uint64")}
ARENA = 2 << 20


def items(keys: np.ndarray) -> dict:
    return {"key": keys, "x": keys[:, None] * np.uint64(1000003) + np.arange(ITEM // 8,
                                                                             dtype=np.uint64)}


def test_table_ten_times_its_arenas_keeps_accepting_and_evicts_fifo(make_cluster, tls):
    cluster = make_cluster(nodes=2, arena_bytes=ARENA)
    with ds.connect(cluster.address) as client:
        with pytest.warns(ds.CapacityWarning, match="insert evicts the table's own items"):
            info = client.create_table("t", capacity=10 * 2 * ARENA // (ITEM + 64), spec=SPEC)
        fit = 2 * (ARENA // info["slot_size"])
        assert client.table_info("t")["fits"] == fit
        learner = client.learner("t", batch_size=8, prefetch=2)
        it = iter(learner)
        n, wrong, evicted_seen = 0, 0, 0
        ones = np.ones(8)
        with client.writer(max_items=16) as writer:
            for rnd in range(20):  # 20 x 64 items: 10x what the arenas hold
                keys = np.arange(n, n + 64, dtype=np.uint64)
                writer.insert("t", items(keys))
                writer.flush()
                n += 64
                size = client.table_info("t")["size"]
                assert size <= fit
                if rnd >= 10:
                    assert size >= fit - 64  # it holds what fits, not much less
                for _ in range(4):
                    batch = next(it)
                    k = batch.data["key"]
                    wrong += int((batch.data["x"] != items(k)["x"]).any(axis=1).sum())
                    # Keys no longer in the table are "missing" to a priority update.
                    learner.update_priorities(batch.keys, ones)
                    evicted_seen += learner.flush_priorities()["missing"]
        assert wrong == 0
        assert evicted_seen == 0
        info = client.table_info("t")
        assert info["inserts"] == n and info["deletes"] == n - info["size"]
        learner.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_table_never_evicts_another_tables_items(make_cluster, tls):
    cluster = make_cluster(nodes=1, arena_bytes=ARENA)
    with ds.connect(cluster.address) as client:
        with pytest.warns(ds.CapacityWarning):
            client.create_table("hog", capacity=1000, spec=SPEC)
        client.create_table("late", capacity=10, spec=SPEC)
        with client.writer(max_items=16) as writer:
            for first in range(0, 256, 64):
                writer.insert("hog", items(np.arange(first, first + 64, dtype=np.uint64)))
        held = client.table_info("hog")["size"]
        assert client.table_info("late")["fits"] == 0
        with pytest.raises(ds.StorageFull, match="held by other tables, which keep it"), \
                client.writer() as writer:
            writer.insert("late", items(np.arange(1, dtype=np.uint64)))
        assert client.table_info("hog")["size"] == held


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_batch_larger_than_the_table_leaves_no_slot_behind(make_cluster, tls):
    # Capacity 63, writer batches of up to 128 items: most of a batch is
    # evicted by its own later items as it is registered, before its node
    # commits it. Those slots must be freed, not kept for good (the node held
    # 559 slots for a table of 63 before).
    from helpers import wait_for

    cluster = make_cluster(nodes=1, arena_bytes=32 << 20)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=63, spec=SPEC, remover=ds.Fifo())
        slot = client.table_info("t")["slot_size"]
        with client.writer(max_items=128) as writer:
            for k in range(1000):
                writer.insert("t", items(np.array([k], np.uint64)))
        assert client.table_info("t")["size"] == 63
        wait_for(lambda: client.nodes()[0]["used_bytes"] == 63 * slot, 10,
                 "the node to hold only the table's 63 slots",
                 lambda: client.nodes()[0]["used_bytes"] // slot)
        batch = client.learner("t", batch_size=63, sample_ahead=1).sample(timeout=10)
        assert set(batch.data["key"].tolist()) <= set(range(1000 - 63, 1000))  # the newest
