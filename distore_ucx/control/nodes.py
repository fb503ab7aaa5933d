"""Storage nodes as the control plane serves them: joining, heartbeats,
leaving, and what becomes of their items when they go silent or go.

membership.py keeps each node's state (LIVE, UNRESPONSIVE, GONE) and says
which are silent or past their grace; this module answers the nodes'
requests (`register_node`, `heartbeat`, `deregister_node`) and the clients'
`nodes`, and acts on the state changes: an unresponsive node is routed
around, a gone node's items leave the tables (not counted as deletes), and
a restore in progress (control/restore.py) learns who joined and who left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from ..config import ControlConfig
from ..errors import CheckpointError, InvalidRequest
from ..metrics import ControlStats
from ..transport.rpc import Peer
from .checkpoint import IdState
from .membership import GONE, Membership, Node
from .restore import Restoring
from .tables import Table
from .tiers import Demotions

log = logging.getLogger(__name__)


class Nodes:
    """The nodes' membership requests and their consequences; one per control plane."""

    def __init__(self, config: ControlConfig, ids: IdState, members: Membership,
                 tables: dict[str, Table], demotions: Demotions, restoring: Restoring,
                 stats: ControlStats, refit: Callable[[str], None] | None = None):
        """`refit(why)` is told whenever the live nodes change (Catalog.refit:
        a table whose capacity no longer fits them is warned about)."""
        self.config = config
        self.ids = ids
        self.members = members
        self.tables = tables
        self.demotions = demotions
        self.restoring = restoring
        self.stats = stats
        self.refit = refit or (lambda why: None)
        self._refused_stores: set[str] = set()  # nodes of another store, refused (logged once)

    # -- requests --------------------------------------------------------
    def op_register_node(self, peer: Peer, f: dict) -> dict:
        """A node joins, or re-joins after losing us with its former id.

        `restore` in the reply tells it whether to re-send the items it holds
        (this control plane is restoring) or to discard them (it starts
        afresh, or dropped the node and forgot them)."""
        fields = dict(f)
        wanted = fields.pop("node_id", None)
        store = fields.pop("store_id", None)
        restore = self.restoring.current
        # A control plane started from a checkpoint (--restore) refuses another
        # store's node even once its restore is over: told "not restoring",
        # the node would discard items that belong to its own store.
        if store is not None and store != self.ids.store_id and (
                restore is not None or self.config.restore):
            why = (f"storage node {f['name']!r} holds items of store {store}, but this control "
                   f"plane was restored as store {self.ids.store_id} ({self.config.checkpoint}): "
                   "refused, its items kept. Restart the node's own control plane (its "
                   "--checkpoint), or restart the node empty to join this store")
            if why not in self._refused_stores:  # one line per node and store, not per retry
                self._refused_stores.add(why)
                log.error("%s", why)
            raise CheckpointError(why)
        node = self.members.register(peer, fields, wanted)
        self.stats.membership["rejoined" if wanted == node.node_id else "joined"] += 1
        if restore is not None:
            # A node with a former id re-sends its items, then says so (items_resent).
            restore.joined(node.node_id, node.name, resends=wanted is not None)
        self.refit(f"node {node.node_id} ({node.name}) joined")
        return {"node_id": node.node_id, "heartbeat_interval": self.config.heartbeat_interval,
                "restore": restore is not None, "store_id": self.ids.store_id,
                "items_resent": restore is not None}

    def op_heartbeat(self, peer: Peer, f: dict) -> dict:
        """A node's heartbeat (on a connection of its own: storage/heartbeat.py);
        an unresponsive node that beats again is live again, with its items.
        Only the node may beat for itself: a heartbeat that neither comes on
        its control connection nor carries its `beat_secret` is refused."""
        if not self.members.beat_allowed(peer, f["node_id"], f.get("beat_secret")):
            raise InvalidRequest(
                f"heartbeat for node {f['node_id']} from a connection that is not it (no or a "
                "wrong beat_secret)")
        node = self.members.heartbeat(f["node_id"], f["used_bytes"])
        if node is not None:
            self.stats.membership["resumed"] += 1
            log.warning("node %d (%s) answers again after %.1f s unresponsive; it resumes with "
                        "its items", node.node_id, node.name, time.monotonic() - node.since)
        node = self.members.nodes.get(f["node_id"])
        return {"state": node.state if node is not None else GONE}

    def op_deregister_node(self, peer: Peer, f: dict) -> dict:
        """A node shutting down: drop its items from sampling now, not at its timeout."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(
                f"deregister_node for node {node_id} from a connection that is not it"
            )
        if self.members.is_alive(node_id):
            self.died(node_id, "it left", left=True)
        # Slots of this node that learners hold leases on: reads that may be in flight.
        leased = sum(int(np.count_nonzero((t.store.node == node_id) & (t.store.leases > 0)))
                     for t in self.tables.values())
        return {"leased": leased}

    def op_nodes(self, peer: Peer, f: dict) -> dict:
        """LIVE nodes: where writers place inserts and learners read from
        (unresponsive ones are routed around)."""
        return {"nodes": [n.describe() for n in self.members.live()]}

    def op_node_state(self, peer: Peer, f: dict) -> dict:
        """One node's state, for a writer waiting on it (client/writer):
        "unknown" for an id this control plane has not seen (a restarted
        one the node has not re-joined yet)."""
        node = self.members.nodes.get(f["node_id"])
        return {"state": "unknown" if node is None else node.state}

    # -- state changes ---------------------------------------------------
    def on_close(self, peer: Peer) -> None:
        """A control connection closed: a node on it is gone."""
        # The connection's leases are not released here: reads it posted may
        # still be in flight over UCX. They expire after lease_timeout.
        node_id = peer.state.get("node_id")
        if node_id is not None and self.members.is_alive(node_id):
            self.died(node_id, "its control connection closed")

    def check(self, now: float) -> None:
        """Mark silent nodes unresponsive and drop those silent past the
        grace (housekeeping)."""
        for node in self.members.silent(now):
            self.unresponsive(node, now)
        for node in self.members.expired(now):
            self.died(node.node_id, f"no heartbeat for {now - node.last_seen:.1f} s, "
                      f"longer than the grace (control.unresponsive_grace = "
                      f"{self.members.grace:g} s)")

    def unresponsive(self, node: Node, now: float) -> None:
        """A node missed its heartbeats: route around it (no inserts placed
        there, its items left out of sample replies) but keep its items for
        the grace; a heartbeat makes it live again (op_heartbeat)."""
        self.members.unresponsive(node, now)
        self.stats.membership["unresponsive"] += 1
        log.warning("node %d (%s) unresponsive: no heartbeat for %.1f s; clients route around "
                    "it, its items stay for %g s (control.unresponsive_grace)", node.node_id,
                    node.name, now - node.last_seen, self.members.grace)

    def died(self, node_id: int, why: str, left: bool = False) -> int:
        """Take a node out of the store, however it went (silent past the
        grace, connection closed, or `left`: deregistered on shutdown): its
        items leave sampling at once (not counted as deletes), and a gone
        node's connection is closed. Returns how many items left."""
        node = self.members.nodes[node_id]
        node.state = GONE
        if self.restoring.current is not None:
            # Housekeeping ends the restore if it was the last.
            self.restoring.current.gone(node_id)
        self.stats.membership["left" if left else "dropped"] += 1
        dropped = sum(t.drop_node(node_id) for t in self.tables.values())
        self.demotions.forget(node_id=node_id)
        if left:
            log.info("node %d (%s) left: %d items removed from sampling", node_id, node.name,
                     dropped)
        else:
            log.warning("node %d (%s) dropped: %s; %d items removed from sampling",
                        node_id, node.name, why, dropped)
            if node.peer is not None:
                node.peer.close()
        self.refit(f"node {node_id} ({node.name}) {'left' if left else 'was dropped'}")
        return dropped
