"""The learner's prefetching iterator, frameworks and path, over real processes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import assert_dense

import distore_ucx as ds

SPEC = {"obs": ((4, 21, 21), "uint8"), "action": ((), "int64")}


def make_items(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (n, 4, 21, 21), dtype=np.uint8),
            "action": np.arange(n, dtype=np.int64)}


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("distore-prefetch")]


@pytest.fixture
def cluster(shared_cluster):
    """The module's cluster of this read path: every test here uses tables
    of its own (conftest's module_clusters)."""
    return shared_cluster


@pytest.fixture
def filled(client, request):
    """A table of the test's own, named after it, with 300 items: (client,
    items, keys, table)."""
    table = request.function.__name__.removeprefix("test_")
    client.create_table(table, capacity=1000, spec=SPEC)
    items = make_items(300, seed=5)
    with client.writer() as writer:
        keys = writer.insert(table, items)
    return client, items, keys, table


def check(batch, items, keys):
    for field in batch.data.values():  # dense on every way a batch comes: sampled, prefetched
        assert_dense(field)
    idx = np.searchsorted(keys, batch.keys)
    assert np.array_equal(keys[idx], batch.keys)
    assert np.array_equal(np.asarray(batch.data["obs"]), items["obs"][idx])
    assert np.array_equal(np.asarray(batch.data["action"]), items["action"][idx])


def test_iterating_prefetches_correct_batches_and_close_stops_the_thread(filled, tls):
    client, items, keys, table = filled
    learner = client.learner(table, batch_size=16, prefetch=2)
    assert learner.path == "host" and len(learner._ring) == 3
    for i, batch in enumerate(learner):
        check(batch, items, keys)  # the held batch is intact while 2 more are in flight
        if i == 30:
            break
    assert len(prefetch_threads()) == 1
    held = batch.clone()
    learner.sample()  # while iterating, sample() takes the next prefetched batch
    learner.close()
    assert not prefetch_threads()
    check(held, items, keys)


def test_context_manager_stops_the_thread(filled, tls):
    client, items, keys, table = filled
    with client.learner(table, batch_size=8, prefetch=3) as learner:
        it = iter(learner)
        for _ in range(5):
            check(next(it), items, keys)
    assert not prefetch_threads()


def test_errors_in_the_thread_reach_the_caller(client, tls):
    client.create_table("empty", capacity=10, spec=SPEC)
    learner = client.learner("empty", batch_size=4, prefetch=2, timeout=0.3)
    with pytest.raises(ds.NoData, match="no items to sample"):
        next(iter(learner))
    assert not prefetch_threads()  # the failed thread is gone; iterating again restarts it
    with client.writer() as writer:
        writer.insert("empty", make_items(4, 1))
    assert len(next(iter(learner))) == 4
    learner.close()
    assert not prefetch_threads()


def test_torch_cpu_tensors_through_dlpack(filled, tls):
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    client, items, keys, table = filled
    learner = client.learner(table, batch_size=8, framework="torch")
    batch = learner.sample()
    assert learner.path == "host" and learner.framework == "torch"
    assert isinstance(batch.data["obs"], torch.Tensor)
    obs_at = learner._ring.layout.offsets[0]  # the obs array of ring slot 0
    assert batch.data["obs"].data_ptr() == learner._ring.acquire(0).address + obs_at  # no copy
    assert batch.data["obs"].is_contiguous()
    check(batch, items, keys)
    kept = batch.clone()
    assert isinstance(kept.data["obs"], torch.Tensor)
    assert kept.data["obs"].data_ptr() != batch.data["obs"].data_ptr()


def test_a_learner_asks_for_its_table_once(filled, cluster, tls, monkeypatch):
    # Its arguments are checked from the one table_info reply its spec, slice
    # length and rate limiter come in, also by a client that did not make
    # the table (none of it cached yet).
    table = filled[3]
    with ds.connect(cluster.address) as other:
        asked = []
        real = other.call
        monkeypatch.setattr(other, "call", lambda op, **f: (asked.append(op), real(op, **f))[1])
        with other.learner(table, batch_size=4, prefetch=0) as learner:
            learner.sample()
        assert asked.count("table_info") == 1, asked


def test_device_options_are_checked(filled, tls):
    client, _, _, table = filled
    with pytest.raises(ds.ConfigError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        client.learner(table, batch_size=4, device="tpu")
    with pytest.raises(ds.ConfigError, match="needs a GPU device"):
        client.learner(table, batch_size=4, path="gpu-direct")
    with pytest.raises(ds.ConfigError, match="prefetch"):
        client.learner(table, batch_size=4, prefetch=-1)
