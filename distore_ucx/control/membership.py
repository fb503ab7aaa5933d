"""Storage-node membership: registration, heartbeats, and declaring death.

A node is dead when its control connection closes (a killed process's
socket is reset at once) or when it misses heartbeats for
`heartbeat_timeout` seconds (a hung node or a cut link). Node ids are never
reused, not even by a restarted control plane (they come from IdState): a
node that lost the control plane re-registers with its former id when that
id is free, so learners' handles on it stay valid; a restarted node
registers anew.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Node:
    """What the control plane knows of one storage node."""

    node_id: int
    name: str
    host: str
    port: int
    worker_address: bytes
    rkey: bytes
    arena_base: int
    arena_size: int
    pid: int
    host_id: str = ""
    arena_id: int = 0
    page_kind: str = ""
    local_socket: str = ""
    disk_size: int = 0  # bytes of the node's disk tier (0: none)
    insert_address: bytes = b""  # UCX worker taking inserts as active messages (b"": none)
    peer: Any = field(repr=False, default=None)
    last_seen: float = 0.0
    used_bytes: int = 0
    alive: bool = True

    def describe(self, with_keys: bool = True) -> dict:
        """The node as clients see it (with UCX address and remote key)."""
        d = {
            "node_id": self.node_id,
            "name": self.name,
            "address": f"{self.host}:{self.port}",
            "arena_base": self.arena_base,
            "arena_size": self.arena_size,
            "used_bytes": self.used_bytes,
            "alive": self.alive,
            "pid": self.pid,
            "host_id": self.host_id,
            "arena_id": self.arena_id,
            "page_kind": self.page_kind,
            "local_socket": self.local_socket,
            "disk_size": self.disk_size,
        }
        if with_keys:
            d["worker_address"] = self.worker_address
            d["rkey"] = self.rkey
            if self.insert_address:
                d["insert_address"] = self.insert_address
        return d


class Membership:
    """Live and dead storage nodes."""

    def __init__(self, heartbeat_timeout: float, ids):
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes: dict[int, Node] = {}
        self._ids = ids  # checkpoint.IdState

    def register(self, peer, fields: dict, wanted: int | None = None) -> Node:
        """Add a node from its register_node message; `wanted` is the id it had
        before losing the control plane (granted unless this run has seen it)."""
        node_id = self._ids.node_id(wanted, lambda i: i in self.nodes)
        node = Node(node_id=node_id, peer=peer, last_seen=time.monotonic(), **fields)
        self.nodes[node.node_id] = node
        peer.state["node_id"] = node.node_id
        log.info("node %d (%s) %s: %d-byte arena at %s:%d", node.node_id, node.name,
                 "re-joined" if wanted == node_id else "joined", node.arena_size, node.host,
                 node.port)
        return node

    def heartbeat(self, node_id: int, used_bytes: int) -> None:
        """Record a heartbeat (ignored for unknown or dead nodes)."""
        node = self.nodes.get(node_id)
        if node is not None and node.alive:
            node.last_seen = time.monotonic()
            node.used_bytes = used_bytes

    def credit(self, seconds: float) -> None:
        """Add `seconds` to every live node's last heartbeat: time during which
        the control plane itself did not run (its heartbeats sat unread in
        the sockets) is not silence of the nodes."""
        for node in self.nodes.values():
            if node.alive:
                node.last_seen += seconds

    def silent(self, now: float | None = None) -> list[Node]:
        """Live nodes that missed heartbeats for longer than the timeout."""
        now = now or time.monotonic()
        return [
            n for n in self.nodes.values() if n.alive and now - n.last_seen > self.heartbeat_timeout
        ]

    def alive(self) -> list[Node]:
        """Nodes currently alive."""
        return [n for n in self.nodes.values() if n.alive]

    def is_alive(self, node_id: int) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.alive
