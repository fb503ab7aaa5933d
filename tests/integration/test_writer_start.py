"""A new writer is ready to insert at full speed: `client.writer()` connects
to the live storage nodes and hands same-host ones its first staging buffer,
so its first inserts and flushes do neither (client/writer/writer.py); a
node that cannot be reached then neither fails nor holds up its creation
beyond the connect timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.client.writer import connections as writer_connections
from distore_ucx.client.writer import send as writer_send

SPEC = {"payload": ((3000,), "uint8")}


def counting(monkeypatch) -> tuple[list, list]:
    """Count the writer's new connections to nodes, and its staging buffers
    handed to same-host nodes."""
    made, handed = [], []
    connect = writer_connections.Connections._connect
    send_staging = writer_send.send_staging

    def counted_connect(self, node, *args):
        made.append(node["node_id"])
        return connect(self, node, *args)

    def counted_send_staging(*args, **kwargs):
        handed.append(args[0])
        return send_staging(*args, **kwargs)

    monkeypatch.setattr(writer_connections.Connections, "_connect", counted_connect)
    monkeypatch.setattr(writer_send, "send_staging", counted_send_staging)
    return made, handed


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
def test_a_new_writer_is_connected_and_its_first_flushes_connect_nothing(client, tls,
                                                                         monkeypatch):
    mapped = os.environ["DISTORE_LOCAL_MAP"] == "1"
    client.create_table("t", capacity=100, spec=SPEC)
    made, handed = counting(monkeypatch)
    with client.writer() as w:
        nodes = {n["node_id"] for n in client.nodes()}
        assert sorted(made) == sorted(nodes)  # one connection to each node, made already
        assert len(handed) == (len(nodes) if mapped else 0)
        made.clear(), handed.clear()
        for i in range(2 * len(nodes)):  # a batch to each node (placement: fewest bytes)
            w.insert("t", {"payload": np.full(3000, i, np.uint8)})
            w.flush()
        assert not made and not handed, (made, handed)
        assert set(w.paths) == nodes
        if mapped:  # the nodes read the buffer they were handed at creation
            assert set(w.paths.values()) == {"mapped (same host)"}
    assert client.table_info("t")["size"] == 2 * len(nodes)


@pytest.mark.parametrize("tls", ["mapped"], indirect=True)
def test_a_node_that_does_not_answer_at_creation_neither_fails_nor_holds_up_the_writer(
        make_cluster, tls, caplog):
    # SIGSTOP: the node's sockets stay open and it never greets; the control
    # plane lists it live until its heartbeats are missed.
    cluster = make_cluster(heartbeat_timeout=1.0)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=100, spec=SPEC)
        victim = cluster.nodes[0]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="distore_ucx.client.writer"):
                w = client.writer()
            took = time.monotonic() - t0
            warned = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
            assert took < writer_connections.CONNECT_TIMEOUT + 2.0, took
            assert len(warned) == 1 and "at first use" in warned[0], warned
            with w:  # it inserts into the node that answers
                for i in range(4):
                    w.insert("t", {"payload": np.full(3000, i, np.uint8)})
                    w.flush()
                assert set(w.paths) and victim.info["node_id"] not in w.paths
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert client.table_info("t")["size"] == 4
