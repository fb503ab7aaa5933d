"""Storage-node membership: registration, heartbeats, and declaring death.

A node is in one of three states:

- LIVE: it heartbeats; writers place inserts there, its items are sampled.
- UNRESPONSIVE: no heartbeat for `heartbeat_timeout` seconds (a stopped or
  hung process, a cut link, or a host too busy to run it). Clients route
  around it at once (it is not listed for placement, its items are left
  out of sample replies), but its items stay in the tables: a heartbeat
  within `unresponsive_grace` seconds makes it LIVE again, items and id
  unchanged. Each time it becomes unresponsive its `epoch` grows, so that
  inserts placed before then (which writers resent elsewhere) are refused.
- GONE: its control connection closed (a killed process's socket is reset
  at once), it left, or it stayed unresponsive past the grace. Only then
  do its items leave the tables.

Each node sends the key of its active-message listeners (`am_key`,
native/am_grant.h): the control plane keeps it, gives clients only the
connection capability derived from it (`am_cap` in node descriptors), and
signs each sampled item's location with it (`sign`), which the node checks
before it sends a byte. A node's heartbeats, on a connection of their own,
carry the secret it registered with (`beat_secret`): a heartbeat for a node
from any other connection without it is refused.

Node ids are never
reused, not even by a restarted control plane (they come from IdState): a
node that lost the control plane re-registers with its former id when that
id is free, so learners' handles on it stay valid; a restarted node
registers anew.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._tables import am_connect_cap, am_sign
from ..errors import InvalidRequest

log = logging.getLogger(__name__)

LIVE, UNRESPONSIVE, GONE = "live", "unresponsive", "gone"


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
    insert_port: int = 0  # its insert listener: inserts by active message (0: none)
    insert_run_bytes: int = 0  # the largest run of items one such message may carry
    am_sample: bool = False  # serves samples by active message (native/am_sample.h)
    sample_port: int = 0  # ...through its UCX listener on `host` (0: none, an older node)
    am_key: bytes = field(repr=False, default=b"")  # its listeners' key (never sent on)
    beat_secret: bytes = field(repr=False, default=b"")  # what its heartbeats carry
    peer: Any = field(repr=False, default=None)
    last_seen: float = 0.0
    used_bytes: int = 0
    state: str = LIVE
    epoch: int = 0  # grows each time the node becomes unresponsive
    since: float = 0.0  # when it became unresponsive (monotonic)
    gap_max: float = 0.0  # longest time between two heartbeats (s; control-plane stalls excluded)
    beat: float = 0.0  # when its last heartbeat came (monotonic; for gap_max)

    @property
    def alive(self) -> bool:
        """Still a member: its items are in the tables (LIVE or UNRESPONSIVE)."""
        return self.state != GONE

    @property
    def live(self) -> bool:
        """Heartbeating: inserts may be placed there, its items are sampled."""
        return self.state == LIVE

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
            "state": self.state,
            "epoch": self.epoch,
            "heartbeat_gap_max": round(self.gap_max, 3),
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
            if self.insert_port:
                d["insert_port"] = self.insert_port
                if self.insert_run_bytes:
                    d["insert_run_bytes"] = self.insert_run_bytes
            if self.am_sample:
                d["am_sample"] = True
            if self.sample_port:
                d["sample_port"] = self.sample_port
            if self.am_key:
                d["am_cap"] = am_connect_cap(self.am_key)
        return d


class Membership:
    """Live, unresponsive and gone storage nodes."""

    def __init__(self, heartbeat_timeout: float, ids, grace: float = 60.0):
        self.heartbeat_timeout = heartbeat_timeout
        self.grace = grace  # s an unresponsive node keeps its items
        self.nodes: dict[int, Node] = {}
        self._ids = ids  # checkpoint.IdState
        # Node id -> its listeners' key (zeros: none), for signing samples.
        self.am_keys = np.zeros((1, 16), np.uint8)

    def register(self, peer, fields: dict, wanted: int | None = None) -> Node:
        """Add a node from its register_node message; `wanted` is the id it had
        before losing the control plane (granted unless this run has seen it)."""
        node_id = self._ids.node_id(wanted, lambda i: i in self.nodes)
        node = Node(node_id=node_id, peer=peer, last_seen=time.monotonic(), **fields)
        self.nodes[node.node_id] = node
        if node_id >= len(self.am_keys):
            grown = np.zeros((max(node_id + 1, 2 * len(self.am_keys)), 16), np.uint8)
            grown[:len(self.am_keys)] = self.am_keys
            self.am_keys = grown
        self.am_keys[node_id] = np.frombuffer(node.am_key.ljust(16, b"\0"), np.uint8)
        peer.state["node_id"] = node.node_id
        log.info("node %d (%s) %s: %d-byte arena at %s:%d", node.node_id, node.name,
                 "re-joined" if wanted == node_id else "joined", node.arena_size, node.host,
                 node.port)
        return node

    def sign(self, items: np.ndarray, slot_size: int) -> np.ndarray:
        """Sampled items' locations (protocol.ITEM_LOCATION) with each one's
        grant in its `pad`: what the node checks before sending its slot
        (native/am_grant.h). One native call; `items` is copied if read-only."""
        if not items.flags.writeable or not items.flags.c_contiguous:
            items = items.copy()
        am_sign(items.view(np.uint64), self.am_keys, slot_size)
        return items

    def beat_allowed(self, peer, node_id: int, secret: bytes | None) -> bool:
        """May this heartbeat speak for `node_id`: it comes on the node's own
        control connection, or carries the secret the node registered with."""
        node = self.nodes.get(node_id)
        if node is None:
            return True  # unknown ids are ignored anyway
        if peer is not None and peer is node.peer:
            return True
        return bool(node.beat_secret) and secret is not None and hmac.compare_digest(
            bytes(secret), node.beat_secret)

    def heartbeat(self, node_id: int, used_bytes: int) -> Node | None:
        """Record a heartbeat (ignored for unknown or gone nodes); returns the
        node when it was unresponsive and is LIVE again."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return None
        now = time.monotonic()
        node.gap_max = max(node.gap_max, now - (node.beat or node.last_seen))
        node.last_seen = node.beat = now
        node.used_bytes = used_bytes
        if node.state == UNRESPONSIVE:
            node.state = LIVE
            return node
        return None

    def heard(self, node_id: int) -> None:
        """A LIVE node's request other than a heartbeat (items_added): it is
        working, so it is not silent even if its heartbeat is late (a busy
        host). An UNRESPONSIVE node becomes live again by heartbeat only."""
        node = self.nodes.get(node_id)
        if node is not None and node.live:
            node.last_seen = max(node.last_seen, time.monotonic())

    def credit(self, seconds: float) -> None:
        """Add `seconds` to every member's last heartbeat (and to the start of
        an unresponsive one's grace): time during which the control plane
        itself did not run (its heartbeats sat unread in the sockets) is not
        silence of the nodes."""
        for node in self.nodes.values():
            if node.alive:
                node.last_seen += seconds
                node.since += seconds
                if node.beat:
                    node.beat += seconds

    def silent(self, now: float | None = None) -> list[Node]:
        """LIVE nodes that missed heartbeats for longer than the timeout."""
        now = now or time.monotonic()
        return [
            n for n in self.nodes.values() if n.live and now - n.last_seen > self.heartbeat_timeout
        ]

    def unresponsive(self, node: Node, now: float | None = None) -> None:
        """Mark a LIVE node UNRESPONSIVE (a new epoch)."""
        node.state = UNRESPONSIVE
        node.epoch += 1
        node.since = now or time.monotonic()

    def expired(self, now: float | None = None) -> list[Node]:
        """UNRESPONSIVE nodes whose grace is over (to be declared GONE)."""
        now = now or time.monotonic()
        return [n for n in self.nodes.values()
                if n.state == UNRESPONSIVE and now - n.since > self.grace]

    def away(self) -> list[int]:
        """Ids of UNRESPONSIVE nodes (their items are not handed out)."""
        return [n.node_id for n in self.nodes.values() if n.state == UNRESPONSIVE]

    def alive(self) -> list[Node]:
        """Members (LIVE or UNRESPONSIVE): nodes whose items are in the tables."""
        return [n for n in self.nodes.values() if n.alive]

    def live(self) -> list[Node]:
        """LIVE nodes: where inserts may go and whose items are read."""
        return [n for n in self.nodes.values() if n.live]

    def is_alive(self, node_id: int) -> bool:
        """Is `node_id` a member (LIVE or UNRESPONSIVE)?"""
        node = self.nodes.get(node_id)
        return node is not None and node.alive

    def sender(self, peer, f: dict, op: str) -> int:
        """The node id request `op` names (`f["node_id"]`), which must be a
        member registered on this connection; InvalidRequest otherwise."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id or not self.is_alive(node_id):
            raise InvalidRequest(f"{op} for node {node_id} from a connection that is not it")
        return node_id
