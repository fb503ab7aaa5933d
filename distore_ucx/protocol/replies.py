"""Every reply, declared once: its fields, their kinds and bounds, and its
typed form.

A server builds a reply's map with `reply(mid, **fields)`. A reader turns
the map it got into the typed reply with `parse_reply(op, msg)`: the
fields are checked as a request's are (protocol/fields.py: one bound per
field, shared with the requests that carry it), arrays come back as numpy
arrays, and the nodes and tables a reply lists as `NodeDescription` and
`TableInfo` records. Fields not declared (a newer peer's) are ignored, as
in requests; an error reply raises the exception it stands for.

Where a reply is read once per sampled batch or per insert, `check_reply`
checks the map and hands it back as it is: building the typed form would
cost more than those paths can spend (Record.accepts says what it checks).

Each reply is a record (protocol/records.py): a frozen dataclass whose
fields are declared with `wire`, naming each field's kind and bounds.
`REPLIES` maps each operation to its reply's class. Pushes (id 0: free,
stage, retire, unstage, staged, retired) get no reply and have none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .error_codes import ProtocolError, remote_error
from .fields import (
    AM_CAP,
    AM_SAMPLE,
    ARENA_ID,
    BASE,
    CAPACITY,
    DISK_SIZE,
    EPOCH,
    GENERATIONS,
    INSERT_PORT,
    INSERT_RUN_BYTES,
    KEYS,
    LEASE,
    LISTED_HOST_ID,
    LOCAL_SOCKET,
    MAX_BATCHES,
    MAX_TIMES_SAMPLED,
    NAME,
    NODE_ID,
    NODE_STATE,
    OFFSETS,
    PAGE_KIND,
    PID,
    POSITIONS,
    RKEY,
    SAMPLE_PORT,
    SELECTOR,
    SIZE,
    SLICE_LEN,
    SLICE_PAD,
    SLICE_PERIOD,
    SPEC,
    STEP_FLAGS,
    STORE_ID,
    TABLE_ITEM_BYTES,
    TABLE_SLOT_SIZE,
    USED_BYTES,
    WORKER_ADDRESS,
    WRITER_ID,
    F,
)
from .records import Record, record, wire

__all__ = [
    "REPLIES",
    "CheckpointReply",
    "CreateTableReply",
    "DemoteReply",
    "DeregisterNodeReply",
    "EmptyReply",
    "EvictReply",
    "HeartbeatReply",
    "InsertReply",
    "ItemsAddedReply",
    "ItemsMovedReply",
    "ItemsRestoredReply",
    "NodeDescription",
    "NodeInfoReply",
    "NodesReply",
    "RegisterNodeReply",
    "RegisterWriterReply",
    "ReleaseReply",
    "SampleReply",
    "StatusReply",
    "TableInfo",
    "TableInfoReply",
    "TablesReply",
    "UpdatePrioritiesReply",
    "check_reply",
    "parse_reply",
    "reply",
]

# op -> the class of its reply (filled in by `declare` below).
REPLIES: dict[str, type[Record]] = {}


def reply(mid: int, **fields: Any) -> dict[str, Any]:
    """A success reply to request `mid`."""
    msg: dict[str, Any] = {"id": mid, "ok": True}
    for k, v in fields.items():
        msg[k] = v.tobytes() if isinstance(v, np.ndarray) else v
    return msg


def parse_reply(op: str, msg: Mapping[str, Any], peer: str = "the peer") -> Record:
    """The typed reply to an `op` request, checked against its declaration.

    `msg` is the reply's map (its "id" and "ok" are not fields). An error
    reply raises the exception it stands for, naming `peer`; a malformed
    one raises ProtocolError naming the field and `peer`.

    >>> parse_reply("release", {"id": 4, "ok": True, "refused": 0}).refused
    0
    """
    cls = REPLIES.get(op)
    if cls is None:
        raise ProtocolError(f"no reply is declared for {op!r}: not an operation, or a push")
    if isinstance(msg, Mapping) and msg.get("ok") is False:
        raise remote_error(dict(msg), peer)
    try:
        return cls.parse(msg, f"reply to {op}")
    except ProtocolError as exc:
        raise ProtocolError(f"{exc} (from {peer})") from None


def check_reply(op: str, msg: dict[str, Any], peer: str = "the peer") -> dict[str, Any]:
    """`msg`, the reply to an `op` request, checked and handed back as it is
    (not as its typed form): for readers on a hot path. What the quick
    check (Record.accepts) does not take, `parse_reply` checks, raising
    what it raises.

    >>> check_reply("release", {"id": 4, "ok": True, "refused": 0})["refused"]
    0
    """
    cls = REPLIES.get(op)
    if cls is None or not cls.accepts(msg):
        parse_reply(op, msg, peer)
    return msg


def declare(what: str, *ops: str) -> Callable[[type], type]:
    """A record (protocol/records.py) that is the reply to each of `ops`."""

    def make(cls: type) -> type:
        cls = record(what)(cls)
        for op in ops:
            REPLIES[op] = cls
        return cls

    return make


COUNT = F("", "int", lo=0)  # how many of something
SECONDS = F("", "float", lo=0)


@declare("an empty reply", "auth", "items_resent")
class EmptyReply(Record):
    """A reply that says only that the request was done."""


# -- the control plane, to storage nodes ----------------------------------
@declare("reply to register_node", "register_node")
class RegisterNodeReply(Record):
    """The node's id, how often to beat, and whether to re-send its items."""

    node_id: int = wire(NODE_ID)
    heartbeat_interval: float = wire(SECONDS)
    restore: bool = wire("bool")  # re-send the items held (else discard them)
    store_id: str = wire(STORE_ID)
    items_resent: bool = wire("bool")  # send items_resent once they are re-sent


@declare("reply to heartbeat", "heartbeat")
class HeartbeatReply(Record):
    """What the control plane holds the node as now."""

    state: str = wire(NODE_STATE)


@declare("reply to deregister_node", "deregister_node")
class DeregisterNodeReply(Record):
    """Slots of the node learners hold leases on (reads maybe in flight)."""

    leased: int = wire(COUNT)


@declare("reply to items_added", "items_added")
class ItemsAddedReply(Record):
    """Items the inserts evicted; offsets of keys the table held already."""

    evicted: int = wire(COUNT)
    duplicate_offsets: np.ndarray | None = wire(OFFSETS, optional=True)
    # A request of several inserts: [index, error code, message] of each
    # insert that was refused (the others are registered); see batch_errors.
    errors: list | None = wire("list", optional=True, max_len=MAX_BATCHES)


@declare("reply to items_restored", "items_restored")
class ItemsRestoredReply(Record):
    """What became of a batch of re-sent items."""

    restored: int = wire(COUNT)  # the checkpoint's records, found on the node
    adopted: int = wire(COUNT)  # newer than the checkpoint
    discarded: int = wire(COUNT)  # the node frees their slots


@declare("reply to demote", "demote")
class DemoteReply(Record):
    """The items to move to disk."""

    keys: np.ndarray = wire(KEYS)
    offsets: np.ndarray = wire(OFFSETS)
    generations: np.ndarray = wire(GENERATIONS)


@declare("reply to items_moved", "items_moved")
class ItemsMovedReply(Record):
    """Which moves were taken (1) or not (0: evicted or sampled meanwhile)."""

    taken: np.ndarray = wire("u8[]")


@declare("reply to evict", "evict")
class EvictReply(Record):
    """Slots to free, and the table's items on the node under lease."""

    offsets: np.ndarray = wire(OFFSETS)
    leased: int = wire(COUNT)


# -- the records replies list ----------------------------------------------
@record("a node")
class NodeDescription(Record):
    """A storage node as clients see it (nodes, status)."""

    node_id: int = wire(NODE_ID)
    name: str = wire(NAME)
    address: str = wire("str", max_len=261)  # its control port: host:port
    arena_base: int = wire(BASE)
    arena_size: int = wire(SIZE)
    used_bytes: int = wire(USED_BYTES)
    alive: bool = wire("bool")  # a member: its items are in the tables
    state: str = wire(NODE_STATE)
    epoch: int = wire(EPOCH)  # grows each time it becomes unresponsive
    heartbeat_gap_max: float = wire(SECONDS)
    pid: int = wire(PID)
    host_id: str = wire(LISTED_HOST_ID)  # "": the node sent none
    arena_id: int = wire(ARENA_ID)
    page_kind: str = wire(PAGE_KIND)
    local_socket: str = wire(LOCAL_SOCKET)
    disk_size: int = wire(DISK_SIZE)
    # how to read from it; in `nodes`, not in `status`
    worker_address: bytes | None = wire(WORKER_ADDRESS, optional=True)
    rkey: bytes | None = wire(RKEY, optional=True)
    insert_port: int | None = wire(INSERT_PORT, optional=True)  # inserts by active message
    insert_run_bytes: int | None = wire(INSERT_RUN_BYTES, optional=True)  # ...in runs
    am_sample: bool | None = wire(AM_SAMPLE, optional=True)  # samples by active message
    sample_port: int | None = wire(SAMPLE_PORT, optional=True)  # ...through its listener
    am_cap: bytes | None = wire(AM_CAP, optional=True)  # what its listeners ask of a connection


@record("a table")
class TableInfo(Record):
    """A table's definition and counts (list_tables, status; table_info and
    create_table add to it)."""

    name: str = wire(NAME)
    capacity: int = wire(CAPACITY)
    size: int = wire(COUNT)
    spec: list = wire(SPEC)
    item_bytes: int = wire(TABLE_ITEM_BYTES)
    slot_size: int = wire(TABLE_SLOT_SIZE)
    sampler: dict = wire(SELECTOR)
    remover: dict = wire(SELECTOR)
    rate_limiter: dict = wire(SELECTOR)
    rate_limiter_state: dict = wire("dict")  # its counters and thresholds
    max_times_sampled: int = wire(MAX_TIMES_SAMPLED)
    slice_len: int | None = wire(SLICE_LEN, optional=True)  # a table of slices
    slice_period: int | None = wire(SLICE_PERIOD, optional=True)
    slice_pad: str | None = wire(SLICE_PAD, optional=True)  # "none" left out
    valid_starts: int | None = wire(COUNT, optional=True)  # ...its slices' starts now
    inserts: int = wire(COUNT)
    samples: int = wire(COUNT)
    deletes: int = wire(COUNT)
    leased: int = wire(COUNT)
    awaiting_restore: int = wire(COUNT)


@declare("reply to checkpoint", "checkpoint")
class CheckpointReply(Record):
    """A checkpoint written: where, how much, how long, and why."""

    path: str = wire("str", max_len=4096)
    tables: int = wire(COUNT)
    items: int = wire(COUNT)
    bytes: int = wire(COUNT)
    seconds: float = wire(SECONDS)
    snapshot_seconds: float = wire(SECONDS)
    created: float = wire(SECONDS)  # the Unix time it was taken at
    why: str = wire("str", max_len=256)


# -- the control plane, to clients ---------------------------------------
@declare("reply to register_writer", "register_writer")
class RegisterWriterReply(Record):
    """A new writer's id; its keys are writer_id << key_bits | sequence."""

    writer_id: int = wire(WRITER_ID)
    key_bits: int = wire("int", lo=1, hi=63)


@declare("reply to create_table", "create_table")
class CreateTableReply(TableInfo):
    """The table created (or the same one that existed)."""

    # the capacity the live nodes cannot hold (a new table only)
    warnings: list | None = wire("list", optional=True)


@declare("reply to table_info", "table_info")
class TableInfoReply(TableInfo):
    """A table, with where its items are."""

    cold: int = wire(COUNT)  # items on disk tiers now
    fits: int = wire(COUNT)  # items the live nodes can hold beside the other tables'
    # its capacity the live nodes cannot hold now (a node was lost)
    warnings: list | None = wire("list", optional=True)


@declare("reply to list_tables", "list_tables")
class TablesReply(Record):
    """Every table."""

    tables: list[TableInfo] = wire("list", of=TableInfo)


@declare("reply to node_state", "node_state")
class NodeStateReply(Record):
    """A node's state: live, unresponsive, gone, or unknown (not registered
    with this control plane: a restarted one it has not re-joined yet)."""

    state: str = wire(NODE_STATE)


@declare("reply to nodes", "nodes")
class NodesReply(Record):
    """The live storage nodes, with how to read from them."""

    nodes: list[NodeDescription] = wire("list", of=NodeDescription)


@declare("reply to sample", "sample")
class SampleReply(Record):
    """Sampled items under one lease: where each is, and its probability."""

    lease: int = wire(LEASE)
    refused: int = wire(COUNT)  # ids in `release` of another connection's leases
    table_size: int = wire(COUNT)  # the size the probabilities refer to
    items: np.ndarray = wire("locations")  # ITEM_LOCATION records
    probabilities: np.ndarray = wire("f64[]")
    min_probability: float = wire("float", lo=0, hi=1)  # the smallest any item had
    staged: int = wire(COUNT)  # cold items read from disk for it
    # The lease expires lease_timeout s after it was granted, which was
    # `held` s after the request arrived (waiting for data): no batch of
    # the reply is read or handed out once it may have expired.
    lease_timeout: float = wire("float", lo=0, hi=1e9)
    held: float = wire("float", lo=0, hi=1e9)
    # A table of slices: each row's position in its episode and its flags
    # (bit 0: it ends the episode); `items` are the slices' steps in order.
    positions: np.ndarray | None = wire(POSITIONS, optional=True)
    step_flags: np.ndarray | None = wire(STEP_FLAGS, optional=True)


@declare("reply to release", "release")
class ReleaseReply(Record):
    """Lease ids that named another connection's lease (refused)."""

    refused: int = wire(COUNT)


@declare("reply to update_priorities", "update_priorities")
class UpdatePrioritiesReply(Record):
    """Keys whose priority was set, and keys the table does not hold."""

    updated: int = wire(COUNT)
    missing: int = wire(COUNT)


@declare("reply to status", "status")
class StatusReply(Record):
    """The store at a glance: every node, every table, the leases."""

    nodes: list[NodeDescription] = wire("list", of=NodeDescription)  # gone ones too
    tables: list[TableInfo] = wire("list", of=TableInfo)
    leases: int = wire(COUNT)
    leases_refused: int = wire(COUNT)
    incarnation: int = wire(COUNT)
    checkpoint: CheckpointReply | None = wire("dict", nullable=True, of=CheckpointReply)
    restoring_s: float | None = wire(SECONDS, nullable=True)  # left of a restore's grace
    # tables whose capacity the live nodes cannot hold now (a node was lost)
    warnings: list | None = wire("list", optional=True)


# -- storage nodes --------------------------------------------------------
@declare("reply to insert", "insert")
class InsertReply(Record):
    """An insert stored and registered."""

    n: int = wire(COUNT)
    evicted: int = wire(COUNT)  # items it evicted from the table
    via: str = wire("str", max_len=256)  # how the node read the items


@declare("reply to node_info", "node_info")
class NodeInfoReply(Record):
    """A storage node's own view of itself; the disk fields with a disk tier."""

    node_id: int | None = wire(NODE_ID, nullable=True)  # None until it joins
    name: str = wire(NAME)
    arena_size: int = wire(SIZE)
    used_bytes: int = wire(USED_BYTES)
    inserted: int = wire(COUNT)
    disk_size: int | None = wire(DISK_SIZE, optional=True)
    disk_used_bytes: int | None = wire(USED_BYTES, optional=True)
    demoted: int | None = wire(COUNT, optional=True)
    disk_write_errors: int | None = wire(COUNT, optional=True)
    disk_read_errors: int | None = wire(COUNT, optional=True)
    # read calls of cold reads: one per run of slots that follow each other
    # on disk (a cold slice's steps), or per hugepage chunk of a run
    disk_reads: int | None = wire(COUNT, optional=True)
    staging_used_bytes: int | None = wire(USED_BYTES, optional=True)
