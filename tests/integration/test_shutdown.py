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


def test_sigterm_control_plane_stops_it_and_nodes_follow(make_cluster, tls):
    # Nodes keep their data and try to re-join for --reconnect-timeout; when no
    # control plane comes back they exit with code 3.
    cluster = make_cluster(reconnect_timeout=1.0)
    cluster.control.popen.send_signal(signal.SIGTERM)
    assert cluster.control.popen.wait(timeout=10) == 0
    t0 = time.monotonic()
    for node in cluster.nodes:
        assert node.popen.wait(timeout=10) == 3
    assert time.monotonic() - t0 >= 0.9, "nodes gave up before their reconnect timeout"
    assert "Traceback" not in cluster.control.log_tail(200)
    for node in cluster.nodes:
        log = node.log_tail(200)
        assert "tries to re-join for 1 s" in log and "Traceback" not in log
