"""Control messages: framing, decoding and validation against declarations."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from distore_ucx import protocol
from distore_ucx.protocol import ProtocolError

V = protocol.VERSION


def roundtrip(msg):
    frame = b"".join(bytes(b) for b in protocol.encode(msg))
    n, meta = protocol.read_header(frame[: protocol.HEADER_SIZE])
    assert n == len(frame) - protocol.HEADER_SIZE
    return protocol.decode(frame[protocol.HEADER_SIZE :], meta)


def test_request_round_trip_with_arrays():
    keys = np.arange(5, dtype=np.uint64)
    msg = protocol.request("free", 3, table="t", offsets=keys)
    op, fields = protocol.validate_request(roundtrip(msg))
    assert op == "free" and fields["table"] == "t"
    assert np.array_equal(fields["offsets"], keys)


@pytest.mark.parametrize(
    "msg, message",
    [
        ({"v": 99, "op": "nodes", "id": 1}, "protocol version"),
        ({"v": V, "op": "nope", "id": 1}, "unknown operation"),
        ({"v": V, "op": "table_info", "id": 1}, "missing field"),
        ({"v": V, "op": "table_info", "id": 1, "name": 5}, "expected str"),
        ({"v": V, "op": "table_info", "id": 1, "name": "x" * 200}, "longer than"),
        ({"v": V, "op": "table_info", "id": 1, "name": "bad\nname"}, "not a valid name"),
        ({"v": V, "op": "sample", "id": 1, "table": "t", "n": 0}, "outside"),
        ({"v": V, "op": "sample", "id": 1, "table": "t", "n": True}, "expected int"),
        ({"v": V, "op": "sample", "id": 1, "table": "t", "n": 4, "timeout": float("nan")},
         "outside"),
        ({"v": V, "op": "free", "id": 1, "table": "t", "offsets": b"123"}, "whole number"),
        (
            {
                "v": V, "op": "items_added", "id": 1, "node_id": 1, "table": "t",
                "keys": b"\0" * 16, "offsets": b"\0" * 8, "generations": b"\0" * 16,
                "priorities": b"\0" * 16,
            },
            "expected 2",
        ),
        (
            {
                "v": V, "op": "items_added", "id": 1, "node_id": 1, "table": "t",
                "keys": b"\0" * 8, "offsets": b"\0" * 8, "generations": b"\0" * 8,
                "priorities": np.array([np.nan]).tobytes(),
            },
            "finite",
        ),
    ],
)
def test_invalid_requests_are_rejected(msg, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.validate_request(msg)


def test_a_frame_is_a_header_and_its_metadata_only():
    parts = protocol.encode(protocol.request("node_info", 5))
    assert len(parts) == 2
    n, meta = protocol.read_header(parts[0])
    assert n == meta == len(parts[1])
    # The header leaves room for bytes after the map; no message has any, and
    # a receiver does not read them.
    body = bytes(parts[1]) + b"extra"
    assert protocol.decode(body, meta) == {"v": V, "op": "node_info", "id": 5}


def test_an_insert_is_a_descriptor_not_the_bytes():
    keys = np.arange(4, dtype=np.uint64)
    fields = {"table": "t", "slot_size": 64, "item_bytes": 6, "keys": keys,
              "priorities": np.ones(4),
                  "offsets": keys * np.uint64(6), "lengths": np.full(4, 6, np.uint64),
                  "worker_address": b"w" * 40, "rkey": b"DSRK" + b"k" * 20, "base": 1 << 40,
                  "size": 1 << 20, "pid": 1234, "host_id": "h", "timeout": 2.0}
    op, got = protocol.validate_request(roundtrip(protocol.request("insert", 5, **fields)))
    assert op == "insert"
    assert np.array_equal(got["offsets"], keys * np.uint64(6)) and got["base"] == 1 << 40
    short = dict(fields, lengths=np.full(3, 6, np.uint64))
    with pytest.raises(ProtocolError, match="lengths"):
        protocol.validate_request(roundtrip(protocol.request("insert", 6, **short)))
    with pytest.raises(ProtocolError, match="missing field 'rkey'"):
        protocol.validate_request(roundtrip(protocol.request(
            "insert", 7, **{k: v for k, v in fields.items() if k != "rkey"})))


def test_undecodable_and_oversized_frames():
    with pytest.raises(ProtocolError, match="undecodable"):
        protocol.decode(b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="must be a map"):
        protocol.decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="id"):
        protocol.decode(msgpack.packb({"op": "x"}))
    with pytest.raises(ProtocolError, match="frame length"):
        protocol.read_header(protocol.HEADER.pack(protocol.MAX_FRAME + 1, 1))
    with pytest.raises(ProtocolError, match="frame length"):
        protocol.read_header(protocol.HEADER.pack(0, 0))
    with pytest.raises(ProtocolError, match="metadata length"):
        protocol.read_header(protocol.HEADER.pack(10, 11))


def test_every_declared_operation_has_only_known_kinds():
    kinds = {"int", "float", "str", "bytes", "bool", "list", "dict", "u64[]", "u32[]", "u8[]",
             "f64[]"}
    for op, fields in protocol.MESSAGES.items():
        assert all(f.kind in kinds for f in fields), op


# -- fields several messages carry have one bound --------------------------

# Names that stand for different things in different messages, each bounded
# for its own: `n` items to demote or evict (MAX_ITEMS) or to sample
# (MAX_SAMPLE); `extents` a list of starts (staged) or an array (unstage).
TWO_MEANINGS = {"n", "extents"}


def bounds_by_name(declarations):
    """field name -> {(kind, lo, hi, max_len): [where it is declared so]}."""
    seen: dict[str, dict[tuple, list[str]]] = {}
    for op, fields in declarations:
        for f in fields:
            seen.setdefault(f.name, {}).setdefault(
                (f.kind, f.lo, f.hi, f.max_len), []).append(op)
    return seen


def test_a_field_carried_by_several_requests_has_one_bound():
    differ = {name: ways for name, ways in bounds_by_name(protocol.MESSAGES.items()).items()
              if len(ways) > 1 and name not in TWO_MEANINGS}
    assert not differ, differ


@pytest.mark.parametrize("op, extra", [
    ("heartbeat", {"used_bytes": 0}),
    ("deregister_node", {}),
    ("items_resent", {}),
    ("retired", {"request": 1}),
])
def test_node_ids_are_one_to_max_node_id_in_every_message(op, extra):
    def check(node_id):
        return protocol.validate_request({"v": V, "op": op, "id": 1, "node_id": node_id,
                                          **extra})
    for ok in (1, protocol.MAX_NODE_ID):
        assert check(ok)[1]["node_id"] == ok
    for bad in (0, protocol.MAX_NODE_ID + 1, -1):
        with pytest.raises(ProtocolError, match="node_id"):
            check(bad)


def test_the_node_id_an_insert_names_is_bounded_as_every_other():
    f = {f.name: f for f in protocol.MESSAGES["insert"]}["node_id"]
    reg = {f.name: f for f in protocol.MESSAGES["register_node"]}["node_id"]
    assert not f.required and not reg.required
    assert (f.lo, f.hi) == (reg.lo, reg.hi) == (1, protocol.MAX_NODE_ID)
    # A sampled item's node is a uint32 of ITEM_LOCATION: every node id fits.
    assert np.iinfo(protocol.ITEM_LOCATION["node"]).max == protocol.MAX_NODE_ID


def _valid_value(f, n):
    """A value field `f` accepts, for a message whose arrays hold n items."""
    from distore_ucx.protocol.fields import ARRAY_DTYPES

    if f.kind in ARRAY_DTYPES:
        return np.zeros(n, ARRAY_DTYPES[f.kind]).tobytes()
    lo = 0 if f.lo is None else f.lo
    return {"int": int(lo) + 1 if f.hi is None or lo + 1 <= f.hi else int(lo),
            "float": float(lo) + 0.5, "str": "name", "bytes": b"ab", "bool": True,
            "list": [], "dict": {}}[f.kind]


def _variants(f, n):
    """Values around field `f`'s declaration: accepted ones, each way it can
    be refused, and kinds only the declaration loop tells apart."""
    from distore_ucx.protocol.fields import ARRAY_DTYPES

    if f.kind in ARRAY_DTYPES:
        size = np.dtype(ARRAY_DTYPES[f.kind]).itemsize
        out = [b"", b"\0" * (size * n + 1), b"\0" * size * (n + 1), memoryview(b"\0" * size * n),
               bytearray(size * n), 7, None]
        if f.kind == "f64[]":
            out += [np.array([1.0] * (n - 1) + [v], np.float64).tobytes()
                    for v in (np.nan, np.inf, -np.inf, 1e308)]
            out.append(np.full(100, np.nan).tobytes())
        return out
    out = [None, 1.5, "s", b"b", True, False, 0, -1, 2**64, [], {}, "", "a\n", "x" * 300,
           b"x" * 70000, float("nan"), 1, 2.0]
    for bound in (f.lo, f.hi):
        if bound is not None:
            out += [bound, bound - 1, bound + 1, float(bound)]
    return out


@pytest.mark.parametrize("op", sorted(protocol.MESSAGES))
def test_the_made_check_of_every_request_takes_and_refuses_what_its_declaration_does(op):
    # validate_request checks a request with code made from its declaration
    # and falls back to the declaration loop for what that code refuses:
    # the made code must never accept what the loop refuses, nor return
    # other fields than the loop does.
    from distore_ucx.protocol.requests import _FAST, _checked

    fields = protocol.MESSAGES[op]
    n = 3
    base = {"v": V, "op": op, "id": 1}
    base.update({f.name: _valid_value(f, n) for f in fields})
    msgs = [base, {k: v for k, v in base.items() if k in ("v", "op", "id")}]
    for f in fields:
        msgs.append({k: v for k, v in base.items() if k != f.name})
        for value in _variants(f, n):
            msgs.append({**base, f.name: value})
    made = 0
    for msg in msgs:
        fast = _FAST[op](msg)
        try:
            slow = _checked(op, msg)
        except ProtocolError as exc:
            assert fast is None, f"{op}: made check accepted {msg} that the loop refuses: {exc}"
            continue
        if fast is None:
            continue  # the loop takes it (a subclass): validate_request falls back to it
        made += 1
        assert list(fast) == list(slow), (op, msg)
        for name, v in slow.items():
            if isinstance(v, np.ndarray):
                assert fast[name].dtype == v.dtype and np.array_equal(fast[name], v), (op, name)
                assert not fast[name].flags.writeable
            else:
                assert type(fast[name]) is type(v) and fast[name] == v, (op, name)
    assert made > 0, f"{op}: the made check accepted none of the valid requests"
    # validate_request gives what the loop gives, whichever way it went
    assert protocol.validate_request(base)[1].keys() == _checked(op, base).keys()
