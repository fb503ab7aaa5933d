"""A writer's connections to storage nodes, and the control plane's word on a node.

Each staging buffer has its own connection to each node, so that batches in
flight wait on a rate limiter side by side: the first buffer's are made with
the writer (writer.py), the others at first use. Connections are keyed by node
id, address and buffer: a control plane that restarted afresh may give a
known address another id, or a known id another node. A node that cannot be
reached is given up on as soon as the control plane no longer lists it as
live (or after the writer's timeout); the caller then places the batch on
another node. Thread safety: none (a writer is used by one thread).
"""

from __future__ import annotations

import logging
import time

from ...errors import AuthenticationFailed, ConnectionFailed, Timeout
from ...protocol import parse_reply
from ...transport import rpc

log = logging.getLogger(__name__)

# Seconds a node has to greet a new connection before the writer asks the
# control plane whether it is still live (a stopped one never greets), and
# to take a staging buffer before it reads batches another way.
CONNECT_TIMEOUT = 2.0


class Unreachable(Exception):
    """Internal: no connection to a node (logged already); `gone`: the
    control plane says it left, so the writer forgets it."""

    def __init__(self, node_id: int, gone: bool):
        super().__init__(f"storage node {node_id} unreachable")
        self.node_id, self.gone = node_id, gone


def _until_serving(conn: rpc.RpcClient) -> None:
    """One round trip on a new connection before it carries a batch, so
    that the node reads it as it reads the writer's older ones. Batches in
    flight to a node go over one connection per staging buffer and are
    registered in the order the node reads them (docs/semantics.md,
    "Insertion order"); a connection the node has just authenticated is read
    a few event-loop turns later than one it was already reading, so
    without this the first batch of a new buffer could be registered after
    the next batch on an older one (seen on a loaded host). Closes `conn`
    and raises as a connect does when the node does not answer."""
    try:
        conn.call("node_info", reply_timeout=CONNECT_TIMEOUT)
    except BaseException:
        conn.close()
        raise


def node_state(client, node_id: int) -> str:
    """The control plane's word on a node: live, unresponsive or gone
    ("live" when it is away, or does not know the id yet: a restarted
    control plane the node has not re-joined)."""
    try:
        state = parse_reply("node_state", client.call("node_state", node_id=node_id)).state
    except ConnectionFailed:
        return "live"
    return "live" if state == "unknown" else state


class Connections:
    """The writer's connections, one per (node id, address, staging buffer),
    and what each connection's node was handed of that buffer."""

    def __init__(self, client):
        self._client = client
        self._conns: dict[tuple[int, str, int], rpc.RpcClient] = {}
        # connection -> the ticket of the staging buffer handed over it
        # (client/writer/send.py); a new connection claims its buffer anew.
        self.handed: dict[tuple[int, str, int], bytes] = {}

    def get(self, node: dict, buffer: int, timeout: float, within: float | None = None,
            then: str = "trying another") -> rpc.RpcClient:
        """The connection to `node` for staging buffer `buffer`, made if need
        be (waiting up to `within` s, default `timeout`, for a busy node; its
        replies then wait up to `timeout`); raises Unreachable, logged with
        what the writer does `then`."""
        key = (node["node_id"], node["address"], buffer)
        conn = self._conns.get(key)
        if conn is None:
            conn = self._connect(node, timeout, timeout if within is None else within, then)
            self._conns[key] = conn
        return conn

    def _connect(self, node: dict, timeout: float, within: float, then: str) -> rpc.RpcClient:
        """A connection to `node` whose replies wait up to `timeout`;
        Unreachable (logged) once the control plane no longer lists it as
        live, or after `within`. A busy node accepts or greets late (its
        listen queue full: the connect itself times out), and is waited for;
        a stopped one accepts (the kernel does) but never greets, and a dead
        one refuses: both are given up on as soon as the control plane says so."""
        node_id = node["node_id"]
        deadline = time.monotonic() + within
        delay = 0.05
        while True:
            try:
                conn = rpc.RpcClient(node["address"], CONNECT_TIMEOUT,
                                     name=f"storage node {node['name']}", token=self._client.token)
                _until_serving(conn)
                conn.timeout = timeout
                return conn
            except AuthenticationFailed as exc:
                log.warning("storage node %d refused this writer (%s); %s", node_id, exc, then)
                raise Unreachable(node_id, gone=False) from None
            except (ConnectionFailed, Timeout) as exc:
                failure = exc
            state = node_state(self._client, node_id)
            if state != "live" or time.monotonic() >= deadline:
                log.warning("storage node %d unreachable (%s; it is %s); %s",
                            node_id, failure, state, then)
                raise Unreachable(node_id, gone=state == "gone") from None
            if isinstance(failure, ConnectionFailed):  # refused or reset: not a spin
                time.sleep(delay)
                delay = min(2 * delay, 0.5)

    def drop(self, node_id: int) -> None:
        """Close every connection to `node_id`."""
        for key in [k for k in self._conns if k[0] == node_id]:
            self._conns.pop(key).close()
            self.handed.pop(key, None)  # a new connection claims its buffer anew

    def close(self) -> None:
        """Close every connection (the writer is closed)."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
