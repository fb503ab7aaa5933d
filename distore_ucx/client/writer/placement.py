"""Placement: which storage node each of a writer's batches goes to.

The writer's view of the nodes: the list the control plane gave (read again
every LIST_EVERY s: new nodes join, unresponsive ones are not listed, free
space changes), the bytes this writer sent each one, the nodes that
answered StorageFull lately (passed over for FULL_PASS_OVER s while others
have room), and how each node reads this writer's batches (`paths`).
Thread safety: none (a writer is used by one thread).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

from ...errors import DistoreError, StorageFull
from ...transport import rpc
from .connections import CONNECT_TIMEOUT, Connections, Unreachable

log = logging.getLogger(__name__)

# Seconds between readings of the node list (placement by free space).
LIST_EVERY = 1.0
# A node that answered StorageFull is passed over this long while others have room.
FULL_PASS_OVER = 1.0


class Placement:
    """Chooses a node for each batch and hands back the connection to it."""

    def __init__(self, client, connections: Connections):
        self._client = client
        self.connections = connections
        self._nodes: list[dict] = []
        self._listed = -math.inf  # when _nodes was read (monotonic)
        self._rr = itertools.count()
        self._sent: dict[int, int] = {}  # bytes sent to each node (placement)
        self._since_listed: dict[int, int] = {}  # bytes sent to each node since _listed
        self._full: dict[int, float] = {}  # node id -> until when it is passed over (full)
        self.paths: dict[int, str] = {}  # how each node reads our buffers (logged once)

    def choose(self, exclude: set[int], buffer: int, nbytes: int, timeout: float
               ) -> tuple[dict, rpc.RpcClient]:
        """Where the next batch (of `nbytes`, in staging buffer `buffer`)
        goes, and the connection to it; raises StorageFull when no node is
        left once `exclude` is left out.

        The node list is read again every LIST_EVERY s and whenever every
        listed node is excluded. Nodes with room for the batch (their free
        bytes as their heartbeats last said, less what this writer sent them
        since) and not full lately come first; among them, the one this
        writer has sent the fewest bytes to (round robin by batch would send
        every first chunk of a split insert to one node). With no such node,
        the one with the most room. A node that cannot be reached is added
        to `exclude` and another is chosen."""
        now = time.monotonic()
        if now - self._listed >= LIST_EVERY or all(n["node_id"] in exclude for n in self._nodes):
            self.list_nodes()
        nodes = [n for n in self._nodes if n["node_id"] not in exclude]
        if not nodes:
            raise StorageFull(
                "no live storage node with room to insert into"
                + (f" (tried nodes {sorted(exclude)}: full, unreachable or unresponsive)"
                   if exclude else "")
                + ": start storage nodes (distore node --control ...), give them larger "
                "arenas or disk tiers, or lower the tables' capacities"
            )
        roomy = [n for n in nodes if self._room(n) >= nbytes
                 and self._full.get(n["node_id"], 0.0) <= now]
        if roomy:
            node = min(roomy, key=lambda n: (self._sent.get(n["node_id"], 0), next(self._rr)))
        else:
            node = max(nodes, key=self._room)
        try:
            return node, self.connections.get(node, buffer, timeout)
        except Unreachable as exc:
            # A node that died or stopped since we listed the nodes: try
            # another (the batch keeps its buffer; it is never lost here).
            if exc.gone:
                self.drop(exc.node_id)
            exclude.add(exc.node_id)
            return self.choose(exclude, buffer, nbytes, timeout)

    def connect_listed(self, buffer: int, timeout: float, hand: Callable[[dict], object]
                       ) -> None:
        """A new writer's start: connect to every node listed live now for
        staging buffer `buffer` (replies then wait up to `timeout`), and
        `hand(node)` each one reached its buffer, so that the first batches
        wait for neither (256 actors starting at once took up to 2 s over
        their first flush). Bounded and never fatal: a node not reached
        within CONNECT_TIMEOUT is logged and tried again at first use, as
        the other buffers' connections and nodes that join later are."""
        then = "the writer tries it again at first use"
        try:
            nodes = self.list_nodes()
        except DistoreError as exc:
            log.warning("could not list the storage nodes (%s); %s", exc, then)
            return
        for node in nodes:
            try:
                self.connections.get(node, buffer, timeout, within=CONNECT_TIMEOUT, then=then)
            except Unreachable as exc:  # logged
                if exc.gone:
                    self.drop(exc.node_id)
                continue
            except DistoreError as exc:
                log.warning("storage node %d: %s; %s", node["node_id"], exc, then)
                continue
            hand(node)  # a refusal is logged, and mapping tried again later

    def list_nodes(self) -> list[dict]:
        """Read the live nodes now (placement goes by this reading for
        LIST_EVERY s) and return them."""
        self._nodes = self._client.nodes()
        self._listed, self._since_listed = time.monotonic(), {}
        listed = {n["node_id"] for n in self._nodes}
        for gone in [i for i in self.paths if i not in listed]:
            del self.paths[gone]  # `paths` names the nodes in use, not ones that left
        return self._nodes

    def sent(self, node_id: int, nbytes: int) -> None:
        """Count a batch of `nbytes` sent to `node_id`."""
        self._sent[node_id] = self._sent.get(node_id, 0) + nbytes
        self._since_listed[node_id] = self._since_listed.get(node_id, 0) + nbytes

    def full(self, node_id: int) -> None:
        """`node_id` answered StorageFull: pass it over for FULL_PASS_OVER s."""
        self._full[node_id] = time.monotonic() + FULL_PASS_OVER

    def _room(self, node: dict) -> int:
        """Bytes `node` may still take: its arena and disk tier less what its
        heartbeats said it used, less what this writer sent it since."""
        total = node.get("arena_size", 0) + node.get("disk_size", 0)
        return (total - node.get("used_bytes", 0)
                - self._since_listed.get(node["node_id"], 0))

    def drop(self, node_id: int) -> None:
        """Forget a node that was lost: its connections, its path, its listing."""
        self.paths.pop(node_id, None)
        self.connections.drop(node_id)
        self._nodes = [n for n in self._nodes if n["node_id"] != node_id]
