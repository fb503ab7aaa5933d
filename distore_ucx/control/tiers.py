"""The control plane's side of the disk tier: which items a full node
demotes, moving their records, and staging sampled cold items.

A cold item's record stays where it was: its `offset` is the disk slot with
the top bit set (slot_format.py COLD) and its `generation` is the one the
node wrote with the copy on disk; key, priority, sequence and times sampled
do not change, so neither does any sampling probability.

Demotion: a node whose arena is full asks for `n` items of a table it holds
(`demote`); we name its LIVE, hot, unleased ones that the table would give
up first (lowest priority for prioritized samplers, else oldest), a table
of slices' steps by episode and position: the node gives them ascending
disk slots in that order, so the steps of an episode demoted together
follow each other on disk and a cold slice is read as one run. The node
copies them to disk and reports the moves (`items_moved`); a move is taken
only if the record still has the location the node copied from and no lease
(a learner may have sampled it meanwhile): otherwise the node keeps the DRAM
copy and frees the disk slot.

Staging: a sample that draws cold items holds its reply (without holding the
event loop) while their nodes read them, one batch a node, into their
staging areas (`stage` push, `staged` push back); the reply then gives those
locations, so learners read cold items exactly like hot ones, header checks
included. The extents belong to the sample's lease and go back to the node
(`unstage`) when it is released or expires. A slot that cannot be read, or
reads back as another item, is reported lost: the item leaves the table and
the learner, finding a zeroed header, resamples it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np

from ..errors import ConnectionFailed, NodeGone, StagingFull, Timeout
from ..slot_format import COLD
from .items import LIVE

log = logging.getLogger(__name__)

STAGE_TIMEOUT = 30.0  # s for a node to stage a sample's cold items


def pick_demotions(table, node_id: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Up to n hot, unleased items of `table` on `node_id`, those the table
    gives up first: (keys, offsets, generations)."""
    s = table.store
    cand = np.flatnonzero(_demotable(s, slice(None), node_id))
    if len(cand) > n > 0:
        if table.sampler.kind == "prioritized":
            score = table.core.priorities(cand)
        else:
            score = table.core.sequences(cand)
        cand = cand[np.argpartition(score, n - 1)[:n]]
    elif n <= 0:
        cand = cand[:0]
    cand = disk_order(table, cand)
    loc = s.locations(cand)  # keys live in the table core: read only these rows
    return loc["key"].copy(), loc["offset"].copy(), loc["generation"].copy()


class Demotions:
    """Demotion candidates found by one scan, handed out over many requests.

    `pick_demotions` scans every record of the table (tens of ms at millions
    of items), for the 64 items a full node asks for at a time. Here one
    scan per (table, node) keeps the
    max(16 n, 4096, 1/64 of the node's hot items) best candidates in order;
    each request takes the next ones that still qualify (LIVE, hot, on that
    node, unleased, and the same item: its sequence unchanged, so a record
    id reused by a newer item is not demoted in its place) and scans again
    only when they run out. The order is the scan's: items inserted since,
    or whose priority changed since, are ranked at the next scan.
    """

    MIN_CANDIDATES = 4096

    def __init__(self):
        self._queues: dict[tuple[str, int], _Candidates] = {}
        self.scans = 0  # for tests and status

    def pick(self, table, node_id: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Up to n items for `node_id` to demote: (keys, offsets, generations)."""
        if n <= 0:
            return pick_demotions(table, node_id, 0)
        key = (table.name, node_id)
        q = self._queues.get(key)
        picked: list[np.ndarray] = []
        need, scanned = n, False
        while need > 0:
            if q is None or q.table is not table or q.pos >= len(q.ids):
                if scanned:
                    break
                q = self._queues[key] = self._scan(table, node_id, n)
                scanned = True
                if len(q.ids) == 0:
                    break
            ids = q.ids[q.pos:q.pos + need]
            seqs = q.seqs[q.pos:q.pos + need]
            q.pos += len(ids)
            ok = _demotable(table.store, ids, node_id)  # LIVE first: then in the core
            ok[ok] = table.core.sequences(ids[ok]) == seqs[ok]
            if scanned and picked:  # a new scan finds this call's picks again
                ok &= ~np.isin(ids, np.concatenate(picked))
            ids = ids[ok]
            picked.append(ids)
            need -= len(ids)
        ids = disk_order(table, np.concatenate(picked) if picked else np.empty(0, np.int64))
        loc = table.store.locations(ids)
        return loc["key"].copy(), loc["offset"].copy(), loc["generation"].copy()

    def _scan(self, table, node_id: int, n: int) -> _Candidates:
        s = table.store
        cand = np.flatnonzero(_demotable(s, slice(None), node_id))
        want = max(16 * n, self.MIN_CANDIDATES, len(cand) // 64)
        score = (table.core.priorities(cand) if table.sampler.kind == "prioritized"
                 else table.core.sequences(cand))
        if len(cand) > want:
            best = np.argpartition(score, want - 1)[:want]
            cand, score = cand[best], score[best]
        order = np.argsort(score, kind="stable")
        cand = cand[order]
        self.scans += 1
        return _Candidates(table, cand, table.core.sequences(cand))

    def forget(self, node_id: int | None = None, table: str | None = None) -> None:
        """Drop the candidates of a node that left or of a table deleted."""
        for key in [k for k in self._queues
                    if (node_id is None or k[1] == node_id) and (table is None or k[0] == table)]:
            del self._queues[key]


class _Candidates:
    __slots__ = ("table", "ids", "seqs", "pos")

    def __init__(self, table, ids: np.ndarray, seqs: np.ndarray):
        self.table, self.ids, self.seqs, self.pos = table, ids, seqs, 0


def disk_order(table, ids: np.ndarray) -> np.ndarray:
    """Records picked for demotion in the order the node writes them to disk:
    a table of slices' steps by (episode, position), so that an episode's
    steps demoted together follow each other on disk (its slices are read
    as one run each); other tables' as picked."""
    if table.slices is None or len(ids) < 2:
        return ids
    ids = np.ascontiguousarray(ids, np.int64)
    return ids[np.lexsort((table.slices.position(ids), table.slices.episode(ids)))]


def _demotable(s, rows, node_id: int) -> np.ndarray:
    """Which records of `rows` a node may demote: LIVE, hot, its own, unleased."""
    return ((s.state[rows] == LIVE) & (s.node[rows] == node_id) & (s.offset[rows] < COLD)
            & (s.leases[rows] == 0))


def cold_items(table) -> int:
    """Items of `table` on disk tiers now (`table_info`'s "cold")."""
    s = table.store
    return int(np.count_nonzero((s.state == LIVE) & (s.offset >= COLD)))


def apply_moves(table, node_id: int, keys, old_offsets, old_generations, new_offsets,
                new_generations) -> np.ndarray:
    """Move records whose items a node copied to another tier; which moves
    were taken (a bool per item)."""
    keys = np.ascontiguousarray(keys, np.uint64)
    ids = table.core.lookup(keys)
    taken = ids >= 0
    recs = np.where(taken, ids, 0)
    s = table.store
    taken &= ((s.state[recs] == LIVE) & (s.node[recs] == node_id)
              & (s.offset[recs] == old_offsets) & (s.generation[recs] == old_generations)
              & (s.leases[recs] == 0))
    moved = recs[taken]
    s.offset[moved] = np.asarray(new_offsets, np.uint64)[taken]
    s.generation[moved] = np.asarray(new_generations, np.uint64)[taken]
    if (s.offset[moved] >= COLD).any():
        table.may_hold_cold = True
    return taken


class Tiers:
    """Staging requests in flight, by id; one per control plane."""

    def __init__(self, members):
        self.members = members
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.staged_items = 0  # cold items served, for status and tests
        self.lost_items = 0

    async def stage(self, table, recs: np.ndarray, items: np.ndarray, lease) -> np.ndarray:
        """Have the nodes of the cold rows of `items` stage them; returns the
        locations to answer with. The extents are recorded on `lease`."""
        cold = np.flatnonzero(items["offset"] >= COLD)
        items = items.copy()
        jobs = []
        for node_id in np.unique(items["node"][cold]):
            rows = cold[items["node"][cold] == node_id]
            node = self.members.nodes.get(int(node_id))
            if node is None or not node.alive:
                raise NodeGone(f"storage node {node_id} left while a sample of table "
                               f"{table.name!r} waited for its cold items; sample again")
            req = next(self._ids)
            fut = asyncio.get_running_loop().create_future()
            self._waiting[req] = fut
            node.peer.push("stage", request=req, table=table.name,
                           slot_size=table.spec.slot_size, offsets=items["offset"][rows],
                           keys=items["key"][rows], generations=items["generation"][rows])
            jobs.append((int(node_id), req, rows, fut))
        lost = []
        try:
            for node_id, _req, rows, fut in jobs:
                try:
                    answer = await asyncio.wait_for(asyncio.shield(fut), STAGE_TIMEOUT)
                except asyncio.TimeoutError:
                    raise Timeout(f"storage node {node_id} did not stage {len(rows)} cold items "
                                  f"of table {table.name!r} within {STAGE_TIMEOUT:g} s; sample "
                                  "again (see the node's log)") from None
                if "error" in answer:
                    if answer.get("code") == "staging_full":  # typed: it says what to do
                        raise StagingFull(f"storage node {node_id}: {answer['error']}")
                    raise ConnectionFailed(f"storage node {node_id} could not stage "
                                           f"{len(rows)} cold items of table {table.name!r}: "
                                           f"{answer['error']}")
                lease.staged.extend((node_id, int(e)) for e in answer["extents"])
                items["offset"][rows] = answer["offsets"]
                bad = answer["statuses"] != 0
                # Where each cold record's copy is, while the lease holds it:
                # marked retired with the record if it is evicted meanwhile.
                lease.copies.append((np.asarray(recs[rows][~bad], np.int64), node_id,
                                     np.asarray(answer["offsets"], np.uint64)[~bad]))
                if bad.any():
                    lost.append(rows[bad])
        finally:
            for _, req, _, fut in jobs:
                self._waiting.pop(req, None)
                if not fut.done():  # never answered: an extent may come later, unrecorded
                    fut.cancel()
        if lost:
            rows = np.concatenate(lost)
            self.lost_items += len(rows)
            table.core.remove(recs[rows])
            table._retire(recs[rows], count_as_delete=False)  # leased: freed on release
            log.error("table %r: %d cold items could not be read back from their node's disk "
                      "tier (I/O error or a slot holding another item); they leave the table "
                      "and learners resample them", table.name, len(rows))
        self.staged_items += len(cold)
        return items

    def staged(self, node_id: int, f: dict) -> None:
        """A node's answer to a `stage` push."""
        fut = self._waiting.get(f["request"])
        if fut is None or fut.done():
            # The sample gave up on it: give the extent back at once.
            if f.get("extents"):
                self.unstage([(node_id, e) for e in f["extents"]])
            return
        if f.get("error"):
            fut.set_result({"error": f["error"], "code": f.get("code")})
        else:
            fut.set_result({"extents": f["extents"], "offsets": f["offsets"],
                            "statuses": f["statuses"].view(np.int32)})

    def unstage(self, extents) -> None:
        """Give staged extents back to their nodes (dead nodes are skipped)."""
        by_node: dict[int, list[int]] = {}
        for node_id, extent in extents:
            by_node.setdefault(node_id, []).append(extent)
        for node_id, starts in by_node.items():
            node = self.members.nodes.get(node_id)
            if node is not None and node.alive:
                node.peer.push("unstage", extents=np.asarray(starts, np.uint64))
