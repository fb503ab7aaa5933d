"""The client's readers of replies check them against their declarations
(protocol/replies.py): a malformed reply fails where it arrives, with a
ProtocolError naming the field and the peer, not with a KeyError in the code
that reads it later. In one process: fake connections stand in for the
control plane."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx import protocol
from distore_ucx.client.client import Client
from distore_ucx.client.learner.sample_stream import SampleStream
from distore_ucx.client.writer.keys import KeyRange, key_span
from distore_ucx.protocol import ITEM_LOCATION, ProtocolError

PEER = "control plane at 10.0.0.1:7700"


def sample_reply(n: int, **change) -> dict:
    """A sample reply as a connection hands it over (decoded from msgpack)."""
    loc = np.zeros(n, ITEM_LOCATION)
    loc["node"], loc["offset"], loc["key"] = 1, np.arange(n) * 64, np.arange(n) + 1
    fields = dict(lease=7, refused=0, table_size=100, items=loc,
                  probabilities=np.full(n, 0.01), min_probability=0.01, staged=0,
                  lease_timeout=30.0, held=0.0)
    head, meta = protocol.encode(protocol.reply(1, **{**fields, **change}))
    return protocol.decode(meta, protocol.read_header(head)[1])


class FakeRpc:
    """A control-plane connection whose every reply is `reply`."""

    name = PEER
    session = 1
    in_flight = 0
    connected = True

    def __init__(self, reply: dict):
        self.reply = reply
        self.asked: list[str] = []

    def call(self, op: str, reply_timeout: float | None = None, **fields) -> dict:
        self.asked.append(op)
        return self.reply

    def send(self, op: str, **fields) -> int:
        raise AssertionError("not pipelined here")


def test_a_well_formed_sample_reply_is_handed_on_as_it_came():
    reply = sample_reply(4)
    stream = SampleStream(FakeRpc(reply), "t", batch_size=4, ahead=1, pipelined=False)
    got, renewed = stream.next(1.0)
    assert got is reply and not renewed


@pytest.mark.parametrize("change, message", [
    ({"lease": 0}, r"reply to sample\.lease: 0 outside"),
    ({"items": b"\0" * 33}, "whole number of locations"),
    ({"probabilities": np.full(3, 0.01)}, "has 3 items, expected 4"),
])
def test_a_malformed_sample_reply_fails_where_it_arrives(change, message):
    stream = SampleStream(FakeRpc(sample_reply(4, **change)), "t", batch_size=4, ahead=1,
                          pipelined=False)
    with pytest.raises(ProtocolError, match=message) as caught:
        stream.next(1.0)
    assert PEER in str(caught.value)


def test_a_sample_reply_missing_a_field_names_it():
    reply = sample_reply(4)
    del reply["table_size"]
    stream = SampleStream(FakeRpc(reply), "t", batch_size=4, ahead=1, pipelined=False)
    with pytest.raises(ProtocolError, match="missing field 'table_size'"):
        stream.resample(4, 1.0)


class FakeClient:
    """What a KeyRange asks of its client."""

    def __init__(self, reply: dict):
        self.reply = reply

    def call(self, op: str, **fields) -> dict:
        assert op == "register_writer"
        return self.reply


def test_a_writer_takes_its_keys_from_a_checked_reply():
    keys = KeyRange(FakeClient({"id": 1, "ok": True, "writer_id": 3, "key_bits": 24}))
    assert (keys.writer_id, keys.base, keys.count) == (3, 3 << 24, 1 << 24)
    with pytest.raises(ProtocolError, match=r"register_writer\.key_bits: 0 outside"):
        KeyRange(FakeClient({"id": 1, "ok": True, "writer_id": 3, "key_bits": 0}))


def test_keys_given_are_never_given_again():
    keys = KeyRange(FakeClient({"id": 1, "ok": True, "writer_id": 3, "key_bits": 2}))
    assert keys.give(3) == 12 and keys.give(1) == 15  # id 3's 4 keys: 12 to 15
    keys._client = FakeClient({"id": 2, "ok": True, "writer_id": 4, "key_bits": 2})
    assert list(key_span(keys.give(2), 2)) == [16, 17]  # used up: the next id's
    assert keys.writer_id == 4 and list(keys.peek(2)) == [18, 19]


def offline_client(reply: dict) -> Client:
    """A Client whose control-plane connection is a FakeRpc."""
    client = Client.__new__(Client)
    client._rpc, client._closed, client._specs = FakeRpc(reply), False, {}
    return client


NODE = {"node_id": 1, "name": "n", "address": "h:1", "arena_base": 0, "arena_size": 1,
        "used_bytes": 0, "alive": True, "state": "live", "epoch": 0,
        "heartbeat_gap_max": 0.0, "pid": 1, "host_id": "", "arena_id": 0, "page_kind": "",
        "local_socket": "", "disk_size": 0}


def test_the_client_api_returns_checked_replies_as_the_maps_they_were():
    client = offline_client({"id": 1, "ok": True, "nodes": [NODE], "later": 1})
    assert client.nodes() == [NODE]
    status = {"id": 2, "ok": True, "nodes": [NODE], "tables": [], "leases": 0,
              "leases_refused": 0, "incarnation": 1, "checkpoint": None, "restoring_s": None}
    client._rpc.reply = status
    assert client.status() == {k: v for k, v in status.items() if k not in ("id", "ok")}


def test_the_client_api_refuses_a_malformed_reply_naming_the_field():
    client = offline_client({"id": 1, "ok": True, "nodes": [dict(NODE, node_id=0)]})
    with pytest.raises(ProtocolError, match=r"a node\.node_id: 0 outside .*" + PEER):
        client.nodes()
    client._rpc.reply = {"id": 1, "ok": True, "tables": [{"name": "t"}]}
    with pytest.raises(ProtocolError, match="a table: missing field 'capacity'"):
        client.tables()
