"""A storage node's requests about the slots of its arena and disk tier.

A node whose arena is full asks which items to demote to its disk tier
(`demote`) and reports the copies it made (`items_moved`), or, for an
insert with no room, asks which items to evict (`evict`); it answers the
control plane's `stage` and `retire` pushes (`staged`, `retired`). The
decisions are made elsewhere: demotion and staging in tiers.py, eviction
for room in room.py, retiring in retirements.py. Each request must come
from the node it names, on its own connection.
"""

from __future__ import annotations

import logging

import numpy as np

from ..transport.rpc import Peer
from .admission import Admission
from .catalog import Catalog
from .membership import Membership
from .retirements import Retirements
from .room import Room
from .tiers import Demotions, Tiers, apply_moves

log = logging.getLogger(__name__)


class Arenas:
    """The nodes' slot requests; one per control plane."""

    def __init__(self, catalog: Catalog, members: Membership, tiers: Tiers,
                 demotions: Demotions, room: Room, retirements: Retirements,
                 admission: Admission):
        self.catalog = catalog
        self.members = members
        self.tiers = tiers
        self.demotions = demotions
        self.room = room
        self.retirements = retirements
        self.admission = admission

    def op_demote(self, peer: Peer, f: dict) -> dict:
        """A node whose arena is full: which of its items of a table to move to disk."""
        node_id = self.members.sender(peer, f, "demote")
        keys, offsets, gens = self.demotions.pick(self.catalog.table(f["table"]), node_id, f["n"])
        return {"keys": keys, "offsets": offsets, "generations": gens}

    def op_items_moved(self, peer: Peer, f: dict) -> dict:
        """A node copied items to another tier: move the records still there."""
        node_id = self.members.sender(peer, f, "items_moved")
        taken = apply_moves(self.catalog.table(f["table"]), node_id, f["keys"], f["offsets"],
                            f["generations"], f["new_offsets"], f["new_generations"])
        return {"taken": taken.astype(np.uint8)}

    def op_staged(self, peer: Peer, f: dict) -> None:
        """A node staged (or could not stage) a sample's cold items."""
        self.tiers.staged(self.members.sender(peer, f, "staged"), f)

    def op_evict(self, peer: Peer, f: dict) -> dict:
        """A node whose arena has no room for an insert into a table: evict
        up to n of that table's items stored there, by its remover
        (control/room.py); the node frees the slots it is told."""
        node_id = self.members.sender(peer, f, "evict")
        table = self.catalog.table(f["table"])
        recs = self.room.pick(table, node_id, f["n"])
        freed = table.evict(recs)  # unleased: every slot is freed
        if len(recs):
            self.admission.touch(table)
            log.debug("table %r: %d items evicted to make room on node %d", table.name,
                      len(recs), node_id)
        s = table.store
        leased = int(np.count_nonzero((s.node == node_id) & (s.leases > 0)))
        return {"offsets": freed.offsets, "leased": leased}

    def op_retired(self, peer: Peer, f: dict) -> None:
        """A node marked the slots of a `retire` push."""
        self.retirements.retired(self.members.sender(peer, f, "retired"), f["request"])
