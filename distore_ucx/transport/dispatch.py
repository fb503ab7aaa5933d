"""Request routing for a server of the control channel (transport/server.py).

A server's handlers are objects with `op_<name>(peer, fields)` methods,
plain or async, each given what it uses when it is made; `Dispatcher` maps
each operation name to the one method that serves it, refusing two
handlers for one operation, and answers a request by calling it. The
control plane (control/dispatch.py) and the storage node (storage/node.py)
route their requests this way, and the node the control plane's pushes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import InvalidRequest
from .peer import Peer


class Dispatcher:
    """Operation name -> the handler method that answers it.

    `server` and `peers` name, in the refusal of an operation nobody
    serves, who refused it and who is expected to ask.

    >>> dispatch = Dispatcher(inserts, info, server="storage node a",
    ...                       peers="a distore-ucx client")
    >>> await dispatch.handle(peer, "insert", fields)
    """

    def __init__(self, *handlers: object, server: str, peers: str):
        self.server, self.peers = server, peers
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

    async def handle(self, peer: Peer | None, op: str, f: dict):
        """Answer one request (the handler given to transport/server.py's serve)."""
        method = self.routes.get(op)
        if method is None:
            raise InvalidRequest(f"{self.server} does not serve {op!r}: is the peer "
                                 f"{self.peers} of the same version?")
        result = method(peer, f)
        return await result if asyncio.iscoroutine(result) else result
