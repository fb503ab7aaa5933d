"""Registering inserts: a storage node stored a writer's batch and asks for
its items to be made sampleable (`items_added`).

The batch is refused if its node is not LIVE, or was unresponsive after
the writer placed the batch there (the writer resent it elsewhere); it
waits for the table's rate limiter (control/admission.py); keys the table
already holds (a batch resent after its node became unresponsive, both
copies arriving) are not stored twice. Items the insert evicts are freed
on their nodes, and those a learner still holds leases on are retired
(control/retirements.py) before the insert is acknowledged.
"""

from __future__ import annotations

import logging

import numpy as np

from ..errors import InvalidRequest, NodeGone
from ..protocol import steps_of
from ..transport.rpc import Peer
from .admission import Admission
from .catalog import Catalog
from .membership import Membership
from .reclaim import Reclaim
from .retirements import Retirements

log = logging.getLogger(__name__)


class Inserts:
    """The `items_added` request; one per control plane."""

    def __init__(self, catalog: Catalog, members: Membership, admission: Admission,
                 retirements: Retirements, reclaim: Reclaim):
        self.catalog = catalog
        self.members = members
        self.admission = admission
        self.retirements = retirements
        self.reclaim = reclaim

    async def op_items_added(self, peer: Peer, f: dict) -> dict:
        """A node stored a batch: make its items sampleable once the table's
        rate limiter admits them; the reply counts the items evicted."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(f"items_added for node {node_id} from a connection that is not it")
        self.members.heard(node_id)
        self._check_placed(node_id, f)
        table = self.catalog.table(f["table"])
        n = len(f["keys"])
        if (f["priorities"] < 0).any():
            raise InvalidRequest("priorities must be >= 0")
        await self.admission.insert(table, n, f.get("timeout", 60.0))
        self._check_placed(node_id, f)
        if "used_bytes" in f:
            self.members.nodes[node_id].used_bytes = f["used_bytes"]
        keys, offsets = f["keys"], f["offsets"]
        gens, prios = f["generations"], f["priorities"]
        # Steps of episodes (a table of slices): where each sits in its episode.
        steps = steps_of(f)
        # A writer resends a batch whose node became unresponsive: if both
        # copies reach the table, the second is refused here (its slots are
        # freed by its node), so a key is never stored twice.
        twice = table.core.lookup(np.ascontiguousarray(keys, np.uint64)) >= 0
        if twice.any():
            log.info("table %r: %d keys of a batch from node %d are in the table already (a "
                     "batch resent after its node became unresponsive); not stored twice",
                     table.name, int(twice.sum()), node_id)
            new = ~twice
            keys, offsets, gens, prios = keys[new], offsets[new], gens[new], prios[new]
            if steps is not None:
                steps = tuple(a[new] for a in steps)
        freed, retired = table.add(node_id, keys, offsets, gens, prios, steps)
        # A cold one is read ahead from the copy its node staged for the
        # learner's sample: that copy is marked instead of the disk slot.
        retired = retired + self.reclaim.leases.staged_copies(table.name, retired)
        # Items of this batch evicted at once are freed too: the node holds
        # a free until the registrations in flight when it came are committed.
        self.reclaim.free(table.name, freed)
        self.admission.touch(table)
        # Evicted items a learner sampled ahead: their nodes mark the slots
        # retired before the insert is acknowledged (control/retirements.py).
        await self.retirements.mark(table.name, retired)
        reply = {"evicted": int(len(freed.nodes) + len(retired))}
        if twice.any():
            reply["duplicate_offsets"] = f["offsets"][twice]
        return reply

    def _check_placed(self, node_id: int, f: dict) -> None:
        """Refuse an insert from a node that is not LIVE, or one placed there
        before it was last unresponsive (`epoch`: the writer resent it
        elsewhere). NodeGone is a ConnectionFailed: the writer resends."""
        node = self.members.nodes.get(node_id)
        if node is None or not node.live:
            state = "gone" if node is None else node.state
            raise NodeGone(f"storage node {node_id} is {state} (no heartbeat); its insert "
                           "was not registered and the writer resends the batch")
        if "epoch" in f and f["epoch"] != node.epoch:
            raise NodeGone(f"storage node {node_id} was unresponsive after this insert was "
                           "placed there (the writer may have resent it elsewhere); not "
                           "registered, the writer resends the batch")
