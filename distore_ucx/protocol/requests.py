"""Every request, declared once: its fields, their kinds and bounds, and
the check a server runs on each request before answering it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .error_codes import ProtocolError
from .fields import (
    AM_KEY,
    AM_SAMPLE,
    ARENA_ID,
    ARRAY_DTYPES,
    BASE,
    BATCHES,
    BEAT_SECRET,
    CAPACITY,
    DISK_SIZE,
    EPISODES,
    EPOCH,
    GENERATIONS,
    HOST_ID,
    INSERT_PORT,
    INSERT_RUN_BYTES,
    ITEM_BYTES,
    KEYS,
    LOCAL_SOCKET,
    MAX_ITEMS,
    MAX_SAMPLE,
    MAX_TIMES_SAMPLED,
    NAME,
    NODE_ID,
    OFFSETS,
    PAGE_KIND,
    PID,
    POSITIONS,
    PRIORITIES,
    REQUEST,
    RKEY,
    SAMPLE_PORT,
    SELECTOR,
    SIZE,
    SLICE_LEN,
    SLICE_PAD,
    SLICE_PERIOD,
    SLOT_SIZE,
    SPEC,
    STEP_FLAGS,
    STORE_ID,
    TABLE,
    TIMEOUT,
    TIMEOUTS,
    USED_BYTES,
    WORKER_ADDRESS,
    WRITER_ID,
    F,
    check,
    refused_array,
    refused_scalar,
)
from .framing import VERSION

__all__ = [
    "MESSAGES",
    "request",
    "validate_request",
]

# op -> fields of the request (replies: protocol/replies.py).
MESSAGES: dict[str, tuple[F, ...]] = {
    # every server: the answer to the hello's challenge (HMAC-SHA256)
    "auth": (F("mac", "bytes", max_len=64),),
    # control plane
    "register_node": (
        NAME,
        F("host", "str", max_len=255),
        F("port", "int", lo=0, hi=65535),
        WORKER_ADDRESS,
        RKEY,
        BASE.named("arena_base"),
        SIZE.named("arena_size"),
        PID,
        HOST_ID.optional(),
        # same-host mapping: the arena's identity, page size, and the Unix
        # socket that hands its sealed memfd to learners (transport/local_map.py)
        ARENA_ID.optional(),
        PAGE_KIND.optional(),
        LOCAL_SOCKET.optional(),
        # the id a node had before it lost the control plane (it re-joins),
        # and the store it joined then (a restoring control plane of another
        # store refuses it rather than mix their items)
        NODE_ID.optional(),
        STORE_ID.optional(),
        # bytes of the node's disk tier (storage/tier.py; absent: none)
        DISK_SIZE.optional(),
        # its insert listener, where writers send inserts as active messages
        # (absent: the node reads writers' staging buffers with gets only)
        INSERT_PORT.optional(),
        # ...which takes runs of items up to this many bytes in one message
        # (absent: one item per message)
        INSERT_RUN_BYTES.optional(),
        # it serves samples by active message on its worker (absent: learners
        # read it with one-sided gets only)
        AM_SAMPLE.optional(),
        # ...through the UCX listener on this port of `host` (absent: learners
        # read it with one-sided gets)
        SAMPLE_PORT.optional(),
        # the key its listeners check connections and sample requests with
        # (absent: it has no listener)
        AM_KEY.optional(),
        # what its heartbeats will carry (absent: only its own connection may beat)
        BEAT_SECRET.optional(),
    ),
    "heartbeat": (NODE_ID, USED_BYTES, BEAT_SECRET.optional()),
    # A node shutting down (SIGTERM): its items leave sampling at once.
    "deregister_node": (NODE_ID,),
    "items_added": (
        NODE_ID,
        TABLE,
        KEYS,
        OFFSETS,
        GENERATIONS,
        PRIORITIES,
        USED_BYTES.optional(),
        TIMEOUT.optional(),
        EPOCH.optional(),  # as the insert's
        EPISODES.optional(),  # steps of episodes: as the insert's
        POSITIONS.optional(),
        STEP_FLAGS.optional(),
        # Several inserts registered in one request (storage/registrations.py):
        # the items of each, in order (absent: one insert), and the seconds
        # each may wait for the rate limiter (absent: `timeout` for all).
        BATCHES.optional(),
        TIMEOUTS.optional(),
    ),
    # A re-joined node's items, when register_node's reply asked for them
    # (the control plane is restoring from a checkpoint).
    "items_restored": (
        NODE_ID,
        TABLE,
        SLOT_SIZE,
        KEYS,
        OFFSETS,
        GENERATIONS,
        PRIORITIES,
        EPISODES.optional(),  # steps of episodes: as their inserts gave them
        POSITIONS.optional(),
        STEP_FLAGS.optional(),
    ),
    # A re-joined node has sent every item it holds (when register_node's
    # reply has "items_resent"): the restore need not wait for it any more.
    "items_resent": (NODE_ID,),
    # The disk tier (storage/tier.py, control/tiers.py). A node whose arena
    # is full asks which n items of a table to demote, copies them to disk,
    # and reports the moves (offsets with the top bit set are disk slots).
    "demote": (
        NODE_ID,
        TABLE,
        F("n", "int", lo=1, hi=MAX_ITEMS),
    ),
    "items_moved": (
        NODE_ID,
        TABLE,
        KEYS,
        OFFSETS,
        GENERATIONS,
        OFFSETS.named("new_offsets"),
        GENERATIONS.named("new_generations"),
    ),
    # A node's answer to a stage push: where in its staging area each item
    # now is, and a status per item (int32 as u32: 0, errno, or stale).
    "staged": (
        NODE_ID,
        REQUEST,
        F("extents", "list", required=False, max_len=1 << 16),  # starts of the extents taken
        OFFSETS.optional(),
        F("statuses", "u32[]", required=False),
        F("error", "str", required=False, max_len=4096),
        F("code", "str", required=False, max_len=64),  # the error's code (ERRORS)
    ),
    # A node whose arena has no room for an insert into a table: evict up
    # to n of that table's items stored on it, by the table's remover.
    "evict": (
        NODE_ID,
        TABLE,
        F("n", "int", lo=1, hi=MAX_ITEMS),
    ),
    # A node's answer to a retire push: the slots' headers are marked.
    "retired": (NODE_ID, REQUEST),
    # write a checkpoint now (distore checkpoint)
    "checkpoint": (),
    # `previous`: this connection's writer whose keys ran out (its id is
    # replaced, not counted again against control.max_writer_ids)
    "register_writer": (WRITER_ID.named("previous").optional(),),
    "create_table": (
        NAME,
        CAPACITY,
        SPEC,
        SELECTOR.optional(),
        SELECTOR.named("remover").optional(),
        SELECTOR.named("rate_limiter").optional(),
        MAX_TIMES_SAMPLED.optional(),
        # a table of episodes' steps, sampled as slices (docs/semantics.md)
        SLICE_LEN.optional(),
        SLICE_PERIOD.optional(),
        SLICE_PAD.optional(),
    ),
    "table_info": (NAME,),
    "list_tables": (),
    "nodes": (),
    # One node's state, for a writer waiting on it (cheaper than status).
    "node_state": (NODE_ID,),
    "sample": (
        TABLE,
        F("n", "int", lo=1, hi=MAX_SAMPLE),
        F("release", "list", required=False, max_len=1024),
        TIMEOUT.optional(),
        # n is sample_ahead batches of this many: the control plane may answer
        # with fewer whole batches (one, where nodes have disk tiers)
        F("batch", "int", required=False, lo=1, hi=MAX_SAMPLE),
    ),
    "release": (F("leases", "list", max_len=1 << 16),),
    "update_priorities": (
        TABLE,
        KEYS,
        PRIORITIES,
    ),
    "status": (),
    # storage node
    "insert": (  # a descriptor: the node pulls the items from the writer's staging buffer
        TABLE,
        SLOT_SIZE,
        ITEM_BYTES,
        KEYS,
        PRIORITIES,
        OFFSETS,  # of each item in the staging buffer
        F("lengths", "u64[]"),  # of each item (= item_bytes)
        WORKER_ADDRESS,  # the writer's UCX worker
        RKEY,  # the staging buffer's packed remote key
        BASE,  # the staging buffer's address
        SIZE,
        PID.optional(),  # same-host writers
        HOST_ID.optional(),
        TIMEOUT.optional(),
        # The node id the writer sent it to: registered under that id only, so
        # a node the control plane dropped (the writer then resends elsewhere
        # and reuses the buffer) can never register it after re-joining.
        NODE_ID.optional(),
        # The node's epoch when the writer placed the batch (its `epoch` in
        # the node list): registered only if the node has not been
        # unresponsive since (the writer may have resent the batch elsewhere).
        EPOCH.optional(),
        # same host: the ticket under which the writer handed the node the
        # buffer's sealed memfd (transport/local_map.py); the node copies from it
        F("staging", "bytes", required=False, max_len=16),
        # the items come as UCX active messages headed by this batch token,
        # over a connection to the node's insert_port (storage/pulls.py), not by a get
        F("am_token", "int", required=False, lo=1, hi=2**64 - 1),
        # steps of episodes (a table of slices): each item's episode,
        # position and flags, passed on to the control plane's items_added
        EPISODES.optional(),
        POSITIONS.optional(),
        STEP_FLAGS.optional(),
    ),
    "free": (TABLE, OFFSETS),
    # control plane -> node: read a sample's cold items into the staging area
    "stage": (
        REQUEST,
        TABLE,
        SLOT_SIZE,
        OFFSETS,
        KEYS,
        GENERATIONS,
    ),
    # control plane -> node: evicted items still leased; mark their slots'
    # headers retired (reads then fail their check), answer with `retired`
    "retire": (
        REQUEST,
        TABLE,
        OFFSETS,
        GENERATIONS,
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
    out = _FAST[op](msg)
    # Refused by the made check, or of a kind only the loop takes (a
    # subclass of a field's type): the loop gives the field's error, or the fields.
    return op, out if out is not None else _checked(op, msg)


def _checked(op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """Request `op`'s fields of `msg`, checked against its declaration one
    by one; ProtocolError naming the first field that does not hold."""
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
    return out


FINITE_LOOP = 64  # float arrays up to this long are checked item by item (no ufunc set-up)


def _finite(values: np.ndarray) -> bool:
    """Whether every value of a float array is finite."""
    if len(values) <= FINITE_LOOP:
        return all(map(math.isfinite, values.tolist()))
    return bool(np.isfinite(values).all())


def _fast_check(op: str, fields: tuple[F, ...]):
    """The fields check of request `op`, written out as code from its
    declaration (as dataclasses writes `__init__`; records.py does the same
    for replies): returns the fields as validate_request's loop does, or
    None for anything that loop must look at (to raise its error). The loop
    over declarations cost a storage node 9 us an insert under fan-in."""
    scope: dict[str, Any] = {"ABSENT": object(), "frombuffer": np.frombuffer, "finite": _finite}
    name = "check_" + "".join(c if c.isalnum() else "_" for c in op)
    lines = [f"def {name}(msg):", "    get = msg.get", "    out = {}", "    n = -1"]
    for f in fields:
        lines += [f"    v = get({f.name!r}, ABSENT)", "    if v is ABSENT:",
                  "        return None" if f.required else "        pass"]
        if f.kind in ARRAY_DTYPES:
            dt = np.dtype(ARRAY_DTYPES[f.kind]).newbyteorder("<")
            scope[f"D_{f.name}"] = dt
            size = dt.itemsize
            lines += [f"    elif {refused_array(f)}:",
                      "        return None",
                      "    else:",
                      f"        n = len(v) // {size}",
                      f"        out[{f.name!r}] = v = frombuffer(v, D_{f.name})"]
            if f.kind == "f64[]":
                lines += ["        if not finite(v):", "            return None"]
            continue
        test = refused_scalar(f, scope)
        lines += [f"    elif {test}:", "        return None",
                  "    else:", f"        out[{f.name!r}] = v"]
    lines.append("    return out")
    exec("\n".join(lines), scope)
    return scope[name]


_FAST = {op: _fast_check(op, fields) for op, fields in MESSAGES.items()}
