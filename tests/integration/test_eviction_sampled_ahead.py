"""Evicted items never come back, even when a learner sampled them ahead.

Capacity 5: insert 3, sample twice (the learner then asks for batches
ahead, or its prefetch thread reads them ahead), insert 5 more and flush:
the 3 first items are evicted while leased. No later sample may return
them, over every read path.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_dense

SPEC = {"key": ((), "uint64"), "obs": ((32,), "uint32")}
PATHS = ["tcp", "sm", "mapped"]


def items(keys) -> dict:
    k = np.asarray(keys, np.uint64)
    return {"key": k, "obs": (k[:, None] * 3 + np.arange(32)).astype(np.uint32)}


def check(batch, evicted: set[int]) -> None:
    for field in batch.data.values():  # rows resampled in place: still dense
        assert_dense(field)
    keys = batch.data["key"]
    assert np.array_equal(batch.data["obs"], (keys[:, None] * 3 + np.arange(32)).astype(np.uint32))
    back = evicted & set(keys.tolist())
    assert not back, f"evicted items {sorted(back)} were returned"


def queued(learner, k: int) -> list:
    """The (ring slot, batch) of the first `k` batches waiting in the
    learner's prefetch queue (read ahead, not handed out: they hold their
    leases), once the thread has read that many (10 s at most)."""
    import time

    queue = learner._prefetcher._state
    deadline = time.monotonic() + 10
    while len(queue.items) < k and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(queue.items) >= k, "the prefetch thread did not read ahead"
    return list(queue.items)[:k]


def fill(client, table: str, first: int, n: int) -> None:
    with client.writer(max_items=n) as writer:
        writer.insert(table, items(range(first, first + n)))


@pytest.fixture
def one_node(module_clusters, tls, request):
    """A one-node cluster of this read path, shared by the module's tests
    that take it (conftest's module_clusters): each uses a table of its own
    name, and a node's slots stay with their table (storage/arena.py), so
    evictions and slot reuse go on in each table as on a node of its own."""
    return module_clusters(request.node.callspec.params["tls"], nodes=1)


@pytest.mark.parametrize("tls", PATHS, indirect=True)
def test_sampled_ahead_then_evicted_is_never_returned(one_node, tls):
    import distore_ucx as ds

    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("ahead", capacity=5, spec=SPEC)
        fill(client, "ahead", 0, 3)
        learner = client.learner("ahead", batch_size=2, sample_ahead=4)
        # Back to back: the learner's requests then ask for 4 batches ahead.
        for batch in [learner.sample().clone() for _ in range(6)]:
            check(batch, set())
        assert learner._stream.ahead, "the learner did not sample ahead"
        fill(client, "ahead", 100, 5)  # evicts items 0, 1, 2 (Fifo), some of them leased
        for _ in range(20):
            check(learner.sample(), {0, 1, 2})
        assert client.table_info("ahead")["size"] == 5
        learner.close()


@pytest.mark.parametrize("tls", PATHS, indirect=True)
def test_prefetched_then_evicted_is_never_returned(one_node, tls):
    import distore_ucx as ds

    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("prefetched", capacity=5, spec=SPEC)
        fill(client, "prefetched", 0, 3)
        learner = client.learner("prefetched", batch_size=2, prefetch=2, beta=0.4)
        it = iter(learner)
        for _ in range(2):
            check(next(it), set())
        # The prefetch thread has read the next batches (of items 0-2) ahead.
        fill(client, "prefetched", 100, 5)
        for _ in range(20):
            batch = next(it)
            check(batch, {0, 1, 2})
            # weights follow the probabilities the rows were drawn with
            w = (batch.table_size * batch.probabilities) ** -0.4
            assert np.allclose(batch.weights, w / w.max())
        assert learner.resampled > 0  # batches read ahead were repaired, not handed out
        learner.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_two_nodes_evicting_insert_on_one_retires_slots_on_the_other(make_cluster, tls):
    # The evicted items live on one node, the evicting insert lands on the
    # other: the control plane has the first mark them before acknowledging.
    import distore_ucx as ds

    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("two_nodes", capacity=8, spec=SPEC)
        for first in (0, 4):  # two batches: one to each node
            fill(client, "two_nodes", first, 4)
        learner = client.learner("two_nodes", batch_size=4, prefetch=2)
        it = iter(learner)
        for _ in range(2):
            check(next(it), set())
        for first in (100, 104):
            fill(client, "two_nodes", first, 4)  # every old item evicted
        for _ in range(20):
            check(next(it), set(range(8)))
        learner.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
@pytest.mark.parametrize("busy", [False, True], ids=["by-message", "busy-node-by-gets"])
def test_rechecks_over_tcp_go_by_message_and_catch_evictions(one_node, tls, monkeypatch,
                                                             busy):
    # Over TCP a node that sends samples by active message also answers the
    # hand-out re-check: one headers-only request per node, not a one-sided
    # get (an emulated round trip) per row. A node serving too many batches
    # refuses the request (UCS_ERR_BUSY; `busy`): those rows are read with
    # gets. Evictions are caught either way.
    import distore_ucx as ds
    from distore_ucx._native_loader import _native

    cluster = one_node
    table = f"recheck_{busy}"
    with ds.connect(cluster.address) as client:
        client.create_table(table, capacity=5, spec=SPEC)
        fill(client, table, 0, 3)
        learner = client.learner(table, batch_size=2, prefetch=2)
        assert all(p.startswith("ucx-am:") for p in learner.paths.values()), learner.paths
        rechecks = learner._recheck
        real = client.runtime.am_sample_client()
        refused = []

        class Busy:  # refuses the re-checks' headers-only requests only
            def fetch(self, endpoints, node, offsets, rows, layout, dest, timeout, **grants):
                if layout is rechecks._header_layout:
                    refused.append(len(node))
                    return np.full(len(node), _native.STATUS_BUSY, np.int32)
                return real.fetch(endpoints, node, offsets, rows, layout, dest, timeout,
                                  **grants)

        if busy:
            monkeypatch.setattr(client.runtime, "am_sample_client", Busy)
        it = iter(learner)
        for _ in range(2):
            check(next(it), set())
        locs = learner._reader.locations[queued(learner, 1)[0][0]].copy()
        assert len(rechecks.retired_rows(locs, 5.0)) == 0  # all still in the table
        fill(client, table, 100, 5)  # evicts items 0, 1, 2: every row of `locs`
        assert np.array_equal(rechecks.retired_rows(locs, 5.0), np.arange(len(locs)))
        for _ in range(20):
            check(next(it), {0, 1, 2})
        assert learner.resampled > 0  # batches read ahead were repaired, not handed out
        if busy:
            assert refused and rechecks._check_keys, "the refused rows were not read by gets"
        else:
            assert rechecks._check_keys == {}, "a re-check went by one-sided gets"
        learner.close()


@pytest.mark.parametrize("tls", PATHS, indirect=True)
def test_batches_waiting_in_the_prefetch_queue_keep_their_leases(one_node, tls):
    # One batch a request (sample_ahead=1, as for tables with a rate limiter
    # or large batches): every batch's reply has its own lease. The batches
    # the prefetch thread read ahead and that wait to be taken must still
    # hold theirs, so that an eviction marks their slots and the hand-out
    # re-check finds them; a lease released as soon as the thread had read
    # the batch let an evicted item through whenever its slot was not
    # reused yet (freed slots keep their headers).
    import time

    import distore_ucx as ds

    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("queued", capacity=20, spec=SPEC)
        fill(client, "queued", 0, 20)
        learner = client.learner("queued", batch_size=4, prefetch=3, sample_ahead=1)
        it = iter(learner)
        check(next(it), set())  # held: two more wait in the queue, a third is in flight
        queued(learner, 2)
        time.sleep(0.2)  # the thread has sent what it sends before waiting
        fill(client, "queued", 100, 20)  # evicts every item the queued batches hold
        old = set(range(20))
        for _ in range(10):
            check(next(it), old)
        assert learner.resampled > 0  # the queued batches were repaired, not handed out
        learner.close()


@pytest.mark.parametrize("tls", PATHS, indirect=True)
@pytest.mark.parametrize("how", ["sample", "iterate"])
def test_a_batch_kept_past_its_lease_never_returns_evicted_items(module_clusters, request, tls,
                                                                 how):
    # A learner that pauses longer than the control plane's lease_timeout
    # (an evaluation, a checkpoint) between batches: the reply asked for
    # ahead (pipelining), or the batches its prefetch thread read ahead,
    # were leased when sampled, but those leases have expired. An item
    # evicted then is freed unmarked (its header intact until the slot is
    # reused), so neither the read's header check nor the hand-out re-check
    # can see it: such a batch must be sampled again, not used.
    import time

    import distore_ucx as ds

    cluster = module_clusters(request.node.callspec.params["tls"], nodes=1,
                              lease_timeout=1.0)  # shared as one_node is
    table = f"kept_{how}"
    with ds.connect(cluster.address) as client:
        client.create_table(table, capacity=20, spec=SPEC)
        fill(client, table, 0, 20)
        learner = client.learner(table, batch_size=4, prefetch=3, sample_ahead=1)
        if how == "sample":
            take = learner.sample
            check(take(), set())  # the next batch's request is in flight now
        else:
            it = iter(learner)
            take = it.__next__
            check(take(), set())
            queued(learner, 2)  # read ahead, waiting to be taken
        time.sleep(1.6)  # the pause: every lease the learner holds expires
        fill(client, table, 100, 20)  # evicts every item it sampled
        old = set(range(20))
        for _ in range(10):
            check(take(), old)
        assert learner.expired > 0  # dropped, not read: its leases might have gone
        learner.close()
