"""The control channel: framed msgpack requests over TCP.

Control traffic (placement, locations, leases, inserts) is small next to the
sample path and must work whatever UCX transports are loaded: UCX cannot
make sockaddr (listener) connections when only shared memory is enabled, so
this channel is plain TCP, and UCX carries the one-sided reads.

This module names the channel's parts, each in a module of its own:

- `RpcClient` (transport/blocking_client.py): a blocking connection for user
  threads (writers, learners, the CLI), with reconnects;
- `serve` (transport/server.py): an asyncio server whose handler answers
  each request, with what one connection may hold in flight;
- `Peer` (transport/peer.py): one accepted connection, with its typed
  per-connection state;
- admission (transport/admission.py): what connections may cost a server,
  by host and in all, under the open-file limit;
- `AsyncClient` (transport/async_client.py): the asyncio side used by
  storage nodes towards the control plane; it also receives the control
  plane's pushes on the same socket.

All authenticate through transport/auth.py and read frames through
transport/frames.py, which bounds a frame's length before reading it.
"""

from __future__ import annotations

from .address import parse_address
from .async_client import AsyncClient
from .blocking_client import PROBE_AFTER, RpcClient, interrupted
from .frames import FrameTooLarge, read_frame
from .peer import Peer
from .server import Handler, serve

__all__ = [
    "PROBE_AFTER",
    "AsyncClient",
    "FrameTooLarge",
    "Handler",
    "Peer",
    "RpcClient",
    "interrupted",
    "parse_address",
    "read_frame",
    "serve",
]
