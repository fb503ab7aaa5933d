"""Replies (protocol/replies.py): every reply declared, parsed from its map
into its typed form, checked against the same bounds as the requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distore_ucx import errors, protocol
from distore_ucx.protocol import ITEM_LOCATION, ProtocolError, parse_reply
from distore_ucx.protocol.records import Record, record, wire

V = protocol.VERSION


def roundtrip(msg):
    """A reply map as the reader gets it: encoded, framed and decoded."""
    head, meta = protocol.encode(msg)
    n, m = protocol.read_header(head)
    return protocol.decode(meta, m)


NODE = {
    "node_id": 3, "name": "node-0", "address": "10.0.0.2:7701", "arena_base": 1 << 40,
    "arena_size": 64 << 20, "used_bytes": 4096, "alive": True, "state": "live", "epoch": 0,
    "heartbeat_gap_max": 0.51, "pid": 4242, "host_id": "h", "arena_id": 99, "page_kind": "4k",
    "local_socket": "", "disk_size": 0,
}
TABLE = {
    "name": "replay", "capacity": 1000, "size": 10, "spec": [["obs", [4], "<f4"]],
    "item_bytes": 16, "slot_size": 64, "sampler": {"kind": "uniform"},
    "remover": {"kind": "fifo"}, "rate_limiter": {"kind": "min_size", "min_size": 1},
    "rate_limiter_state": {"kind": "min_size", "diff": 10.0, "min_diff": float("-inf")},
    "max_times_sampled": 0, "inserts": 10, "samples": 4, "deletes": 0, "leased": 2,
    "awaiting_restore": 0,
}
CHECKPOINT = {"path": "/tmp/c.ckpt", "tables": 1, "items": 10, "bytes": 4096, "seconds": 0.01,
              "snapshot_seconds": 0.001, "created": 1.7e9, "why": "on demand"}


def locations(n):
    loc = np.zeros(n, ITEM_LOCATION)
    loc["node"], loc["offset"], loc["key"] = 3, np.arange(n) * 64, np.arange(n) + (1 << 24)
    return loc


# One reply per operation, as the servers build them (control/server.py,
# storage/node.py); arrays given as numpy, as the servers give them.
REPLIES = {
    "auth": {},
    "items_resent": {},
    "register_node": {"node_id": 3, "heartbeat_interval": 0.5, "restore": False,
                      "store_id": "0123456789abcdef", "items_resent": False},
    "heartbeat": {"state": "live"},
    "deregister_node": {"leased": 0},
    "items_added": {"evicted": 2, "duplicate_offsets": np.array([64], np.uint64)},
    "items_restored": {"restored": 1, "adopted": 2, "discarded": 0},
    "demote": {"keys": np.arange(3, dtype=np.uint64), "offsets": np.arange(3, dtype=np.uint64),
               "generations": np.ones(3, np.uint64)},
    "items_moved": {"taken": np.array([1, 0, 1], np.uint8)},
    "evict": {"offsets": np.arange(2, dtype=np.uint64), "leased": 1},
    "checkpoint": CHECKPOINT,
    "register_writer": {"writer_id": 1, "key_bits": 24},
    "create_table": {**TABLE, "warnings": ["capacity beyond the arenas"]},
    "table_info": {**TABLE, "cold": 0, "fits": 1000},
    "list_tables": {"tables": [TABLE, dict(TABLE, name="other")]},
    "nodes": {"nodes": [dict(NODE, worker_address=b"w" * 40, rkey=b"DSRK" + b"k" * 20)]},
    "node_state": {"state": "unresponsive"},
    "sample": {"lease": 12345, "refused": 0, "table_size": 10, "items": locations(4),
               "probabilities": np.full(4, 0.1), "min_probability": 0.1, "staged": 0,
               "lease_timeout": 30.0, "held": 0.0},
    "release": {"refused": 1},
    "update_priorities": {"updated": 3, "missing": 1},
    "status": {"nodes": [NODE], "tables": [TABLE], "leases": 1, "leases_refused": 0,
               "incarnation": 7, "checkpoint": None, "restoring_s": None},
    "insert": {"n": 64, "evicted": 0, "via": "cma (same host)"},
    "node_info": {"node_id": 3, "name": "node-0", "arena_size": 64 << 20, "used_bytes": 0,
                  "inserted": 0},
}


def test_every_operation_that_is_answered_has_its_reply_declared():
    pushes = {"free", "stage", "retire", "unstage", "staged", "retired"}
    assert set(protocol.REPLIES) == set(protocol.MESSAGES) - pushes
    assert set(REPLIES) == set(protocol.REPLIES)  # and this test has one of each


@pytest.mark.parametrize("op", sorted(REPLIES))
def test_a_reply_parses_into_its_typed_form(op):
    got = parse_reply(op, roundtrip(protocol.reply(7, **REPLIES[op])))
    assert type(got) is protocol.REPLIES[op]
    for name, sent in REPLIES[op].items():
        value = getattr(got, name)
        if isinstance(sent, np.ndarray):
            assert isinstance(value, np.ndarray) and np.array_equal(value, sent)
        elif isinstance(sent, list) and sent and isinstance(sent[0], dict):
            assert all(isinstance(r, Record) for r in value)
        elif isinstance(sent, dict) and op == "status":
            assert isinstance(value, protocol.CheckpointReply)
        else:
            assert value == sent, name


def test_typed_fields_read_as_the_records_they_are():
    sample = parse_reply("sample", roundtrip(protocol.reply(1, **REPLIES["sample"])))
    assert sample.items.dtype == ITEM_LOCATION and list(sample.items["node"]) == [3] * 4
    assert sample.probabilities.dtype == np.float64 and sample.lease == 12345
    nodes = parse_reply("nodes", roundtrip(protocol.reply(1, **REPLIES["nodes"]))).nodes
    assert isinstance(nodes[0], protocol.NodeDescription) and nodes[0].rkey.startswith(b"DSRK")
    assert nodes[0].insert_port is None  # optional: left out
    status = parse_reply("status", roundtrip(protocol.reply(
        1, **dict(REPLIES["status"], checkpoint=CHECKPOINT, restoring_s=2.5))))
    assert status.checkpoint.items == 10 and status.restoring_s == 2.5
    assert status.tables[0].rate_limiter_state["min_diff"] == float("-inf")
    info = parse_reply("node_info", REPLIES["node_info"])
    assert info.disk_size is None and info.node_id == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "x"


def test_fields_a_newer_peer_adds_are_ignored():
    got = parse_reply("release", {"id": 1, "ok": True, "refused": 0, "later": [1, 2]})
    assert got == protocol.ReleaseReply(refused=0)


def test_a_node_not_joined_yet_has_no_id_in_its_node_info():
    assert parse_reply("node_info", dict(REPLIES["node_info"], node_id=None)).node_id is None


MALFORMED = [
    ("register_node", {"node_id": 0}, r"node_id: 0 outside \[1, 4294967295\]"),
    ("register_node", {"node_id": 2**32}, "node_id"),
    ("register_node", {"restore": 1}, "expected bool"),
    ("heartbeat", {"state": None}, "expected str, got NoneType"),
    ("sample", {"lease": 0}, "lease"),
    ("sample", {"items": b"\0" * 31}, "whole number of locations"),
    ("sample", {"probabilities": np.full(3, 0.1)}, "has 3 items, expected 4"),
    ("sample", {"min_probability": 1.5}, "min_probability"),
    ("sample", {"staged": 1.0}, "staged: expected int, got float"),
    ("release", {"refused": -1}, "refused"),
    ("sample", {"min_probability": float("nan")}, "min_probability"),
    ("insert", {"via": None}, "via: expected str"),
    ("items_added", {"duplicate_offsets": b"\0" * 9}, "duplicate_offsets"),
    ("node_info", {"name": ""}, "not a valid name"),
    ("node_info", {"disk_size": -1}, "disk_size"),
    ("nodes", {"nodes": [dict(NODE, node_id=0)]}, r"a node\.node_id"),
    ("nodes", {"nodes": [5]}, "a node: expected a map, got int"),
    ("list_tables", {"tables": [dict(TABLE, name="bad\nname")]}, "not a valid name"),
    ("status", {"checkpoint": {"path": "/x"}}, "missing field 'tables'"),
    ("table_info", {"fits": True}, "expected int, got bool"),
]


@pytest.mark.parametrize("op, change, message", [
    *MALFORMED, ("sample", {"probabilities": np.array([np.nan] * 4)}, "finite")])
def test_a_malformed_reply_is_refused_naming_the_field(op, change, message):
    msg = roundtrip(protocol.reply(1, **{**REPLIES[op], **change}))
    with pytest.raises(ProtocolError, match=message):
        parse_reply(op, msg)


# -- the quick check of hot paths (check_reply, Record.accepts) -------------

@pytest.mark.parametrize("op", sorted(REPLIES))
def test_check_reply_hands_a_well_formed_reply_back_as_it_is(op):
    msg = roundtrip(protocol.reply(7, **REPLIES[op]))
    assert protocol.check_reply(op, msg) is msg
    flat = all(f.of is None for f in protocol.REPLIES[op].FIELDS)
    assert protocol.REPLIES[op].accepts(msg) is flat  # records inside: parse checks them


@pytest.mark.parametrize("op, change, message", MALFORMED)
def test_the_quick_check_takes_nothing_parse_refuses(op, change, message):
    msg = roundtrip(protocol.reply(1, **{**REPLIES[op], **change}))
    assert not protocol.REPLIES[op].accepts(msg)
    with pytest.raises(ProtocolError, match=message):
        protocol.check_reply(op, msg)


def test_the_quick_check_takes_absent_optional_and_null_nullable_fields():
    assert protocol.NodeInfoReply.accepts(dict(REPLIES["node_info"], node_id=None))
    assert protocol.ItemsAddedReply.accepts({"evicted": 0})
    assert not protocol.NodeInfoReply.accepts({k: v for k, v in REPLIES["node_info"].items()
                                               if k != "inserted"})
    assert not protocol.SampleReply.accepts([("lease", 1)])


def test_the_quick_check_leaves_what_it_cannot_tell_to_parse():
    # An int subclass passes `check`; the quick check takes only what msgpack
    # decodes, and check_reply parses the rest.
    msg = dict(REPLIES["register_writer"], writer_id=type("Id", (int,), {})(5))
    assert not protocol.RegisterWriterReply.accepts(msg)
    assert protocol.check_reply("register_writer", msg) is msg


def test_the_quick_check_does_not_look_into_arrays():
    # What a hot path takes as it is: parse_reply refuses it, accepts does not.
    msg = roundtrip(protocol.reply(1, **dict(REPLIES["sample"],
                                             probabilities=np.array([np.nan] * 4))))
    assert protocol.SampleReply.accepts(msg)


def test_a_malformed_reply_names_the_peer_that_sent_it():
    msg = roundtrip(protocol.reply(1, **REPLIES["insert"]))
    del msg["evicted"]
    with pytest.raises(ProtocolError, match=r"reply to insert: missing field 'evicted' "
                                            r"\(from storage node at 10\.0\.0\.2:7701\)"):
        protocol.check_reply("insert", msg, "storage node at 10.0.0.2:7701")


def test_a_missing_field_is_named():
    msg = roundtrip(protocol.reply(1, **REPLIES["register_writer"]))
    del msg["key_bits"]
    with pytest.raises(ProtocolError, match="reply to register_writer: missing field 'key_bits'"):
        parse_reply("register_writer", msg)


def test_an_error_reply_raises_what_it_stands_for():
    msg = roundtrip(protocol.error_reply(4, errors.TableNotFound("no table 'x'")))
    with pytest.raises(errors.TableNotFound, match=r"no table 'x' \(from control plane\)"):
        parse_reply("table_info", msg, "control plane")


def test_pushes_and_unknown_operations_have_no_reply():
    for op in ("free", "staged", "bogus"):
        with pytest.raises(ProtocolError, match="no reply is declared"):
            parse_reply(op, {"id": 1, "ok": True})


def test_a_record_is_declared_once_with_its_bounds():
    @record("a pair")
    class Pair(Record):
        a: int = wire("int", lo=0, hi=9)
        b: str | None = wire(protocol.fields.STORE_ID, optional=True)

    assert [f.name for f in Pair.FIELDS] == ["a", "b"]
    assert Pair.FIELDS[1].max_len == protocol.fields.STORE_ID.max_len
    assert Pair.parse({"a": 1}) == Pair(a=1, b=None)
    with pytest.raises(ProtocolError, match=r"a pair\.a: 10 outside"):
        Pair.parse({"a": 10})


# -- one bound per field, across requests and replies -----------------------

# Names that mean different things in different messages, each bounded for
# its own: `n` items to demote, evict or sample (requests) or stored (an
# insert's reply); `extents` a list of starts (staged) or an array
# (unstage); `size` a staging buffer's bytes (insert) or a table's items;
# `tables`, `items`, `leases` lists or arrays in some messages, counts in
# others (status, checkpoint).
TWO_MEANINGS = {"n", "extents", "size", "tables", "items", "leases"}
# Names bounded apart on purpose: a table's slot and item sizes (any its
# spec makes) and what one insert, stage or re-sent batch may move; a host
# id as a request carries it (left out when unknown) and as the node list
# gives it ("" when the node sent none).
TWO_BOUNDS = {
    "slot_size": {("int", 1, 1 << 34, None, False), ("int", 1, 2**64 - 1, None, False)},
    "item_bytes": {("int", 1, 1 << 34, None, False), ("int", 1, 2**64 - 1, None, False)},
    "host_id": {("str", None, None, 128, True), ("str", None, None, 128, False)},
}


def all_declarations():
    """(where, fields) of every request, reply and record a reply carries."""
    out = [(op, fields) for op, fields in protocol.MESSAGES.items()]
    seen, todo = set(), list(protocol.REPLIES.values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        out.append((cls.WHAT, cls.FIELDS))
        todo += [f.of for f in cls.FIELDS if f.of is not None]
    return out


def test_a_field_has_one_bound_in_every_request_and_reply_that_carries_it():
    ways: dict[str, dict[tuple, list[str]]] = {}
    for where, fields in all_declarations():
        for f in fields:
            ways.setdefault(f.name, {}).setdefault(
                (f.kind, f.lo, f.hi, f.max_len, f.printable), []).append(where)
    differ = {name: w for name, w in ways.items() if len(w) > 1 and name not in TWO_MEANINGS
              and set(w) != TWO_BOUNDS.get(name)}
    assert not differ, differ
    # node ids above all: one bound wherever one travels.
    assert set(ways["node_id"]) == {("int", 1, protocol.MAX_NODE_ID, None, False)}
    # the table records carry a table's own sizes; the insert, its bound.
    assert set(ways["slot_size"][("int", 1, 2**64 - 1, None, False)]) == {
        "a table", "reply to create_table", "reply to table_info"}
    assert "insert" in ways["slot_size"][("int", 1, 1 << 34, None, False)]


def test_a_table_whose_items_no_insert_can_carry_still_has_readable_info():
    # create_table takes any spec one arena can hold; inserts carry slots of
    # at most 2**34 bytes: the table's info must parse all the same.
    big = dict(TABLE, item_bytes=2**35, slot_size=2**35 + 64)
    for op in ("create_table", "table_info"):
        got = parse_reply(op, roundtrip(protocol.reply(1, **{**REPLIES[op], **big})))
        assert got.slot_size == 2**35 + 64 and got.item_bytes == 2**35
    listed = parse_reply("list_tables", roundtrip(protocol.reply(1, tables=[big])))
    assert listed.tables[0].slot_size == 2**35 + 64


def test_a_node_that_sent_no_host_id_is_listed_with_an_empty_one():
    # The control plane lists "" for it; a request that carries one must name it.
    got = parse_reply("nodes", roundtrip(protocol.reply(1, nodes=[dict(NODE, host_id="")])))
    assert got.nodes[0].host_id == ""
    with pytest.raises(ProtocolError, match="insert.host_id: '' is not a valid name"):
        protocol.fields.check("insert", protocol.fields.HOST_ID, "")
