"""Frames on the control channel: a header, then a msgpack map.

A frame is an 8-byte header (body length, metadata length; little-endian
uint32) and a body whose first `metadata length` bytes are the msgpack map.
Every frame sent has the two lengths equal: the header leaves room for a
raw payload after the map, which no message carries; a receiver ignores
bytes there.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .error_codes import ProtocolError

__all__ = [
    "AM_INSERT_ID",
    "AM_SAMPLE_DATA_ID",
    "AM_SAMPLE_REQUEST_ID",
    "HEADER",
    "HEADER_SIZE",
    "MAX_FRAME",
    "VERSION",
    "decode",
    "encode",
    "read_header",
]

# 2: keys are writer_id << 24 | sequence with 40-bit writer ids (a writer
# takes a new id when its keys run out), nodes are live/unresponsive/gone
# with insert epochs, evicted leased slots are retired on their nodes, and
# servers greet with their role. A v1 peer would reuse keys: refused.
VERSION = 2
MAX_FRAME = 1 << 30  # 1 GiB: any one frame
AM_INSERT_ID = 0x4453  # the UCX active message id of insert messages ("DS")
# Samples by active message (native/am_sample.h): a learner's request to a
# node, and the node's data messages back to the learner.
AM_SAMPLE_REQUEST_ID = 0x4454
AM_SAMPLE_DATA_ID = 0x4455
# A connection's authentication to a node's insert or sample listener, and
# the node's answer (native/am_connections.h).
AM_INSERT_AUTH_ID = 0x4456
AM_SAMPLE_AUTH_ID = 0x4457
AM_AUTH_ACK_ID = 0x4458
HEADER = struct.Struct("<II")  # body length, metadata length
HEADER_SIZE = HEADER.size


def encode(msg: dict[str, Any]) -> list:
    """One frame as a list of buffers: the header and the msgpack metadata."""
    meta = msgpack.packb(msg, use_bin_type=True)
    n = len(meta)
    if n > MAX_FRAME:
        raise ProtocolError(f"message of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    return [HEADER.pack(n, n), meta]


def read_header(header: bytes) -> tuple[int, int]:
    """(body length, metadata length) of a frame; validated."""
    n, meta = HEADER.unpack(header)
    if n == 0 or n > MAX_FRAME:
        raise ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
    if meta == 0 or meta > n:
        raise ProtocolError(f"metadata length {meta} outside 1..{n}")
    return n, meta


def decode(body: bytes, meta_len: int | None = None) -> dict[str, Any]:
    """Decode a frame body into a message map (not yet validated); bytes after
    its first `meta_len` are not read."""
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
    return msg
