"""Node liveness: an unresponsive node is routed around but keeps its items;
only a gone one (killed, or silent past the grace) costs them. Writers place
by free space.

A stopped node (SIGSTOP) stands for a host too busy to run it: its sockets
stay open and it answers nothing until SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import check_keyed, keyed_items, keyed_spec, wait_for

import distore_ucx as ds
from distore_ucx.client.writer import placement

WIDTH = 256
SPEC = keyed_spec(WIDTH)
FIRST = 400  # items inserted before a node is stopped or killed
PAUSE = 3.0  # s a client may wait on an unresponsive node (heartbeat timeout 2 s)


def nodes_by_id(client) -> dict[int, dict]:
    """The control plane's nodes by id, each with its state."""
    nodes = {n["node_id"]: n for n in client.status()["nodes"]}
    for n in nodes.values():  # "alive" alone: a control plane without states
        n.setdefault("state", "live" if n["alive"] else "gone")
    return nodes


def items_on(client, slot_size: int) -> dict[int, int]:
    """Items each node holds (one table: its used bytes are whole slots)."""
    return {i: n["used_bytes"] // slot_size for i, n in nodes_by_id(client).items()
            if n["alive"]}


def fill(client, n: int = FIRST) -> int:
    """Table "t" (uniform sampling) with n keyed items on both nodes; its slot size."""
    info = client.create_table("t", capacity=10_000, spec=SPEC)
    with client.writer(max_items=50) as writer:
        for i in range(0, n, 50):
            writer.insert("t", keyed_items(i, 50, WIDTH))
    return info["slot_size"]


def sample_all(learner, labels: set[int], timeout: float = 60.0) -> None:
    """Sample until every label in `labels` was seen (each item checked)."""
    left = set(labels)
    deadline = time.monotonic() + timeout
    while left:
        batch = learner.sample(timeout=10)
        check_keyed(batch, WIDTH)
        left -= set(batch.data["key"].tolist())
        assert time.monotonic() < deadline, f"{len(left)} items never sampled: {sorted(left)[:10]}"


@pytest.mark.slow
@pytest.mark.parametrize("stop_s, tls", [(5.0, "tcp"), (10.0, "mapped")], indirect=["tls"])
def test_a_stopped_node_keeps_its_items_and_clients_route_around_it(cluster, client, tls,
                                                                    stop_s):
    slot = fill(client)
    victim = cluster.nodes[0]
    vid = victim.info["node_id"]
    before = items_on(client, slot)
    assert sum(before.values()) == FIRST and all(before.values()), before
    learner = client.learner("t", batch_size=64)
    check_keyed(learner.sample(timeout=10), WIDTH)
    sample_s, flush_s, states = [], [], set()
    written = 0
    with client.writer(max_items=20) as writer:
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        next_write = stopped
        try:
            while time.monotonic() - stopped < stop_s:
                t0 = time.monotonic()
                batch = learner.sample(timeout=10)
                sample_s.append(time.monotonic() - t0)
                check_keyed(batch, WIDTH)
                if t0 < next_write:
                    continue
                next_write = t0 + 0.2  # 100 items a second: the table stays small
                writer.insert("t", keyed_items(10_000 + written, 20, WIDTH))
                writer.flush()
                flush_s.append(time.monotonic() - t0)
                written += 20
                states.add(nodes_by_id(client)[vid]["state"])
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    # Nothing left the table while the node was stopped.
    assert client.table_info("t")["size"] == FIRST + written
    # Routed around at once: no sample and no insert waited on the stopped node
    # for more than the heartbeat timeout and a margin.
    assert "unresponsive" in states, states
    assert max(sample_s) < PAUSE, max(sample_s)
    # A writer may first wait for a new connection's greeting (2 s), then
    # for the control plane to mark the node unresponsive: as in
    # test_failures.py, the heartbeat timeout plus 3 s.
    assert max(flush_s) < 2.0 + 3.0, max(flush_s)
    # It answers again under its id, with every item it had.
    wait_for(lambda: nodes_by_id(client)[vid]["state"] == "live", 15, "the node to be live",
             lambda: nodes_by_id(client))
    assert set(nodes_by_id(client)) == set(before), "a node re-joined under another id"
    assert client.table_info("t")["size"] == FIRST + written
    # What was written meanwhile went to the other node; the stopped one's
    # late copy of a batch it had been sent was refused and its slots freed.
    survivor = next(i for i in before if i != vid)
    wait_for(lambda: items_on(client, slot) == {vid: before[vid],
                                               survivor: before[survivor] + written},
             10, "the nodes' item counts", lambda: items_on(client, slot))
    learner.close()
    learner = client.learner("t", batch_size=256)
    sample_all(learner, set(range(FIRST)) | set(range(10_000, 10_000 + written)))
    learner.close()
    print(f"stopped {stop_s:g} s: longest sample {max(sample_s):.2f} s, longest "
          f"insert+flush {max(flush_s):.2f} s, {written} written meanwhile")


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_killed_node_costs_only_its_items(cluster, client, tls):
    slot = fill(client)
    before = items_on(client, slot)
    victim = cluster.nodes[0]
    vid = victim.info["node_id"]
    learner = client.learner("t", batch_size=64)
    cluster.kill_node(0)  # SIGKILL: its connection is reset at once
    t0 = time.monotonic()
    wait_for(lambda: nodes_by_id(client)[vid]["state"] == "gone", 3.0, "the node to be gone",
             lambda: nodes_by_id(client))
    assert time.monotonic() - t0 < 3.0
    survivor = next(i for i in before if i != vid)
    assert client.table_info("t")["size"] == before[survivor]
    # Every label checked is one the survivor holds: all of its items are there.
    seen = set()
    for _ in range(20):
        batch = learner.sample(timeout=10)
        check_keyed(batch, WIDTH)
        seen |= set(batch.data["key"].tolist())
    assert len(seen) <= before[survivor]
    learner.close()


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_node_silent_past_the_grace_is_gone_and_rejoins_empty(make_cluster, tls):
    cluster = make_cluster(unresponsive_grace=2.0)
    with ds.connect(cluster.address) as client:
        slot = fill(client)
        before = items_on(client, slot)
        victim = cluster.nodes[0]
        vid = victim.info["node_id"]
        survivor = next(i for i in before if i != vid)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: nodes_by_id(client)[vid]["state"] == "unresponsive", 10,
                     "the node to be unresponsive", lambda: nodes_by_id(client))
            assert client.table_info("t")["size"] == FIRST  # kept during the grace
            wait_for(lambda: nodes_by_id(client)[vid]["state"] == "gone", 15,
                     "the node to be gone", lambda: nodes_by_id(client))
            assert client.table_info("t")["size"] == before[survivor]
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        # Woken, it finds itself gone: it re-joins under a new id, empty.
        wait_for(lambda: len([n for n in nodes_by_id(client).values() if n["state"] == "live"])
                 == 2, 20, "the node to re-join", lambda: nodes_by_id(client))
        assert nodes_by_id(client)[vid]["state"] == "gone"
        assert client.table_info("t")["size"] == before[survivor]


def fill_node_with_another_table(client, writer) -> int:
    """Fill the only node's arena with table "filler" (never evicted to make
    room for "t": a table evicts only its own items), so that inserts into
    "t" there fail with StorageFull. Returns the filler's item count."""
    client.create_table("filler", capacity=100_000, spec=SPEC)
    n = client.table_info("filler")["fits"]
    assert n > 100
    for i in range(0, n, 100):
        writer.insert("filler", keyed_items(i, min(100, n - i), WIDTH))
    writer.flush()
    assert client.table_info("filler")["size"] == n
    return n


@pytest.mark.filterwarnings("ignore::distore_ucx.CapacityWarning")
@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_new_node_takes_inserts_while_another_is_full(make_cluster, tls):
    cluster = make_cluster(nodes=1, arena_bytes=1 << 20)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=100_000, spec=SPEC)
        full = cluster.nodes[0].info["node_id"]
        old = client.writer(max_items=100)
        filled = fill_node_with_another_table(client, old)
        with pytest.raises(ds.StorageFull):
            old.insert("t", keyed_items(100_000, 100, WIDTH))
            old.flush()
        assert client.table_info("t")["size"] == 0
        empty = cluster.add_node(arena_bytes=16 << 20).info["node_id"]
        # A new writer's first batch, and the writer that saw StorageFull, go
        # where there is room.
        with client.writer(max_items=100) as new:
            for i in range(5):
                new.insert("t", keyed_items(200_000 + i * 100, 100, WIDTH))
                new.flush()
        for i in range(3):
            old.insert("t", keyed_items(300_000 + i * 100, 100, WIDTH))
            old.flush()
        old.close()
        assert client.table_info("t")["size"] == 800
        assert client.table_info("filler")["size"] == filled
        used = {i: n["used_bytes"] for i, n in nodes_by_id(client).items()}
        slot = client.table_info("t")["slot_size"]
        assert used[empty] == 800 * slot and used[full] == filled * slot, used
        learner = client.learner("t", batch_size=64)
        check_keyed(learner.sample(timeout=10), WIDTH)
        learner.close()


@pytest.mark.filterwarnings("ignore::distore_ucx.CapacityWarning")
@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_full_nodes_storage_full_is_retried_on_another_node(make_cluster, tls, monkeypatch):
    # The writer's node list predates the second node (it is read again only
    # every LIST_EVERY s, made long here): the full node's StorageFull reply
    # must send the batch elsewhere, the list read again, not fail.
    monkeypatch.setattr(placement, "LIST_EVERY", 3600.0)
    cluster = make_cluster(nodes=1, arena_bytes=1 << 20)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=100_000, spec=SPEC)
        slot = client.table_info("t")["slot_size"]
        full = cluster.nodes[0].info["node_id"]
        n = 1000
        with client.writer(max_items=100) as writer:
            # the writer lists the nodes (only the first one) and fills it
            filled = fill_node_with_another_table(client, writer)
            other = cluster.add_node(arena_bytes=16 << 20).info["node_id"]
            for i in range(0, n, 100):
                writer.insert("t", keyed_items(i, 100, WIDTH))
                writer.flush()
        used = {i: m["used_bytes"] for i, m in nodes_by_id(client).items()}
        assert client.table_info("t")["size"] == n
        assert used[full] == filled * slot and used[other] == n * slot, used
