"""Sampling: answering a learner's `sample` request, in named steps.

1. Release the leases of earlier batches the request carries (`release`).
2. Size the answer (`_size`): a learner sampling ahead asks for several
   batches at once and may be given fewer whole batches, as many as
   control.max_sample and its connection's lease limit allow (one for a
   table that may hold cold items).
3. Check the limits (`_check_limits`): one request's size
   (control.max_sample) and the items a connection may hold leased
   (control.max_leased_items).
4. Wait for the table's rate limiter (control/admission.py), then check
   the lease limit again: another sample of the same connection may have
   been granted meanwhile.
5. Draw (`_draw`): the table's sampler picks the items, those on
   unresponsive nodes are drawn again (`_route_around`), and one lease
   covers them all.
6. Stage cold items (`_stage_cold`): items on a node's disk tier are read
   into its staging area before the reply gives their locations
   (control/tiers.py).
7. Sign the locations (`Membership.sign`): each item's grant, which its
   node asks for before it sends the item by active message.
"""

from __future__ import annotations

import time

import numpy as np

from ..config import ControlConfig
from ..errors import InvalidRequest, LimitExceeded
from ..slot_format import COLD
from ..transport.rpc import Peer
from .admission import Admission
from .catalog import Catalog
from .evictions import Freed
from .leases import Leases
from .membership import Membership
from .reclaim import Reclaim
from .tables import Table
from .tiers import Tiers

# Rounds of drawing again the items of a sample that lie on unresponsive
# nodes; what is left after them is resampled by the learner.
ROUTE_AROUND_ROUNDS = 32


class Sampling:
    """The `sample` request; one per control plane."""

    def __init__(self, config: ControlConfig, catalog: Catalog, leases: Leases,
                 members: Membership, tiers: Tiers, admission: Admission, reclaim: Reclaim):
        self.config = config
        self.catalog = catalog
        self.leases = leases
        self.members = members
        self.tiers = tiers
        self.admission = admission
        self.reclaim = reclaim

    async def op_sample(self, peer: Peer, f: dict) -> dict:
        """Sample n items under a lease owned by this connection.

        With `batch` (n is several batches of that size, sampled ahead by a
        learner) the answer may hold fewer whole batches: as many as
        control.max_sample and the connection's lease limit allow, one for a
        table that has had items on a disk tier. `release` (lease ids of
        earlier batches) is handled first; ids of another connection's
        leases are refused and counted in the reply's `refused`, not failed:
        the sample itself is still answered."""
        arrived = time.monotonic()
        refused = self.reclaim.release_owned(peer, f["release"]) if "release" in f else 0
        table = self.catalog.table(f["table"])
        if table.slices is not None and (f["n"] % table.slice_len
                                         or f.get("batch", f["n"]) % table.slice_len):
            raise InvalidRequest(
                f"table {table.name!r} is sampled as slices of {table.slice_len} steps: ask for "
                f"a multiple of {table.slice_len} rows (a learner's batch_size counts slices)")
        held = self.leases.held(peer)
        n = self._size(table, f["n"], f.get("batch", f["n"]), held)
        self._check_limits(table, n, held)
        if not table.can_sample(n):  # else admission.sample returns at once
            await self.admission.sample(table, n, f.get("timeout", 0.0))
        self._check_lease_limit_after_wait(table, peer, n)
        t0 = time.perf_counter()  # metrics: the decision, without the wait
        size = table.size  # the size the probabilities refer to
        min_probability = table.min_probability  # ... and the smallest of them (weights)
        steps = {}
        if table.slices is not None:
            recs, probs, positions, flags = table.sample_slices(n)
            steps = {"positions": positions, "step_flags": flags}
            self.admission.touch(table)  # inserts the rate limiter holds may go on
        else:
            recs, probs = self._draw(table, n)
        granted = time.monotonic()
        lease = self.leases.grant(table.name, recs, peer, now=granted)
        items = table.locations(recs)  # protocol.ITEM_LOCATION records
        table.stats.decision.observe(time.perf_counter() - t0)
        staged = int(np.count_nonzero(items["offset"] >= COLD))
        if staged:
            items = await self._stage_cold(table, recs, items, lease)
        # Each item's grant, which its node checks before sending a byte of it.
        items = self.members.sign(items, table.spec.slot_size)
        return {
            "lease": lease,
            "refused": refused,
            "table_size": size,
            "items": items,
            "probabilities": probs,
            "min_probability": min_probability,
            "staged": staged,  # cold items read from disk for it (learners ask further ahead)
            # The lease lasts lease_timeout s from its grant, `held` s after
            # the request came in: a learner counts from when it sent the
            # request and uses no batch of it once the lease may be gone
            # (client/learner/sample_stream.py).
            "lease_timeout": self.leases.timeout,
            "held": granted - arrived,
            **steps,
        }

    def _size(self, table: Table, n: int, batch: int, held: int) -> int:
        """How many items to answer a request for n with: n, or for a
        learner sampling ahead (several batches of `batch` asked at once)
        as many whole batches as the limits allow, at least one."""
        if batch < n and n % batch == 0:
            # Answer fewer whole batches rather than refuse. Cold items must
            # fit the nodes' staging areas, sized for a learner holding three
            # batches, so one batch for a table that may hold cold items. A
            # table that never left DRAM samples ahead, disk tiers or not
            # (perf/tier_bandwidth.py --hot measures what that is worth).
            if table.may_hold_cold:
                n = batch
            fit = min(self.config.max_sample, self.config.max_leased_items - held) // batch * batch
            n = max(batch, min(n, fit))
        return n

    def _check_limits(self, table: Table, n: int, held: int) -> None:
        """Refuse a sample over one request's size or over the connection's
        lease limit (it holds `held` leased items)."""
        if n > self.config.max_sample:
            raise LimitExceeded(
                f"table {table.name!r}: a sample of {n} items is more than one request may ask "
                f"for (control.max_sample = {self.config.max_sample}); sample smaller "
                "batches, or raise --max-sample"
            )
        limit = self.config.max_leased_items
        if held + n > limit:
            raise LimitExceeded(
                f"table {table.name!r}: this connection holds leases on {held} items and asks "
                f"for {n} more, over its limit (control.max_leased_items = {limit}). Release "
                "read batches (a learner releases each batch with its next request; close "
                "idle learners), or raise --max-leased-items"
            )

    def _check_lease_limit_after_wait(self, table: Table, peer: Peer, n: int) -> None:
        """Samples of one connection run concurrently (a learner keeps two in
        flight for cold items): another may have been granted while this one
        waited. Checked again with no await before the grant, so pipelining
        can never take more than the limit."""
        limit = self.config.max_leased_items
        if self.leases.held(peer) + n > limit:
            raise LimitExceeded(
                f"table {table.name!r}: this connection holds leases on "
                f"{self.leases.held(peer)} items and asks for {n} more, over its limit "
                f"(control.max_leased_items = {limit}). Keep fewer samples in flight, "
                "release read batches, or raise --max-leased-items"
            )

    def _draw(self, table: Table, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n records drawn by the table's sampler and leased, none on an
        unresponsive node if a few rounds of drawing again avoid them:
        (records, probabilities). Slots the draw freed are freed on their
        nodes, and calls held by the rate limiter woken."""
        recs, probs, freed = table.sample(n)
        away = self.members.away()
        # Not for tables with max_times_sampled: a draw is a use there, and
        # drawing again would use up items nobody receives.
        if away and not table.max_times_sampled:
            recs, probs, freed = self._route_around(table, recs, probs, freed, away)
        self.reclaim.free(table.name, freed)
        self.admission.touch(table)
        return recs, probs

    def _route_around(self, table: Table, recs, probs, freed: Freed, away: list[int]):
        """Draw again the items of a sample that lie on unresponsive nodes (as
        a learner resamples items it cannot read), a few rounds at most:
        their reads would wait for a node that does not answer."""
        nodes = np.asarray(away, np.uint32)
        for _ in range(ROUTE_AROUND_ROUNDS):
            bad = np.flatnonzero(np.isin(table.store.node[recs], nodes))
            if len(bad) == 0:
                break
            freed = freed + table.unlease(recs[bad])
            again, p, more = table.sample(len(bad))
            recs[bad], probs[bad] = again, p
            freed = freed + more
        return recs, probs, freed

    async def _stage_cold(self, table: Table, recs, items, lid: int):
        """Locations of a sample whose cold items their nodes staged
        (control/tiers.py); on failure the sample's lease is released."""
        lease = self.leases.get(lid)
        try:
            items = await self.tiers.stage(table, recs, items, lease)
        except BaseException:
            if self.leases.get(lid) is not None:
                self.reclaim.release(self.leases.take([lid], lease.owner)[0])
            else:
                self.tiers.unstage(lease.staged)
            raise
        if self.leases.get(lid) is None:  # expired while the nodes read
            self.tiers.unstage(lease.staged)
        return items
