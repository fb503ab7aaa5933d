"""The replies real servers send parse as protocol/replies.py declares them.

A writer, a learner and the CLI's calls go through a LocalCluster while
every reply their connections read is recorded; a stand-in storage node
then makes the node-side requests of the control plane. Each reply is
parsed with parse_reply: a declaration that disagrees with what a server
sends fails here, naming the field; one the quick check of hot paths
(check_reply) would leave to parse_reply, too.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
from helpers import keyed_items, keyed_spec

import distore_ucx as ds
from distore_ucx import protocol
from distore_ucx.slot_format import COLD
from distore_ucx.transport import rpc
from distore_ucx.transport.blocking_client import RpcClient

WIDTH = 256


def record_replies(monkeypatch) -> list[tuple[str, dict]]:
    """(op, reply map) of every reply a blocking client of this process reads."""
    seen: list[tuple[str, dict]] = []
    sent: dict[int, list[str]] = {}
    send, receive = RpcClient._send, RpcClient._receive

    def _send(self, op, fields):
        mid = send(self, op, fields)
        sent.setdefault(id(self), []).append(op)
        return mid

    def _receive(self, timeout):
        msg = receive(self, timeout)
        seen.append((sent[id(self)].pop(0), msg))
        return msg

    monkeypatch.setattr(RpcClient, "_send", _send)
    monkeypatch.setattr(RpcClient, "_receive", _receive)
    return seen


async def stand_in_node(address: str, token: bytes | None, table: str,
                        meanwhile) -> list[tuple[str, dict]]:
    """A storage node's requests of the control plane, from a node that holds
    no memory: the control plane only records what a node says. `meanwhile`
    runs (in a thread) while the control plane holds the node's items."""
    control = await rpc.AsyncClient.connect(address, "control plane", token=token)
    replies = []

    async def call(op, **fields):
        replies.append((op, await control.call(op, **fields)))
        return replies[-1][1]

    try:
        joined = await call("register_node", name="stand-in", host="127.0.0.1", port=9,
                            worker_address=b"w" * 32, rkey=b"k" * 32, arena_base=1 << 40,
                            arena_size=1 << 20, pid=os.getpid())
        node = joined["node_id"]
        await call("heartbeat", node_id=node, used_bytes=0)
        keys = (np.uint64(1) << np.uint64(60)) + np.arange(8, dtype=np.uint64)
        offsets = np.arange(8, dtype=np.uint64) * np.uint64(4096)
        gens = np.ones(8, np.uint64)
        await call("items_added", node_id=node, table=table, keys=keys, offsets=offsets,
                   generations=gens, priorities=np.ones(8), used_bytes=8 * 4096)
        # Inserts registered together, one of them refused (its `errors`).
        more = keys + np.uint64(8)
        reply = await call("items_added", node_id=node, table=table, keys=more,
                           offsets=offsets + np.uint64(8 * 4096), generations=gens,
                           priorities=np.array([1, 1, 1, 1, -1, 1, 1, 1], np.float64),
                           batches=[4, 4], timeouts=[5.0, 5.0])
        assert [e[0] for e in reply["errors"]] == [1]
        await asyncio.to_thread(meanwhile)
        await call("evict", node_id=node, table=table, n=1)
        picked = await call("demote", node_id=node, table=table, n=2)
        moved = np.frombuffer(picked["offsets"], np.uint64)
        await call("items_moved", node_id=node, table=table, keys=picked["keys"],
                   offsets=picked["offsets"], generations=picked["generations"],
                   new_offsets=moved | COLD, new_generations=np.frombuffer(
                       picked["generations"], np.uint64) + np.uint64(1))
        await call("items_resent", node_id=node)
        await call("deregister_node", node_id=node)
    finally:
        await control.close()
    return replies


def test_every_reply_the_servers_send_parses_as_declared(tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "0")
    seen = record_replies(monkeypatch)
    with ds.LocalCluster(nodes=1, arena_bytes=16 << 20, log_level="ERROR",
                         checkpoint=str(tmp_path / "store.ckpt")) as cluster:
        with ds.connect(cluster.address) as client:
            client.create_table("t", capacity=200, spec=keyed_spec(WIDTH))
            client.create_table("t", capacity=200, spec=keyed_spec(WIDTH))  # exists
            with client.writer(max_items=50) as writer:
                writer.insert("t", keyed_items(0, 100, WIDTH), priority=1.0)
            with client.learner("t", batch_size=16) as learner:
                batch = learner.sample(timeout=30)
                learner.update_priorities(batch.keys, np.full(len(batch.keys), 2.0))
            client.table_info("t")
            client.tables()
            client.checkpoint()
            client.status()  # with the checkpoint it made
            node = client.nodes()[0]
            client.call("node_state", node_id=node["node_id"])
            with rpc.RpcClient(node["address"], token=client.token) as conn:
                conn.call("node_info")

            def sample_and_release():  # its items, which no learner could read
                with client.connection() as conn:
                    lease = conn.call("sample", table="stand-in", n=2)["lease"]
                    conn.call("release", leases=[lease])

            client.create_table("stand-in", capacity=100, spec=keyed_spec(WIDTH))
            seen += asyncio.run(stand_in_node(cluster.address, client.token, "stand-in",
                                              sample_and_release))

    ops = set()
    for op, msg in seen:
        assert msg.get("ok") is True, (op, msg)
        got = protocol.parse_reply(op, msg)
        assert type(got) is protocol.REPLIES[op]
        # and the quick check of hot paths takes it as it is, not by parsing it
        flat = all(f.of is None for f in got.FIELDS)
        assert got.accepts(msg) is flat, (op, msg)
        ops.add(op)
    # Every answered operation but auth (transport/auth.py reads it) and
    # items_restored (only while a control plane restores: test_restore.py).
    assert ops == set(protocol.REPLIES) - {"auth", "items_restored"}, ops
