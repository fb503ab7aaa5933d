"""Every control message, declared once: fields, types, limits, version.

Frames on the control channel (TCP) are an 8-byte header (body length,
metadata length; little-endian uint32) and a msgpack map (an insert is a
descriptor: the node pulls the items over UCX). A request is ``{"v":
VERSION, "op": name, "id": n, ...fields}``; its reply is ``{"id": n, "ok":
True, ...}`` or ``{"id": n, "ok": False, "error": code, "message": text}``,
where code is one of ``ERRORS``. A push (``id`` 0) gets no reply.
Arrays travel as raw little-endian bytes of a declared dtype. Encoding,
decoding and validation live here and nowhere else; the payload bytes of
items never pass through the control plane.

The package's modules, one concept each: `framing` (frames and the
version), `fields` (how a field is declared and checked, and the fields
several messages share), `requests` (every request's fields), `replies`
(every reply, typed, `parse_reply`, and `check_reply` for hot paths),
`records` (how a typed reply is declared, parsed and quickly checked),
`error_codes` (the error vocabulary), `greeting` (a server's hello and the
answer to its challenge). Import their names from here.
"""

from __future__ import annotations

from .error_codes import (
    ERRORS,
    ProtocolError,
    batch_errors,
    error_code,
    error_reply,
    remote_error,
)
from .fields import (
    ITEM_LOCATION,
    MAX_BATCHES,
    MAX_ITEMS,
    MAX_NAME,
    MAX_NODE_ID,
    MAX_SAMPLE,
    STEP_FIELDS,
    STEP_LAST,
    STEP_PAD,
    F,
    steps_of,
)
from .framing import (
    AM_AUTH_ACK_ID,
    AM_INSERT_AUTH_ID,
    AM_INSERT_ID,
    AM_SAMPLE_AUTH_ID,
    AM_SAMPLE_DATA_ID,
    AM_SAMPLE_REQUEST_ID,
    HEADER,
    HEADER_SIZE,
    MAX_FRAME,
    VERSION,
    decode,
    encode,
    read_header,
)
from .greeting import AUTH_CONTEXT, auth_mac, check_hello, hello, hello_role
from .records import Record
from .replies import (
    REPLIES,
    CheckpointReply,
    CreateTableReply,
    DemoteReply,
    DeregisterNodeReply,
    EmptyReply,
    EvictReply,
    HeartbeatReply,
    InsertReply,
    ItemsAddedReply,
    ItemsMovedReply,
    ItemsRestoredReply,
    NodeDescription,
    NodeInfoReply,
    NodesReply,
    NodeStateReply,
    RegisterNodeReply,
    RegisterWriterReply,
    ReleaseReply,
    SampleReply,
    StatusReply,
    TableInfo,
    TableInfoReply,
    TablesReply,
    UpdatePrioritiesReply,
    check_reply,
    parse_reply,
    reply,
)
from .requests import MESSAGES, request, validate_request

__all__ = [
    "AM_AUTH_ACK_ID",
    "AM_INSERT_AUTH_ID",
    "AM_INSERT_ID",
    "AM_SAMPLE_AUTH_ID",
    "AM_SAMPLE_DATA_ID",
    "AM_SAMPLE_REQUEST_ID",
    "AUTH_CONTEXT",
    "CheckpointReply",
    "CreateTableReply",
    "DemoteReply",
    "DeregisterNodeReply",
    "ERRORS",
    "EmptyReply",
    "EvictReply",
    "F",
    "HEADER",
    "HEADER_SIZE",
    "HeartbeatReply",
    "ITEM_LOCATION",
    "InsertReply",
    "ItemsAddedReply",
    "ItemsMovedReply",
    "ItemsRestoredReply",
    "MAX_FRAME",
    "MAX_BATCHES",
    "MAX_ITEMS",
    "MAX_NAME",
    "MAX_NODE_ID",
    "MAX_SAMPLE",
    "MESSAGES",
    "NodeDescription",
    "NodeInfoReply",
    "NodeStateReply",
    "NodesReply",
    "ProtocolError",
    "REPLIES",
    "Record",
    "RegisterNodeReply",
    "RegisterWriterReply",
    "ReleaseReply",
    "STEP_FIELDS",
    "STEP_LAST",
    "STEP_PAD",
    "SampleReply",
    "StatusReply",
    "TableInfo",
    "TableInfoReply",
    "TablesReply",
    "UpdatePrioritiesReply",
    "VERSION",
    "auth_mac",
    "check_hello",
    "batch_errors",
    "check_reply",
    "decode",
    "encode",
    "error_code",
    "error_reply",
    "hello",
    "hello_role",
    "parse_reply",
    "read_header",
    "remote_error",
    "reply",
    "request",
    "validate_request",
    "steps_of",
]
