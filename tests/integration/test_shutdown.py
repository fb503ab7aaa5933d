"""Graceful SIGTERM: a storage node deregisters, sampling goes on elsewhere."""

from __future__ import annotations

import signal
import time

import numpy as np

SPEC = {"obs": ((512,), "uint8"), "key": ((), "uint64")}


def items(keys_from: int, n: int) -> dict:
    k = np.arange(keys_from, keys_from + n, dtype=np.uint64)
    return {"obs": (k[:, None] * 7 + np.arange(512)).astype(np.uint8), "key": k}


def check(batch) -> None:
    expect = (batch.data["key"][:, None] * 7 + np.arange(512)).astype(np.uint8)
    assert np.array_equal(batch.data["obs"], expect)


def test_sigterm_node_deregisters_at_once_and_sampling_continues(cluster, client, tls):
    client.create_table("t", capacity=10_000, spec=SPEC)
    with client.writer(max_items=50) as writer:
        for i in range(8):
            writer.insert("t", items(i * 50, 50))
    learner = client.learner("t", batch_size=32)
    for _ in range(5):
        check(learner.sample())  # the learner now holds leases on both nodes

    leaving = cluster.nodes[0]
    leaving_id = leaving.info["node_id"]
    leaving.popen.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while any(n["alive"] for n in client.status()["nodes"] if n["node_id"] == leaving_id):
        # Well under the 2 s heartbeat timeout: the node said it was leaving.
        assert time.monotonic() - t0 < 1.0, "the control plane still lists the leaving node"
        time.sleep(0.01)
    size = client.table_info("t")["size"]
    assert 0 < size < 400

    for _ in range(40):  # also while the leaving node drains its reads
        check(learner.sample())
    with client.writer(max_items=25) as writer:  # inserts go to the survivor
        writer.insert("t", items(10_000, 100))
    assert client.table_info("t")["size"] == size + 100
    assert leaving.popen.wait(timeout=10) == 0
    assert "Traceback" not in leaving.log_tail(200)
    for _ in range(20):
        check(learner.sample())
    learner.close()


def test_sigterm_control_plane_stops_it_and_nodes_follow(cluster, tls):
    cluster.control.popen.send_signal(signal.SIGTERM)
    assert cluster.control.popen.wait(timeout=10) == 0
    for node in cluster.nodes:  # they notice the lost control plane and exit
        assert node.popen.wait(timeout=10) == 3
    assert "Traceback" not in cluster.control.log_tail(200)


def test_leaving_node_waits_for_leased_reads_and_a_second_sigterm_ends_the_wait(
        make_cluster, tls, monkeypatch):
    monkeypatch.setenv("DISTORE_NODE_DRAIN_TIMEOUT", "60")  # reaches the nodes' environment
    cluster = make_cluster()
    import distore_ucx as ds

    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        with client.writer(max_items=20) as writer:
            for i in range(10):
                writer.insert("t", items(i * 20, 20))
        learner = client.learner("t", batch_size=128)
        check(learner.sample())  # holds leases on both nodes' slots, and samples no more
        leaving = cluster.nodes[0]
        leaving.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while any(n["alive"] for n in client.status()["nodes"]
                  if n["node_id"] == leaving.info["node_id"]):
            assert time.monotonic() - t0 < 5.0, "the leaving node never deregistered"
            time.sleep(0.01)
        # Deregistered, yet still serving: a learner may be reading its leased slots.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert leaving.alive(), "the node exited while its slots were leased"
            time.sleep(0.05)
        leaving.popen.send_signal(signal.SIGTERM)  # the operator insists
        assert leaving.popen.wait(timeout=15) == 0
        learner.close()
