"""How a message's fields are declared and checked: kinds, bounds, limits.

`F` declares one field; `check` checks a value against it. The fields that
several messages carry (a node id, a table name, a slot size, ...) are
declared here once, with their bounds, and every message that carries one
names it (`NODE_ID`, `NODE_ID.optional()`, `NAME.named("table")`), so a
field never has two bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .error_codes import ProtocolError

__all__ = [
    "ARENA_ID",
    "ARRAY_DTYPES",
    "BASE",
    "BATCHES",
    "CAPACITY",
    "DISK_SIZE",
    "EPOCH",
    "F",
    "GENERATIONS",
    "HOST_ID",
    "INSERT_PORT",
    "INSERT_RUN_BYTES",
    "ITEM_BYTES",
    "ITEM_LOCATION",
    "KEYS",
    "LEASE",
    "LISTED_HOST_ID",
    "LOCAL_SOCKET",
    "MAX_BATCHES",
    "MAX_ITEMS",
    "MAX_NAME",
    "MAX_NODE_ID",
    "MAX_SAMPLE",
    "MAX_TIMES_SAMPLED",
    "NAME",
    "NODE_ID",
    "NODE_STATE",
    "OFFSETS",
    "PAGE_KIND",
    "PID",
    "PRIORITIES",
    "REQUEST",
    "RKEY",
    "SAMPLE_PORT",
    "AM_KEY",
    "AM_CAP",
    "BEAT_SECRET",
    "SLICE_LEN",
    "SLICE_PAD",
    "SLICE_PERIOD",
    "EPISODES",
    "POSITIONS",
    "STEP_FLAGS",
    "STEP_FIELDS",
    "STEP_LAST",
    "STEP_PAD",
    "SELECTOR",
    "SIZE",
    "SLOT_SIZE",
    "SPEC",
    "STORE_ID",
    "TABLE",
    "TABLE_ITEM_BYTES",
    "TABLE_SLOT_SIZE",
    "TIMEOUT",
    "TIMEOUTS",
    "USED_BYTES",
    "WORKER_ADDRESS",
    "WRITER_ID",
    "EXACT_TYPES",
    "check",
    "refused_array",
    "refused_scalar",
    "steps_of",
]

MAX_NAME = 128
MAX_ITEMS = 1 << 24  # per message
MAX_SAMPLE = 1 << 16  # items in one sample request
MAX_NODE_ID = 2**32 - 1  # node ids are uint32 in ITEM_LOCATION; the first is 1


# Where a sampled item is, as the sample reply's "items" field carries it:
# one 32-byte record per item, little-endian.
ITEM_LOCATION = np.dtype(
    [("node", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("generation", "<u8"), ("key", "<u8")]
)


@dataclass(frozen=True)
class F:
    """One field of a message: name, kind and bounds.

    kind: "int", "float", "str", "bytes", "bool", "list", "dict", or an
    array kind "u64[]", "u32[]", "u8[]", "f64[]" (raw bytes of that dtype)
    or "locations" (raw ITEM_LOCATION records). In replies a field may
    also be `nullable` (None is a value), and a list or dict may hold
    records of a declared reply type (`of`, protocol/replies.py). A
    `printable` str is a name: not empty, printable characters only.
    """

    name: str
    kind: str
    required: bool = True
    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None
    nullable: bool = False
    of: type | None = None
    printable: bool = False  # a str of 1 to max_len printable characters (a name)

    def optional(self) -> F:
        """This field, where a message may leave it out."""
        return replace(self, required=False)

    def named(self, name: str) -> F:
        """A field of another name that holds the same kind of value, bounded alike."""
        return replace(self, name=name)


ARRAY_DTYPES = {"u64[]": np.uint64, "u32[]": np.uint32, "u8[]": np.uint8, "f64[]": np.float64,
                "locations": ITEM_LOCATION}

# -- fields several messages carry, each declared once ------------------------
# Names: of tables, and of storage nodes (1-128 printable characters).
NAME = F("name", "str", max_len=MAX_NAME, printable=True)
TABLE = NAME.named("table")
NODE_ID = F("node_id", "int", lo=1, hi=MAX_NODE_ID)
STORE_ID = F("store_id", "str", max_len=64)
# A process's host, pid and network namespace (transport/runtime.py:
# host_id()). A request carries one where the sender could tell it (else it
# leaves the field out); the node list says "" for a node that sent none.
HOST_ID = F("host_id", "str", max_len=128, printable=True)
LISTED_HOST_ID = replace(HOST_ID, printable=False)
PID = F("pid", "int", lo=1, hi=2**31)
# A UCX worker's address or a packed remote key.
WORKER_ADDRESS = F("worker_address", "bytes", max_len=1 << 16)
RKEY = WORKER_ADDRESS.named("rkey")
# A region of another process's memory: its address and size.
BASE = F("base", "int", lo=0, hi=2**64 - 1)
SIZE = F("size", "int", lo=1, hi=2**64 - 1)
USED_BYTES = F("used_bytes", "int", lo=0)
DISK_SIZE = F("disk_size", "int", lo=0, hi=2**62)  # bytes of a node's disk tier
ARENA_ID = F("arena_id", "int", lo=0, hi=2**63 - 1)
PAGE_KIND = F("page_kind", "str", max_len=16)
LOCAL_SOCKET = F("local_socket", "str", max_len=100)
# A node that serves samples by UCX active message (native/am_sample.h):
# where UCX emulates RMA; absent, learners read it with one-sided gets.
AM_SAMPLE = F("am_sample", "bool")
# The port of a node's insert listener, on its host: writers connect there to
# send inserts as UCX active messages (storage/puller.py); absent, they don't.
INSERT_PORT = F("insert_port", "int", lo=1, hi=65535)
# The largest run of items (bytes) one insert message to that listener may
# carry (native/am_insert.h); absent, one item per message.
INSERT_RUN_BYTES = F("insert_run_bytes", "int", lo=1, hi=1 << 30)
# The port of its UCX listener for those samples (storage/sample_server.py),
# on the host of its address; absent (an older node), learners read it with
# one-sided gets.
SAMPLE_PORT = F("sample_port", "int", lo=1, hi=65535)
# The key of a node's active-message listeners (native/am_grant.h): the
# node sends it to the control plane only (register_node), which signs
# sample replies' items with it and gives clients the connection
# capability derived from it (a node descriptor's `am_cap`), never the key.
AM_KEY = F("am_key", "bytes", max_len=16)
AM_CAP = F("am_cap", "bytes", max_len=16)
# A node's heartbeat secret: its heartbeats (on a connection of their own)
# carry the one it registered with, so no other client can beat for it.
BEAT_SECRET = F("beat_secret", "bytes", max_len=32)
# A table of episodes' steps: slices of SLICE_LEN consecutive steps, starts
# every SLICE_PERIOD steps (table_definition.py).
SLICE_LEN = F("slice_len", "int", lo=0, hi=(1 << 20) - 1)
SLICE_PERIOD = F("slice_period", "int", lo=1, hi=(1 << 20) - 1)
# Which short slices such a table samples (table_definition.SLICE_PADS).
SLICE_PAD = F("slice_pad", "str", max_len=16)
# Per step of such a table: its episode (the key of the episode's first
# step), its position in the episode, and its flags (STEP_LAST: it ends the
# episode, done or truncated; in a sample reply's rows also STEP_PAD: the
# row repeats the step before it, padding a short slice).
EPISODES = F("episodes", "u64[]")
POSITIONS = F("positions", "u32[]")
STEP_FLAGS = F("step_flags", "u8[]")
STEP_LAST = 1
STEP_PAD = 2
STEP_FIELDS = (EPISODES.name, POSITIONS.name, STEP_FLAGS.name)


def steps_of(f: dict) -> tuple | None:
    """A message's steps of episodes (inserts, re-sent items): (episodes,
    positions, flags), flags 0 where the message has none; None for items."""
    if EPISODES.name not in f or POSITIONS.name not in f:
        return None
    flags = f.get(STEP_FLAGS.name)
    if flags is None:
        flags = np.zeros(len(f[POSITIONS.name]), np.uint8)
    return f[EPISODES.name], f[POSITIONS.name], flags
# The slots and items one message moves (an insert, a stage, a re-sent batch).
SLOT_SIZE = F("slot_size", "int", lo=1, hi=1 << 34)
ITEM_BYTES = SLOT_SIZE.named("item_bytes")
# A table's, as its spec makes them (the table records replies carry): a
# table may be declared with items no insert can carry (create_table takes
# any spec that one arena can hold), and its info must still be readable.
TABLE_SLOT_SIZE = F("slot_size", "int", lo=1, hi=2**64 - 1)
TABLE_ITEM_BYTES = TABLE_SLOT_SIZE.named("item_bytes")
TIMEOUT = F("timeout", "float", lo=0, hi=86400)  # seconds a request may wait
# Inserts registered in one items_added (storage/registrations.py): at most
# this many, their sizes and their timeouts (lists: per insert, not per item).
MAX_BATCHES = 4096
BATCHES = F("batches", "list", max_len=MAX_BATCHES)
TIMEOUTS = F("timeouts", "list", max_len=MAX_BATCHES)
EPOCH = F("epoch", "int", lo=0, hi=2**63 - 1)  # a node's, as its node list entry says
REQUEST = F("request", "int", lo=1, hi=2**63 - 1)  # a stage or retire push's number
WRITER_ID = F("writer_id", "int", lo=1, hi=2**64 - 1)
LEASE = F("lease", "int", lo=1, hi=2**62)  # a lease's id (control/leases.py)
NODE_STATE = F("state", "str", max_len=16)  # "live", "unresponsive" or "gone"
# A table's definition, as create_table sends it and table_info returns it.
CAPACITY = F("capacity", "int", lo=1, hi=2**40)
SPEC = F("spec", "list", max_len=256)
SELECTOR = F("sampler", "dict", max_len=8)
MAX_TIMES_SAMPLED = F("max_times_sampled", "int", lo=0, hi=2**31 - 1)
# Per-item arrays: all arrays of one message have the same length.
KEYS = F("keys", "u64[]")
OFFSETS = F("offsets", "u64[]")
GENERATIONS = F("generations", "u64[]")
PRIORITIES = F("priorities", "f64[]")


# Python types each scalar kind accepts, and each array kind's little-endian dtype.
_TYPES = {"int": int, "float": (int, float), "str": str, "bytes": (bytes, memoryview),
          "bool": bool, "list": list, "dict": dict}
_WIRE_DTYPES = {kind: np.dtype(dt).newbyteorder("<") for kind, dt in ARRAY_DTYPES.items()}


def check(op: str, f: F, v: Any) -> Any:
    """`v` as field `f` of message `op` holds it (arrays as numpy); ProtocolError if invalid.
    (Every request's every field passes here: the message names only on error.)"""
    kind = f.kind
    dt = _WIRE_DTYPES.get(kind)
    if dt is not None:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{op}.{f.name}: expected bytes of {kind}")
        if len(v) % dt.itemsize:
            raise ProtocolError(f"{op}.{f.name}: {len(v)} bytes is not a whole number of {kind}")
        if len(v) // dt.itemsize > MAX_ITEMS:
            raise ProtocolError(f"{op}.{f.name}: more than {MAX_ITEMS} items")
        arr = np.frombuffer(v, dtype=dt)
        if kind == "f64[]" and not np.isfinite(arr).all():
            raise ProtocolError(f"{op}.{f.name}: values must be finite")
        return arr
    if not isinstance(v, _TYPES[kind]) or (kind in ("int", "float") and isinstance(v, bool)):
        raise ProtocolError(f"{op}.{f.name}: expected {kind}, got {type(v).__name__}")
    # `not >=`: NaN is outside every bound
    if f.lo is not None and not v >= f.lo or f.hi is not None and not v <= f.hi:
        raise ProtocolError(f"{op}.{f.name}: {v} outside [{f.lo}, {f.hi}]")
    if f.max_len is not None and len(v) > f.max_len:
        raise ProtocolError(f"{op}.{f.name}: longer than {f.max_len}")
    if f.printable and not (v and v.isprintable()):
        raise ProtocolError(
            f"{op}.{f.name}: {v!r} is not a valid name (1-{f.max_len} printable characters)")
    return v


# A kind's values as msgpack decodes them: the checks written out as code
# (requests' made checks, replies' quick check) take these types only;
# `check` takes subclasses too, and tells those apart.
EXACT_TYPES = {"int": (int,), "float": (float, int), "str": (str,), "bytes": (bytes,),
               "bool": (bool,), "list": (list,), "dict": (dict,)}


def refused_scalar(f: F, scope: dict[str, Any]) -> str:
    """A Python expression, true when `v` is not a value field `f` (a scalar
    kind) holds: exact type, bounds, length, printable. For code made from
    declarations; the bounds it reads are put in `scope`."""
    types = EXACT_TYPES[f.kind]
    test = (f"type(v) is not {types[0].__name__}" if len(types) == 1
            else f"type(v) not in ({', '.join(t.__name__ for t in types)})")
    for bound, cmp in ((f.lo, ">="), (f.hi, "<=")):
        if bound is not None:  # `not >=`: NaN is outside every bound
            name = f"B{len(scope)}"
            scope[name] = bound
            test += f" or not v {cmp} {name}"
    if f.max_len is not None:
        test += f" or len(v) > {f.max_len}"
    if f.printable:
        test += " or not v or not v.isprintable()"
    return test


def refused_array(f: F) -> str:
    """A Python expression, true when `v` is not the raw bytes of array field
    `f` (whole items, at most MAX_ITEMS, as many as `n` when n >= 0: the
    items of the message's arrays so far). For code made from declarations."""
    size = np.dtype(ARRAY_DTYPES[f.kind]).itemsize
    return (f"type(v) is not bytes or len(v) % {size} or len(v) > {size * MAX_ITEMS}"
            f" or n >= 0 and len(v) != {size} * n")

