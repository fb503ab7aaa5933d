"""Making room in a full arena: a table evicts its own items, by its remover.

A table whose capacity needs more bytes than its nodes' arenas hold does
not fail once they fill: a node with no room for an insert into table T
asks the control plane to evict `n` of T's items stored on that node
(`evict`), chosen as T's remover chooses at capacity (Fifo: the oldest,
Lifo: the newest, MinHeap / MaxHeap: the lowest / highest priority,
Uniform: at random, Prioritized: at random by priority^alpha). Items under
a lease are skipped (their slots cannot be freed until the learner is
done), and a table never evicts another table's items: tables that share
arenas share them first come, first served, and a table keeps the space it
holds. The node frees the slots and takes them for the insert; only when
nothing could be evicted does the insert fail with StorageFull, naming the
tables that hold the space and the items under lease.

`fits` estimates how many items of a table the live nodes can hold: what
their arenas (and disk tiers) leave after the other tables' items;
`room_alone` how many they hold at most, were the table alone there (a
capacity beyond it never fits: control/catalog.py warns).
"""

from __future__ import annotations

import numpy as np

from ..slot_format import COLD, stride_of
from .items import FREE, LIVE


class Room:
    """Candidates to evict for room, found by one scan per (table, node)
    and handed out over many requests (as control/tiers.py Demotions do):
    a full arena asks for about one insert batch's worth at a time, and a
    scan of every record of a large table costs milliseconds. Each request
    takes the next candidates that still qualify (LIVE, hot, on that node,
    unleased, and the same item: its sequence unchanged) and scans again
    only when they run out, so the order is the scan's: items inserted, or
    re-prioritized, since are ranked at the next scan."""

    MIN_CANDIDATES = 4096

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._queues: dict[tuple[str, int], tuple] = {}  # -> (table, ids, sequences, [pos])
        self.scans = 0  # for tests and status

    def pick(self, table, node_id: int, n: int) -> np.ndarray:
        """Record ids of up to n items of `table` on `node_id` to evict."""
        key = (table.name, node_id)
        picked: list[np.ndarray] = []
        need, scanned = n, False
        while need > 0:
            q = self._queues.get(key)
            if q is None or q[0] is not table or q[3][0] >= len(q[1]):
                if scanned:
                    break
                cand = np.flatnonzero(_evictable(table.store, slice(None), node_id))
                want = max(16 * n, self.MIN_CANDIDATES, len(cand) // 64)
                ids = _ranked(table, cand, want, self.rng)
                q = self._queues[key] = (table, ids, table.core.sequences(ids), [0])
                self.scans += 1
                scanned = True
                if len(ids) == 0:
                    break
            _, ids, seqs, pos = q
            ids, seqs = ids[pos[0]:pos[0] + need], seqs[pos[0]:pos[0] + need]
            pos[0] += len(ids)
            ok = _evictable(table.store, ids, node_id)  # LIVE first: then in the core
            ok[ok] = table.core.sequences(ids[ok]) == seqs[ok]
            if scanned and picked:  # a new scan finds this call's picks again
                ok &= ~np.isin(ids, np.concatenate(picked))
            picked.append(ids[ok])
            need -= int(ok.sum())
        return np.concatenate(picked) if picked else np.empty(0, np.int64)


def _evictable(s, rows, node_id: int) -> np.ndarray:
    """Which records of `rows` may be evicted for room on `node_id`."""
    return ((s.state[rows] == LIVE) & (s.node[rows] == node_id) & (s.leases[rows] == 0)
            & (s.offset[rows] < COLD))


def _ranked(table, cand: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """The first n of `cand` in the order the table's remover evicts them."""
    if len(cand) == 0:
        return cand
    kind = table.remover.kind
    if kind in ("fifo", "lifo"):
        score = table.core.sequences(cand).astype(np.float64)
        if kind == "lifo":
            score = -score
    elif kind in ("min_heap", "max_heap"):
        score = table.core.priorities(cand)
        if kind == "max_heap":
            score = -score
    elif kind == "prioritized":
        # Weighted sampling without replacement (exponential races): an
        # item goes before others with probability by priority^alpha.
        weight = table.core.priorities(cand) ** table.remover.alpha
        with np.errstate(divide="ignore"):
            score = rng.exponential(size=len(cand)) / weight
    else:  # uniform
        score = rng.random(len(cand))
    if len(cand) > n:
        best = np.argpartition(score, n - 1)[:n]
        cand, score = cand[best], score[best]
    return cand[np.argsort(score, kind="stable")]


def fits(table, tables, nodes) -> int:
    """How many items of `table` the live `nodes` can hold at most, given
    the space the other `tables`' items take there (and the capacity)."""
    slot = table.spec.slot_size
    ids = [node.node_id for node in nodes]
    held = np.zeros(len(ids), np.int64)  # bytes other tables' items take on each node
    for other in tables:
        if other is not table:
            s = other.store
            per_node = np.bincount(s.node[s.state != FREE].astype(np.int64),
                                   minlength=max(ids, default=0) + 1)
            held += per_node[ids] * other.spec.slot_size
    total = 0
    for node, other_bytes in zip(nodes, held.tolist()):
        room = node.arena_size + node.disk_size // stride_of(slot) * slot - other_bytes
        total += max(0, room) // slot
    return min(table.capacity, total)


def room_alone(slot_size: int, nodes) -> tuple[int, int, str]:
    """What the `nodes` hold of one table's `slot_size`-byte slots, were it
    alone there: (slots, bytes, "arenas" or "arenas and disk tiers")."""
    # A node's disk tier holds items too (in 4 KiB-rounded slots).
    spaces = [n.arena_size + n.disk_size // stride_of(slot_size) * slot_size for n in nodes]
    where = "arenas and disk tiers" if any(n.disk_size for n in nodes) else "arenas"
    return sum(a // slot_size for a in spaces), sum(spaces), where
