"""End to end over real processes, with UCX_TLS=tcp and with UCX_TLS=sm."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import assert_dense

import distore_ucx as ds

# Every test here runs over each read path: UCX tcp, UCX sm, same-host mapped.
pytestmark = pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)

SPEC = {"obs": ((4, 21, 21), "uint8"), "action": ((), "int64"), "reward": ((), "float32")}


def make_items(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.integers(0, 256, (n, 4, 21, 21), dtype=np.uint8),
        "action": rng.integers(0, 18, n),
        "reward": rng.standard_normal(n).astype(np.float32),
    }


# Tests that use tables of their own and look at nothing store-wide take
# `shared_client`, of the module's cluster of their read path (conftest's
# module_clusters); those that count the nodes' bytes have a cluster each.


def test_sampled_bytes_equal_inserted_bytes(client, tls):
    client.create_table("replay", capacity=10_000, spec=SPEC)
    items = make_items(2000, seed=1)
    with client.writer(max_items=256) as writer:
        keys = writer.insert("replay", items, priority=np.linspace(0.1, 1, 2000))
    assert keys.dtype == np.uint64 and len(np.unique(keys)) == 2000
    info = client.table_info("replay")
    assert info["size"] == 2000 and info["inserts"] == 2000
    order = np.argsort(keys)
    learner = client.learner("replay", batch_size=64)
    seen = set()
    for _ in range(60):  # 3840 random samples
        batch = learner.sample()
        idx = order[np.searchsorted(keys, batch.keys, sorter=order)]
        assert np.array_equal(keys[idx], batch.keys)
        for name in SPEC:
            assert np.array_equal(batch.data[name], items[name][idx]), name
        assert np.allclose(batch.probabilities, 1 / 2000)
        assert batch.table_size == 2000
        seen.update(batch.keys.tolist())
    assert len(seen) > 1500  # uniform over the whole table
    assert learner.path == "host"
    # Both nodes hold items: inserts are spread round robin.
    used = [n["used_bytes"] for n in client.status()["nodes"]]
    assert all(u > 0 for u in used), used


def test_single_items_and_unnamed_spec(shared_client, tls):
    client = shared_client
    client.create_table("frames", capacity=100, spec=((3, 5), "float32"))
    writer = client.writer()
    k1 = writer.insert("frames", np.full((3, 5), 1.5, np.float32))
    k2 = writer.insert("frames", np.full((3, 5), 2.5, np.float32))
    assert len(k1) == 1 and len(k2) == 1
    writer.flush()
    batch = client.learner("frames", batch_size=16).sample()
    assert batch.data.shape == (16, 3, 5)
    for key, row in zip(batch.keys, batch.data):
        assert np.all(row == (1.5 if key == k1[0] else 2.5))


def test_every_field_is_a_dense_array_on_every_read_path(shared_client, tls):
    # Fields of awkward sizes (1764, 8, 4, 6 bytes): each its own
    # [batch, *shape] array, content checked; one unnamed spec too; clones
    # and torch views (DLPack) of dense batches.
    client = shared_client
    spec = dict(SPEC, pair=((3,), "int16"))
    client.create_table("dense", capacity=1000, spec=spec)
    client.create_table("plain", capacity=100, spec=((7, 3), "float64"))
    items = dict(make_items(300, seed=5), pair=np.arange(900, dtype=np.int16).reshape(300, 3))
    plain = np.random.default_rng(6).standard_normal((50, 7, 3))
    with client.writer(max_items=64) as writer:
        keys = writer.insert("dense", items)
        plain_keys = writer.insert("plain", plain)
    order = np.argsort(keys)
    learner = client.learner("dense", batch_size=32)
    mapped = os.environ.get("DISTORE_LOCAL_MAP") == "1"  # the "mapped" read path
    for _ in range(5):
        batch = learner.sample()
        idx = order[np.searchsorted(keys, batch.keys, sorter=order)]
        for name in spec:
            assert_dense(batch.data[name])
            assert batch.data[name].shape == (32,) + items[name].shape[1:]
            assert np.array_equal(batch.data[name], items[name][idx]), name
    if mapped:
        assert set(learner.paths.values()) == {"mapped"}
    elif tls == "tcp":  # UCX emulates RMA: nodes send samples by active message
        assert set(learner.paths.values()) == {"ucx-am:tcp"}, learner.paths
    else:
        assert all(p.startswith(("ucx:", "ucx-am:")) or p == "cma"
                   for p in learner.paths.values())
    copy = batch.clone()
    learner.sample()
    for name in spec:
        assert_dense(copy.data[name])
        assert np.array_equal(copy.data[name], items[name][idx]), name  # kept past a refill
    batch = client.learner("plain", batch_size=8).sample()
    assert_dense(batch.data)
    plain_order = np.argsort(plain_keys)
    rows = plain_order[np.searchsorted(plain_keys, batch.keys, sorter=plain_order)]
    assert np.array_equal(batch.data, plain[rows])
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    tensors = client.learner("dense", batch_size=16, framework="torch").sample()
    idx = order[np.searchsorted(keys, tensors.keys, sorter=order)]
    for name in spec:
        t = tensors.data[name]
        assert t.is_contiguous() and tuple(t.shape) == (16,) + items[name].shape[1:]
        back = torch.from_dlpack(torch.utils.dlpack.to_dlpack(t))  # still DLPack-able
        assert back.data_ptr() == t.data_ptr()
        assert np.array_equal(t.numpy(), items[name][idx]), name


def test_fifo_eviction_at_capacity(client, tls):
    client.create_table("small", capacity=100, spec=SPEC)
    items = make_items(250, seed=2)
    # One batch in flight: batches are registered in the order they were sent.
    with client.writer(max_items=32, max_in_flight=1) as writer:
        keys = writer.insert("small", items)
    info = client.table_info("small")
    assert info["size"] == 100 and info["deletes"] == 150
    learner = client.learner("small", batch_size=50)
    newest = set(keys[-100:].tolist())
    sampled = set()
    for _ in range(20):
        sampled.update(learner.sample().keys.tolist())
    assert sampled <= newest and len(sampled) > 90
    # Freed slots are reused: arenas do not grow past capacity plus batches in flight.
    slot = client.table_info("small")["slot_size"]
    used = sum(n["used_bytes"] for n in client.status()["nodes"])
    assert used <= (100 + 2 * 32) * slot


def test_batch_views_share_one_buffer_and_clone_copies(shared_client, tls):
    client = shared_client
    client.create_table("views", capacity=100, spec=SPEC)
    with client.writer() as writer:
        writer.insert("views", make_items(50, seed=3))
    learner = client.learner("views", batch_size=8, ring=1)
    batch = learner.sample()
    # Every field is a view of the same gathered buffer.
    assert batch.data["obs"].base is batch.data["reward"].base is batch.data["action"].base
    kept = batch.clone()
    assert not np.shares_memory(kept.data["obs"], batch.data["obs"])
    learner.sample()  # ring of 1: the old views now show the new batch
    assert np.array_equal(kept.keys, batch.keys)


def test_errors_users_can_hit(shared_client, tls):
    client = shared_client
    with pytest.raises(ds.TableNotFound, match="no table 'missing'"):
        client.table_info("missing")
    client.create_table("errors", capacity=10, spec=SPEC)
    client.create_table("errors", capacity=10, spec=SPEC)  # identical: fine
    with pytest.raises(ds.TableExists, match="exists"):
        client.create_table("errors", capacity=11, spec=SPEC)
    with pytest.raises(ds.SpecMismatch):
        client.writer().insert("errors", {"obs": np.zeros((2, 2), np.uint8)})
    with pytest.raises(ValueError, match="priorities"):
        client.writer().insert("errors", make_items(2, 0), priority=[1.0, float("nan")])
    learner = client.learner("errors", batch_size=4)
    with pytest.raises(ds.NoData, match="no items to sample"):
        learner.sample(timeout=0.2)


def test_learner_waits_for_the_first_insert(shared_client, shared_cluster, tls):
    client, cluster = shared_client, shared_cluster
    import threading

    client.create_table("waits", capacity=10, spec=SPEC)
    learner = client.learner("waits", batch_size=4)

    def insert_later():
        with ds.connect(cluster.address) as c2, c2.writer() as w:
            w.insert("waits", make_items(4, 9))

    th = threading.Timer(0.3, insert_later)
    th.start()
    batch = learner.sample(timeout=30)
    th.join()
    assert len(batch) == 4


def test_storage_full_fails_loudly_when_nothing_can_be_evicted(make_cluster, tls):
    # A full arena evicts the table's own items; items under lease cannot
    # be, so an insert then fails and says so (none lost silently).
    cluster = make_cluster(nodes=1, arena_bytes=1 << 20)
    with ds.connect(cluster.address) as client:
        with pytest.warns(ds.CapacityWarning, match="at most 15 such items"):
            client.create_table("big", capacity=1000, spec={"x": ((64 << 10,), "uint8")})
        writer = client.writer(max_items=4)
        for _ in range(10):
            writer.insert("big", {"x": np.zeros((4, 64 << 10), np.uint8)})
        writer.flush()  # more than the arena holds: the oldest were evicted
        size = client.table_info("big")["size"]
        assert 0 < size <= 15
        conn = client.connection()  # every item leased, never released
        conn.call("sample", table="big", n=64 * size, timeout=10.0)
        with pytest.raises(ds.StorageFull, match=r"arena full.*under lease.*items not stored"):
            writer.insert("big", {"x": np.zeros((4, 64 << 10), np.uint8)})
            writer.flush()
        assert client.table_info("big")["size"] == size
        writer.close()  # nothing left in flight: closes cleanly
        conn.close()
