"""Every request, declared once: its fields, their kinds and bounds, and
the check a server runs on each request before answering it."""

from __future__ import annotations

from typing import Any

import numpy as np

from .error_codes import ProtocolError
from .fields import _NAME, ARRAY_DTYPES, MAX_ITEMS, MAX_SAMPLE, F, check
from .framing import VERSION

__all__ = [
    "MESSAGES",
    "request",
    "validate_request",
]

# op -> fields of the request. Replies are validated by the side that uses them.
MESSAGES: dict[str, tuple[F, ...]] = {
    # every server: the answer to the hello's challenge (HMAC-SHA256)
    "auth": (F("mac", "bytes", max_len=64),),
    # control plane
    "register_node": (
        F("name", "str", **_NAME),
        F("host", "str", max_len=255),
        F("port", "int", lo=0, hi=65535),
        F("worker_address", "bytes", max_len=1 << 16),
        F("rkey", "bytes", max_len=1 << 16),
        F("arena_base", "int", lo=0, hi=2**64 - 1),
        F("arena_size", "int", lo=1, hi=2**64 - 1),
        F("pid", "int", lo=0, hi=2**31),
        F("host_id", "str", required=False, max_len=128),
        # same-host mapping: the arena's identity, page size, and the Unix
        # socket that hands its sealed memfd to learners (transport/local_map.py)
        F("arena_id", "int", required=False, lo=0, hi=2**63 - 1),
        F("page_kind", "str", required=False, max_len=16),
        F("local_socket", "str", required=False, max_len=100),
        # the id a node had before it lost the control plane (it re-joins),
        # and the store it joined then (a restoring control plane of another
        # store refuses it rather than mix their items)
        F("node_id", "int", required=False, lo=1, hi=2**32 - 1),
        F("store_id", "str", required=False, max_len=64),
        # bytes of the node's disk tier (storage/tier.py; absent: none)
        F("disk_size", "int", required=False, lo=0, hi=2**62),
        # the UCX worker that takes inserts as active messages (absent: the
        # node reads writers' staging buffers with one-sided gets only)
        F("insert_address", "bytes", required=False, max_len=1 << 16),
    ),
    "heartbeat": (F("node_id", "int", lo=0, hi=2**32), F("used_bytes", "int", lo=0)),
    # A node shutting down (SIGTERM): its items leave sampling at once.
    "deregister_node": (F("node_id", "int", lo=0, hi=2**32),),
    "items_added": (
        F("node_id", "int", lo=0, hi=2**32),
        F("table", "str", **_NAME),
        F("keys", "u64[]"),
        F("offsets", "u64[]"),
        F("generations", "u64[]"),
        F("priorities", "f64[]"),
        F("used_bytes", "int", required=False, lo=0),
        F("timeout", "float", required=False, lo=0, hi=86400),
        F("epoch", "int", required=False, lo=0, hi=2**63 - 1),  # as the insert's
    ),
    # A re-joined node's items, when register_node's reply asked for them
    # (the control plane is restoring from a checkpoint).
    "items_restored": (
        F("node_id", "int", lo=0, hi=2**32),
        F("table", "str", **_NAME),
        F("slot_size", "int", lo=1, hi=1 << 34),
        F("keys", "u64[]"),
        F("offsets", "u64[]"),
        F("generations", "u64[]"),
        F("priorities", "f64[]"),
    ),
    # A re-joined node has sent every item it holds (when register_node's
    # reply has "items_resent"): the restore need not wait for it any more.
    "items_resent": (F("node_id", "int", lo=0, hi=2**32),),
    # The disk tier (storage/tier.py, control/tiers.py). A node whose arena
    # is full asks which n items of a table to demote, copies them to disk,
    # and reports the moves (offsets with the top bit set are disk slots).
    "demote": (
        F("node_id", "int", lo=0, hi=2**32),
        F("table", "str", **_NAME),
        F("n", "int", lo=1, hi=MAX_ITEMS),
    ),
    "items_moved": (
        F("node_id", "int", lo=0, hi=2**32),
        F("table", "str", **_NAME),
        F("keys", "u64[]"),
        F("offsets", "u64[]"),
        F("generations", "u64[]"),
        F("new_offsets", "u64[]"),
        F("new_generations", "u64[]"),
    ),
    # A node's answer to a stage push: where in its staging area each item
    # now is, and a status per item (int32 as u32: 0, errno, or stale).
    "staged": (
        F("node_id", "int", lo=0, hi=2**32),
        F("request", "int", lo=1, hi=2**63 - 1),
        F("extents", "list", required=False, max_len=1 << 16),  # starts of the extents taken
        F("offsets", "u64[]", required=False),
        F("statuses", "u32[]", required=False),
        F("error", "str", required=False, max_len=4096),
        F("code", "str", required=False, max_len=64),  # the error's code (ERRORS)
    ),
    # A node whose arena has no room for an insert into a table: evict up
    # to n of that table's items stored on it, by the table's remover.
    "evict": (
        F("node_id", "int", lo=0, hi=2**32),
        F("table", "str", **_NAME),
        F("n", "int", lo=1, hi=MAX_ITEMS),
    ),
    # A node's answer to a retire push: the slots' headers are marked.
    "retired": (
        F("node_id", "int", lo=0, hi=2**32),
        F("request", "int", lo=1, hi=2**63 - 1),
    ),
    # write a checkpoint now (distore checkpoint)
    "checkpoint": (),
    # `previous`: this connection's writer whose keys ran out (its id is
    # replaced, not counted again against control.max_writer_ids)
    "register_writer": (F("previous", "int", required=False, lo=1, hi=2**64 - 1),),
    "create_table": (
        F("name", "str", **_NAME),
        F("capacity", "int", lo=1, hi=2**40),
        F("spec", "list", max_len=256),
        F("sampler", "dict", required=False, max_len=8),
        F("remover", "dict", required=False, max_len=8),
        F("rate_limiter", "dict", required=False, max_len=8),
        F("max_times_sampled", "int", required=False, lo=0, hi=2**31 - 1),
    ),
    "table_info": (F("name", "str", **_NAME),),
    "list_tables": (),
    "nodes": (),
    "sample": (
        F("table", "str", **_NAME),
        F("n", "int", lo=1, hi=MAX_SAMPLE),
        F("release", "list", required=False, max_len=1024),
        F("timeout", "float", required=False, lo=0, hi=86400),
        # n is sample_ahead batches of this many: the control plane may answer
        # with fewer whole batches (one, where nodes have disk tiers)
        F("batch", "int", required=False, lo=1, hi=MAX_SAMPLE),
    ),
    "release": (F("leases", "list", max_len=1 << 16),),
    "update_priorities": (
        F("table", "str", **_NAME),
        F("keys", "u64[]"),
        F("priorities", "f64[]"),
    ),
    "status": (),
    # storage node
    "insert": (  # a descriptor: the node pulls the items from the writer's staging buffer
        F("table", "str", **_NAME),
        F("slot_size", "int", lo=1, hi=1 << 34),
        F("item_bytes", "int", lo=1, hi=1 << 34),
        F("keys", "u64[]"),
        F("priorities", "f64[]"),
        F("offsets", "u64[]"),  # of each item in the staging buffer
        F("lengths", "u64[]"),  # of each item (= item_bytes)
        F("worker_address", "bytes", max_len=1 << 16),  # the writer's UCX worker
        F("rkey", "bytes", max_len=1 << 16),  # the staging buffer's packed remote key
        F("base", "int", lo=0, hi=2**64 - 1),  # the staging buffer's address
        F("size", "int", lo=1, hi=2**64 - 1),
        F("pid", "int", required=False, lo=1, hi=2**31),  # same-host writers
        F("host_id", "str", required=False, max_len=128),
        F("timeout", "float", required=False, lo=0, hi=86400),
        # The node id the writer sent it to: registered under that id only, so
        # a node the control plane dropped (the writer then resends elsewhere
        # and reuses the buffer) can never register it after re-joining.
        F("node_id", "int", required=False, lo=0, hi=2**63 - 1),
        # The node's epoch when the writer placed the batch (its `epoch` in
        # the node list): registered only if the node has not been
        # unresponsive since (the writer may have resent the batch elsewhere).
        F("epoch", "int", required=False, lo=0, hi=2**63 - 1),
        # same host: the ticket under which the writer handed the node the
        # buffer's sealed memfd (transport/local_map.py); the node copies from it
        F("staging", "bytes", required=False, max_len=16),
        # the items come as UCX active messages headed by this batch token,
        # to the node's insert_address (storage/pulls.py), not by a get
        F("am_token", "int", required=False, lo=1, hi=2**64 - 1),
    ),
    "free": (
        F("table", "str", **_NAME),
        F("offsets", "u64[]"),
    ),
    # control plane -> node: read a sample's cold items into the staging area
    "stage": (
        F("request", "int", lo=1, hi=2**63 - 1),
        F("table", "str", **_NAME),
        F("slot_size", "int", lo=1, hi=1 << 34),
        F("offsets", "u64[]"),
        F("keys", "u64[]"),
        F("generations", "u64[]"),
    ),
    # control plane -> node: evicted items still leased; mark their slots'
    # headers retired (reads then fail their check), answer with `retired`
    "retire": (
        F("request", "int", lo=1, hi=2**63 - 1),
        F("table", "str", **_NAME),
        F("offsets", "u64[]"),
        F("generations", "u64[]"),
    ),
    # control plane -> node: staged extents whose lease ended
    "unstage": (F("extents", "u64[]"),),
    "node_info": (),
}


def request(op: str, mid: int, **fields: Any) -> dict[str, Any]:
    """Build a request map (arrays given as numpy are turned into bytes)."""
    msg: dict[str, Any] = {"v": VERSION, "op": op, "id": mid}
    for k, v in fields.items():
        msg[k] = v.tobytes() if isinstance(v, np.ndarray) else v
    return msg


def validate_request(msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Check a request against its declaration; returns (op, fields).

    Array fields are returned as read-only numpy arrays of their dtype; all
    arrays of one message must have the same length.
    """
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not {VERSION}: upgrade the peer")
    op = msg.get("op")
    if not isinstance(op, str) or op not in MESSAGES:
        raise ProtocolError(f"unknown operation {op!r}")
    out: dict[str, Any] = {}
    n_items = None
    for f in MESSAGES[op]:
        if f.name not in msg:
            if f.required:
                raise ProtocolError(f"{op}: missing field {f.name!r}")
            continue
        v = msg[f.name]
        out[f.name] = v = check(op, f, v)
        if f.kind in ARRAY_DTYPES:
            if n_items is None:
                n_items = len(v)
            elif len(v) != n_items:
                raise ProtocolError(
                    f"{op}: array {f.name!r} has {len(v)} items, expected {n_items}")
    return op, out
