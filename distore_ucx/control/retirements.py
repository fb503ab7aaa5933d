"""Retiring evicted items that learners still hold leases on.

An item evicted while leased keeps its slot until the lease ends, so a
learner that sampled it ahead would still read it and its header would
still match. Before an insert that evicted such items is acknowledged, the
control plane has their nodes mark the slots' headers retired (`retire`
push, `retired` push back): every read path's header check then drops
them, and a learner re-checks the headers of batches it fetched ahead when
it hands them out (client/learner/recheck.py). So once `flush()` returns for the
evicting insert, no later sample of any learner returns them.

A node that does not answer within RETIRE_TIMEOUT (hung, or gone) does not
hold the insert longer: its reads fail or its items leave with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np

from ..slot_format import COLD
from .evictions import Retired

log = logging.getLogger(__name__)

RETIRE_TIMEOUT = 5.0  # s a node has to mark retired slots


class Retirements:
    """Outstanding `retire` requests to nodes, by request id."""

    def __init__(self, members):
        self.members = members
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def mark(self, table: str, retired: Retired) -> None:
        """Have the nodes of `retired` mark those slots retired; returns once
        every live node has confirmed (or RETIRE_TIMEOUT passed)."""
        if len(retired) == 0:
            return
        # Cold items (on a node's disk tier) are read from staged copies
        # that the node made for the sample, not from these slots: those
        # copies come as rows of their own (Leases.staged_copies).
        hot = retired.offsets < COLD
        jobs = []
        for node_id in np.unique(retired.nodes[hot]):
            node = self.members.nodes.get(int(node_id))
            if node is None or not node.alive or node.peer is None:
                continue
            rows = hot & (retired.nodes == node_id)
            req = next(self._ids)
            fut = self._waiting[req] = asyncio.get_running_loop().create_future()
            node.peer.push("retire", request=req, table=table, offsets=retired.offsets[rows],
                           generations=retired.generations[rows])
            jobs.append((req, int(node_id), fut))
        if not jobs:
            return
        try:
            done, pending = await asyncio.wait([f for _, _, f in jobs], timeout=RETIRE_TIMEOUT)
            for _, node_id, fut in jobs:
                if fut in pending:
                    log.warning("storage node %d did not confirm retiring evicted items of "
                                "table %r within %g s; learners holding them may still read "
                                "them from it", node_id, table, RETIRE_TIMEOUT)
        finally:
            for req, _, _ in jobs:
                self._waiting.pop(req, None)

    def retired(self, node_id: int, request: int) -> None:
        """A node's answer to a `retire` push."""
        fut = self._waiting.get(request)
        if fut is not None and not fut.done():
            fut.set_result(node_id)
