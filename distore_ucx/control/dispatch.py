"""Request routing: which handler answers each operation of the control
channel, and how the control plane's server runs them.

Every handler is an object with `op_<name>(peer, fields)` methods (plain or
async); `Dispatcher` maps each operation name to the one method that serves
it, and `serve` starts the control channel's server with it. The server
answers one connection's requests in order except those in CONCURRENT and
ORDERED (transport/rpc.py `serve`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..config import ControlConfig, read_token
from ..errors import InvalidRequest
from ..transport.rpc import Peer
from ..transport.rpc import serve as rpc_serve

# Answered when done while the connection goes on: may wait on a rate limiter.
CONCURRENT = frozenset({"items_added"})
# Handled concurrently, answered in order: a learner keeps two samples in
# flight while they draw cold items, so the second one's node reads while
# the first one's does.
ORDERED = frozenset({"sample"})


class Dispatcher:
    """Operation name -> the handler method that answers it."""

    def __init__(self, *handlers: object):
        self.routes: dict[str, Callable] = {}
        for handler in handlers:
            for name in dir(handler):
                if not name.startswith("op_"):
                    continue
                op = name[len("op_"):]
                if op in self.routes:
                    raise ValueError(f"two handlers serve {op!r}: {self.routes[op]!r} and "
                                     f"{getattr(handler, name)!r}")
                self.routes[op] = getattr(handler, name)

    async def handle(self, peer: Peer, op: str, f: dict):
        """Answer one request (the dispatcher given to rpc.serve)."""
        method = self.routes.get(op)
        if method is None:
            raise InvalidRequest(f"the control plane does not serve {op!r}: is the peer a "
                                 "distore-ucx client or node of the same version?")
        result = method(peer, f)
        return await result if asyncio.iscoroutine(result) else result

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
