"""Frames on the control channel: header, msgpack metadata, raw payload.

A frame is an 8-byte header (body length, metadata length; little-endian
uint32), a msgpack map, and optionally a raw binary payload, which is never
copied into or out of msgpack.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .error_codes import ProtocolError

__all__ = [
    "AM_INSERT_ID",
    "HEADER",
    "HEADER_SIZE",
    "MAX_FRAME",
    "PAYLOAD",
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
HEADER = struct.Struct("<II")  # body length, metadata length
HEADER_SIZE = HEADER.size
PAYLOAD = "payload"  # the one field that travels raw, after the metadata


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
