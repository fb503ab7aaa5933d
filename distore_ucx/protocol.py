"""Every control message, declared once: fields, types, limits, version.

Frames on the control channel (TCP) are an 8-byte header (body length,
metadata length; little-endian uint32), a msgpack map, and optionally a raw
binary payload, which is never copied into or out of msgpack (no message
declares one now: an insert is a descriptor, the node pulls the items over
UCX). A request is ``{"v": VERSION, "op": name, "id": n, ...fields}``;
its reply is ``{"id": n, "ok": True, ...}`` or ``{"id": n, "ok": False,
"error": code, "message": text}``, where code is one of ``ERRORS`` below.
A push (``id`` 0) gets no reply.
Arrays travel as raw little-endian bytes of a declared dtype. Encoding,
decoding and validation live here and nowhere else; the payload bytes of
items never pass through the control plane.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from . import errors

# 2: keys are writer_id << 24 | sequence with 40-bit writer ids (a writer
# takes a new id when its keys run out), nodes are live/unresponsive/gone
# with insert epochs, evicted leased slots are retired on their nodes, and
# servers greet with their role. A v1 peer would reuse keys: refused.
VERSION = 2
MAX_FRAME = 1 << 30  # 1 GiB: any one frame
MAX_NAME = 128
MAX_ITEMS = 1 << 24  # per message
MAX_SAMPLE = 1 << 16  # items in one sample request
AM_INSERT_ID = 0x4453  # the UCX active message id of insert messages ("DS")
HEADER = struct.Struct("<II")  # body length, metadata length
HEADER_SIZE = HEADER.size
PAYLOAD = "payload"  # the one field that travels raw, after the metadata


# Where a sampled item is, as the sample reply's "items" field carries it:
# one 32-byte record per item, little-endian.
ITEM_LOCATION = np.dtype(
    [("node", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("generation", "<u8"), ("key", "<u8")]
)


class ProtocolError(ValueError):
    """A frame or message is malformed; the connection that sent it is closed."""


@dataclass(frozen=True)
class F:
    """One field of a message: name, kind and bounds.

    kind: "int", "float", "str", "bytes", "bool", "list", "dict", or an
    array kind "u64[]", "u32[]", "f64[]" (raw bytes of that dtype).
    """

    name: str
    kind: str
    required: bool = True
    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None


_ARRAY_DTYPES = {"u64[]": np.uint64, "u32[]": np.uint32, "f64[]": np.float64}

_NAME = dict(max_len=MAX_NAME)

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


def encode(msg: dict[str, Any]) -> list:
    """One frame as a list of buffers: header, msgpack metadata, raw payload.

    A ``payload`` field (bytes or a contiguous array) is sent as is, after
    the metadata; the receiver finds it in the decoded message.
    """
    payload = msg.get(PAYLOAD)
    if payload is not None and not isinstance(payload, str):
        msg = {k: v for k, v in msg.items() if k != PAYLOAD}
        payload = memoryview(payload).cast("B")
    else:
        payload = None
    meta = msgpack.packb(msg, use_bin_type=True)
    n = len(meta) + (payload.nbytes if payload is not None else 0)
    if n > MAX_FRAME:
        raise ProtocolError(f"message of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    head = HEADER.pack(n, len(meta))
    return [head, meta] if payload is None else [head, meta, payload]


def read_header(header: bytes) -> tuple[int, int]:
    """(body length, metadata length) of a frame; validated."""
    n, meta = HEADER.unpack(header)
    if n == 0 or n > MAX_FRAME:
        raise ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
    if meta == 0 or meta > n:
        raise ProtocolError(f"metadata length {meta} outside 1..{n}")
    return n, meta


def decode(body: bytes, meta_len: int | None = None) -> dict[str, Any]:
    """Decode a frame body into a message map (not yet validated)."""
    meta_len = len(body) if meta_len is None else meta_len
    view = memoryview(body)
    try:
        msg = msgpack.unpackb(view[:meta_len], raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a map")
    mid = msg.get("id")
    if not isinstance(mid, int) or isinstance(mid, bool) or not 0 <= mid < 2**63:
        raise ProtocolError("message id missing or not a non-negative integer")
    if PAYLOAD in msg:
        raise ProtocolError("the payload travels after the metadata, not inside it")
    if meta_len < len(body):
        msg[PAYLOAD] = view[meta_len:]
    return msg


AUTH_CONTEXT = b"distore-ucx auth v1"


def auth_mac(token: bytes, nonce: bytes) -> bytes:
    """The answer to a server's challenge: HMAC-SHA256(token, context + nonce)."""
    return hmac.new(token, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def hello(nonce: bytes | None, role: str | None = None) -> dict[str, Any]:
    """The first frame a server sends: protocol version, what it is ("control
    plane", "storage node": a client at the wrong one says so) and, when it
    wants a token, the challenge nonce."""
    h: dict[str, Any] = {"v": VERSION, "nonce": nonce}
    if role is not None:
        h["role"] = role
    return {"id": 0, "hello": h}


def hello_role(msg: dict[str, Any]) -> str | None:
    """What a valid hello says its server is (None: it does not say)."""
    role = msg["hello"].get("role")
    return role if isinstance(role, str) else None


def check_hello(msg: dict[str, Any]) -> bytes | None:
    """Validate a server's hello; returns its nonce (None: no token needed)."""
    if not isinstance(msg, dict):
        raise ProtocolError("the connection closed before the server's greeting")
    h = msg.get("hello")
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise ProtocolError(f"unexpected greeting {msg!r}: not a distore-ucx v{VERSION} server")
    nonce = h.get("nonce")
    if nonce is not None and (not isinstance(nonce, bytes) or not 16 <= len(nonce) <= 64):
        raise ProtocolError("malformed challenge in the server's greeting")
    return nonce


def request(op: str, mid: int, **fields: Any) -> dict[str, Any]:
    """Build a request map (arrays given as numpy are turned into bytes)."""
    msg: dict[str, Any] = {"v": VERSION, "op": op, "id": mid}
    for k, v in fields.items():
        msg[k] = v.tobytes() if isinstance(v, np.ndarray) and k != PAYLOAD else v
    return msg


def reply(mid: int, **fields: Any) -> dict[str, Any]:
    """A success reply to request `mid`."""
    msg: dict[str, Any] = {"id": mid, "ok": True}
    for k, v in fields.items():
        msg[k] = v.tobytes() if isinstance(v, np.ndarray) else v
    return msg


# The error vocabulary: the code an error reply carries <-> the exception it
# is raised as on the other side. A class not listed travels as its nearest
# listed base class; anything else (a bug in the peer) as "internal", raised
# as RemoteError. Codes are part of the protocol: add, never rename.
ERRORS: dict[str, type[Exception]] = {
    "distore": errors.DistoreError,  # raised as such: no more precise class fits
    "config": errors.ConfigError,
    "invalid_request": errors.InvalidRequest,
    "table_not_found": errors.TableNotFound,
    "table_exists": errors.TableExists,
    "spec_mismatch": errors.SpecMismatch,
    "storage_full": errors.StorageFull,
    "staging_full": errors.StagingFull,
    "limit_exceeded": errors.LimitExceeded,
    "timeout": errors.Timeout,
    "rate_limiter_timeout": errors.RateLimiterTimeout,
    "no_data": errors.NoData,
    "connection_failed": errors.ConnectionFailed,
    "authentication_failed": errors.AuthenticationFailed,
    "node_gone": errors.NodeGone,
    "checkpoint": errors.CheckpointError,
    "closed": errors.Closed,
    "table_core": errors.TableCoreError,
    "ucx": errors.UcxError,
    "unreachable": errors.UnreachableError,
    "transfer_timeout": errors.TransferTimeout,
    "internal": errors.RemoteError,
}
_CODES: dict[type, str] = {cls: code for code, cls in ERRORS.items()}
_CODES[ProtocolError] = "invalid_request"  # a malformed message is an invalid request


def error_code(exc: BaseException) -> str:
    """The code `exc` travels as: its class's, or its nearest listed base's."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return "internal"


def error_reply(mid: int, exc: BaseException) -> dict[str, Any]:
    """An error reply carrying the exception's code and message."""
    return {"id": mid, "ok": False, "error": error_code(exc), "message": str(exc)}


def remote_error(msg: dict[str, Any], peer: str) -> Exception:
    """The exception an error reply stands for, its message naming the peer.

    An unknown code (a newer peer) becomes RemoteError with that `kind`.
    """
    code = msg.get("error")
    text = f"{msg.get('message', 'unknown error')} (from {peer})"
    cls = ERRORS.get(code) if isinstance(code, str) else None
    if cls is None or cls is errors.RemoteError:
        return errors.RemoteError(text, str(code))
    return cls(text)


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
        out[f.name] = v = _check(op, f, v)
        if f.kind in _ARRAY_DTYPES:
            if n_items is None:
                n_items = len(v)
            elif len(v) != n_items:
                raise ProtocolError(
                    f"{op}: array {f.name!r} has {len(v)} items, expected {n_items}")
    return op, out


def _check(op: str, f: F, v: Any) -> Any:
    where = f"{op}.{f.name}"
    if f.kind in _ARRAY_DTYPES:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes of {f.kind}")
        dt = np.dtype(_ARRAY_DTYPES[f.kind])
        if len(v) % dt.itemsize:
            raise ProtocolError(f"{where}: {len(v)} bytes is not a whole number of {f.kind}")
        if len(v) // dt.itemsize > MAX_ITEMS:
            raise ProtocolError(f"{where}: more than {MAX_ITEMS} items")
        arr = np.frombuffer(v, dtype=dt.newbyteorder("<"))
        if f.kind == "f64[]" and not np.isfinite(arr).all():
            raise ProtocolError(f"{where}: values must be finite")
        return arr
    types = {
        "int": int,
        "float": (int, float),
        "str": str,
        "bytes": (bytes, memoryview),
        "bool": bool,
        "list": list,
        "dict": dict,
    }[f.kind]
    if not isinstance(v, types) or (f.kind in ("int", "float") and isinstance(v, bool)):
        raise ProtocolError(f"{where}: expected {f.kind}, got {type(v).__name__}")
    if f.lo is not None and v < f.lo or f.hi is not None and v > f.hi:
        raise ProtocolError(f"{where}: {v} outside [{f.lo}, {f.hi}]")
    if f.max_len is not None and len(v) > f.max_len:
        raise ProtocolError(f"{where}: longer than {f.max_len}")
    if f.kind == "str" and f.max_len == MAX_NAME and not _valid_name(v):
        raise ProtocolError(f"{where}: {v!r} is not a valid name (1-128 printable characters)")
    return v


def _valid_name(s: str) -> bool:
    return 0 < len(s) <= MAX_NAME and s.isprintable()
