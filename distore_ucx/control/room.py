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
their arenas (and disk tiers) leave after the other tables' items.
"""

from __future__ import annotations

import numpy as np

from ..storage.tier import COLD, stride_of  # loads no native code
from .items import FREE, LIVE


def pick_for_room(table, node_id: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Record ids of up to n of `table`'s LIVE, unleased, hot items on
    `node_id`, those its remover would evict first."""
    s = table.store
    cand = np.flatnonzero((s.state == LIVE) & (s.node == node_id) & (s.leases == 0)
                          & (s.offset < COLD))
    if n <= 0 or len(cand) == 0:
        return cand[:0]
    if len(cand) <= n:
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
        weight = table.core.priorities(cand) ** table.remover.alpha
        total = weight.sum()
        if total > 0 and np.count_nonzero(weight) >= n:
            return rng.choice(cand, n, replace=False, p=weight / total)
        score = rng.random(len(cand))
    else:  # uniform
        score = rng.random(len(cand))
    return cand[np.argpartition(score, n - 1)[:n]]


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
