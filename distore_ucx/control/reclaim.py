"""Reclaiming slots: telling storage nodes which slots they may reuse, and
ending leases (released by their learner, or expired) so that theirs can be.

A record that leaves a table unleased (evicted, used up, a duplicate, a
restore's discard) has its slot freed on its node at once (a `free` push).
One that leaves while leased stays RETIRED until its last lease ends; a
lease ends when its owner releases it (control/leases.py says who may) or
when it expires, and then its records are unleased, the slots left unleased
freed, the cold items staged for it given back (`unstage`), and the calls
the table's rate limiter holds woken, since the table's counts moved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from ..transport.rpc import Peer
from .admission import Admission
from .evictions import Freed
from .leases import Lease, Leases
from .membership import Membership
from .tables import Table
from .tiers import Tiers

log = logging.getLogger(__name__)


class Reclaim:
    """Frees slots on their nodes and ends leases; one per control plane."""

    def __init__(self, tables: dict[str, Table], leases: Leases, members: Membership,
                 tiers: Tiers, admission: Admission):
        self.tables = tables
        self.leases = leases
        self.members = members
        self.tiers = tiers
        self.admission = admission

    def free(self, table: str, freed: Freed) -> None:
        """Tell the owning nodes to reuse these slots (dead nodes are skipped)."""
        if len(freed.nodes) == 0:
            return
        for node_id in np.unique(freed.nodes):
            node = self.members.nodes.get(int(node_id))
            if node is None or not node.alive:
                continue
            node.peer.push("free", table=table, offsets=freed.offsets[freed.nodes == node_id])

    def release(self, leases: Iterable[Lease]) -> None:
        """End these leases (already taken out of `Leases`): unstage their
        cold items, unlease their records, free what that leaves unleased."""
        for lease in leases:
            if lease.staged:
                self.tiers.unstage(lease.staged)
            table = self.tables.get(lease.table)
            if table is not None:
                self.free(table.name, table.unlease(lease.recs))
                self.admission.touch(table)

    def release_owned(self, peer: Peer, lease_ids) -> int:
        """Release `peer`'s leases among `lease_ids`; returns how many ids named
        another connection's lease (refused: logged once per connection)."""
        mine, refused = self.leases.take(lease_ids, peer)
        self.release(mine)
        if refused:
            peer.state["leases_refused"] = peer.state.get("leases_refused", 0) + refused
            if not peer.state.get("refusal_logged"):
                peer.state["refusal_logged"] = True
                log.warning("%s tried to release %d lease(s) another connection holds; refused "
                            "(a buggy or hostile client; further refusals from it are only "
                            "counted, see `distore status --json`)", peer.address, refused)
        return refused

    def expire(self, now: float) -> None:
        """Release every lease past its deadline (housekeeping)."""
        expired = self.leases.expired(now)
        if expired:
            log.warning("%d leases expired unreleased (learner gone?)", len(expired))
            self.release(expired)

    def op_release(self, peer: Peer, f: dict) -> dict:
        """Release this connection's leases. Ids of another connection's leases
        are refused: they are counted in `refused` (and logged once per
        connection) rather than failing the request, because a learner whose
        connection was re-made may legitimately send ids its old connection
        owned; those leases expire."""
        return {"refused": self.release_owned(peer, f["leases"])}
