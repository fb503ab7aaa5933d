"""Request routing: which handler answers each operation of the control
channel, and how the control plane's server runs them.

Every handler is an object with `op_<name>(peer, fields)` methods (plain or
async); `ControlDispatcher` (a transport/dispatch.py `Dispatcher`) maps each
operation name to the one method that serves it, and `serve` starts the
control channel's server with it. The server answers one connection's
requests in order except those in CONCURRENT and ORDERED (transport/rpc.py
`serve`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..config import ControlConfig, read_token
from ..transport.dispatch import Dispatcher
from ..transport.rpc import Peer
from ..transport.rpc import serve as rpc_serve

# Answered when done while the connection goes on: may wait on a rate limiter.
CONCURRENT = frozenset({"items_added"})
# Handled concurrently, answered in order: a learner keeps two samples in
# flight while they draw cold items, so the second one's node reads while
# the first one's does.
ORDERED = frozenset({"sample"})


class ControlDispatcher(Dispatcher):
    """Operation name -> the control plane's handler method that answers it."""

    def __init__(self, *handlers: object):
        super().__init__(*handlers, server="the control plane",
                         peers="a distore-ucx client or node")

    async def serve(self, config: ControlConfig,
                    on_close: Callable[[Peer], None]) -> asyncio.base_events.Server:
        """Start serving the control channel at config.host:config.port."""
        return await rpc_serve(
            config.host, config.port, self.handle, on_close,
            concurrent=CONCURRENT, ordered=ORDERED,
            token=read_token(config.token_file),
            max_frame=config.max_frame, max_pending=config.max_pending,
            role="control plane",
        )
