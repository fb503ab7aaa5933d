"""Registering inserts: a storage node stored a writer's batch and asks for
its items to be made sampleable (`items_added`). One request may carry
several batches (`batches`: a node registers the inserts stored while its
last request was answered together, storage/registrations.py): each is
admitted, checked and refused on its own, and those admitted together are
added to the table in one update.

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
import time

import numpy as np

from ..errors import ConfigError, InvalidRequest, NodeGone, RateLimiterTimeout
from ..protocol import error_code, steps_of
from ..transport.rpc import Peer
from .admission import Admission
from .catalog import Catalog
from .membership import Membership
from .reclaim import Reclaim
from .retirements import Retirements
from .tables import Table

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
        """A node stored a batch, or several (`batches`): make their items
        sampleable, each batch once the table's rate limiter admits it. The
        reply counts the items evicted and gives the offsets of keys the
        table held already; a batch of several refused while others are
        registered is in its `errors` (one batch alone: the error reply)."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(f"items_added for node {node_id} from a connection that is not it")
        self.members.heard(node_id)
        self._check_placed(node_id, f)
        table = self.catalog.table(f["table"])
        batches = Batches(f)
        errors = batches.refuse_negative(f["priorities"])
        if "used_bytes" in f:
            self.members.nodes[node_id].used_bytes = f["used_bytes"]
        pending = [i for i in range(len(batches)) if i not in errors]
        evicted, twice = 0, []
        while pending:
            first = pending[0]
            try:
                await self.admission.insert(table, batches.n[first], batches.left(first))
                self._check_placed(node_id, f)
            except NodeGone as exc:  # all that are left: the node is not live
                errors.update(batches.refuse(pending, exc))
                break
            except (RateLimiterTimeout, ConfigError) as exc:
                errors.update(batches.refuse([first], exc))
                pending.pop(0)
                continue
            take = _admitted(table, batches.n, pending)
            pending = pending[len(take):]
            n_evicted, dup = await self._add(table, node_id, f, batches.items(take))
            evicted += n_evicted
            twice.append(dup)
        reply = {"evicted": evicted}
        dups = np.concatenate(twice) if twice else np.zeros(0, np.uint64)
        if len(dups):
            reply["duplicate_offsets"] = dups
        if errors:
            reply["errors"] = [[i, error_code(e), str(e)] for i, e in sorted(errors.items())]
        return reply

    async def _add(self, table: Table, node_id: int, f: dict, items) -> tuple[int, np.ndarray]:
        """Add the request's `items` (an index or a slice) to the table in
        one update; the items evicted, and the offsets of keys it held
        already (not stored twice: their node frees those slots)."""
        keys, offsets = f["keys"][items], f["offsets"][items]
        gens, prios = f["generations"][items], f["priorities"][items]
        # Steps of episodes (a table of slices): where each sits in its episode.
        steps = steps_of(f)
        if steps is not None:
            steps = tuple(a[items] for a in steps)
        # A writer resends a batch whose node became unresponsive: if both
        # copies reach the table, the second is refused here (its slots are
        # freed by its node), so a key is never stored twice.
        twice = table.core.lookup(np.ascontiguousarray(keys, np.uint64)) >= 0
        dup = offsets[twice]
        if len(dup):
            log.info("table %r: %d keys of a batch from node %d are in the table already (a "
                     "batch resent after its node became unresponsive); not stored twice",
                     table.name, len(dup), node_id)
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
        return int(len(freed.nodes) + len(retired)), np.asarray(dup, np.uint64)

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


class Batches:
    """The batches of one items_added request: their sizes, where each one's
    items are, and how long each may wait for the rate limiter."""

    def __init__(self, f: dict):
        n_items = len(f["keys"])
        sizes = f.get("batches")
        self.single = sizes is None
        self.n = [n_items] if sizes is None else sizes
        if sizes is not None and (any(type(n) is not int or n < 1 for n in sizes)
                                  or sum(sizes) != n_items):
            raise InvalidRequest(f"items_added: batches {_few(self.n)} must be sizes >= 1 "
                                 f"that add up to the {n_items} keys")
        timeouts = f.get("timeouts")
        if timeouts is None:
            timeouts = [f.get("timeout", 60.0)] * len(self.n)
        if (len(timeouts) != len(self.n) or
                any(type(t) not in (int, float) or not 0 <= t <= 86400 for t in timeouts)):
            raise InvalidRequest(f"items_added: timeouts {_few(timeouts)} must be one number "
                                 f"of seconds (0..86400) for each of the {len(self.n)} batches")
        now = time.monotonic()
        self.deadlines = [now + t for t in timeouts]
        self.starts = np.concatenate(([0], np.cumsum(self.n)))

    def __len__(self) -> int:
        return len(self.n)

    def left(self, i: int) -> float:
        """Seconds batch i may still wait."""
        return max(0.0, self.deadlines[i] - time.monotonic())

    def items(self, batches: list[int]):
        """The request's items of these batches (in order): a slice when
        they follow each other, an index array otherwise."""
        lo, hi = self.starts[batches[0]], self.starts[batches[-1] + 1]
        if hi - lo == sum(self.n[i] for i in batches):
            return slice(int(lo), int(hi))
        return np.concatenate([np.arange(self.starts[i], self.starts[i + 1]) for i in batches])

    def refuse(self, batches: list[int], exc: Exception) -> dict[int, Exception]:
        """Refuse these batches with exc: raised for a request of one batch,
        else returned by index for the reply's `errors`."""
        if self.single:
            raise exc
        return dict.fromkeys(batches, exc)

    def refuse_negative(self, priorities: np.ndarray) -> dict[int, Exception]:
        """The batches with a negative priority (InvalidRequest)."""
        if not len(priorities) or priorities.min() >= 0:
            return {}
        negative = np.minimum.reduceat(priorities, self.starts[:-1]) < 0
        return self.refuse(np.flatnonzero(negative).tolist(),
                           InvalidRequest("priorities must be >= 0"))


def _admitted(table: Table, sizes: list[int], pending: list[int]) -> list[int]:
    """The batches that go into the table now: the first of `pending`,
    admitted by the rate limiter, and those after it, in order, while the
    rate limiter admits them all at once."""
    take, total = [pending[0]], sizes[pending[0]]
    for i in pending[1:]:
        if not table.can_insert(total + sizes[i]):
            break
        take.append(i)
        total += sizes[i]
    return take


def _few(values: list) -> str:
    """A list for an error message: its first values."""
    return repr(values[:8])[:-1] + (", ...]" if len(values) > 8 else "]")
