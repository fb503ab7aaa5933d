"""A replay table on the control plane: item records, sampler, remover.

This first version samples uniformly (with replacement, probability 1/size)
and evicts in FIFO order at capacity, as Reverb's Uniform sampler and Fifo
remover do. Every operation takes a whole batch and runs as numpy array
operations: no Python loop per item. Leases are counted per record: an
evicted record whose slot a learner is still reading stays RETIRED until its
last lease is released or expires, and only then is its slot freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..spec import TableSpec
from .items import FREE, LIVE, RETIRED, ItemStore

SAMPLERS = ("uniform",)
REMOVERS = ("fifo",)


@dataclass
class Freed:
    """Slots whose records left the control plane: (node ids, offsets)."""

    nodes: np.ndarray
    offsets: np.ndarray

    @classmethod
    def empty(cls) -> "Freed":
        return cls(np.empty(0, np.uint32), np.empty(0, np.uint64))

    def __add__(self, other: "Freed") -> "Freed":
        return Freed(
            np.concatenate([self.nodes, other.nodes]), np.concatenate([self.offsets, other.offsets])
        )


class _Fifo:
    """Record ids in insertion order; stale entries are skipped when popped."""

    def __init__(self, size: int):
        self.recs = np.empty(size, dtype=np.int64)
        self.seqs = np.empty(size, dtype=np.uint64)
        self.head = 0
        self.tail = 0

    def push(self, recs: np.ndarray, seqs: np.ndarray, store: ItemStore) -> None:
        if self.tail - self.head + len(recs) > len(self.recs):
            self._compact(store, len(recs))
        idx = (self.tail + np.arange(len(recs))) % len(self.recs)
        self.recs[idx] = recs
        self.seqs[idx] = seqs
        self.tail += len(recs)

    def pop_oldest(self, k: int, store: ItemStore) -> np.ndarray:
        out = []
        while k > 0 and self.head < self.tail:
            m = min(self.tail - self.head, 2 * k + 64)
            idx = (self.head + np.arange(m)) % len(self.recs)
            recs = self.recs[idx]
            valid = (store.state[recs] == LIVE) & (store.seq[recs] == self.seqs[idx])
            cum = np.cumsum(valid)
            if cum[-1] >= k:
                consumed = int(np.searchsorted(cum, k)) + 1
            else:
                consumed = m
            taken = recs[:consumed][valid[:consumed]]
            self.head += consumed
            out.append(taken)
            k -= len(taken)
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _compact(self, store: ItemStore, extra: int) -> None:
        idx = (self.head + np.arange(self.tail - self.head)) % len(self.recs)
        recs, seqs = self.recs[idx], self.seqs[idx]
        keep = (store.state[recs] == LIVE) & (store.seq[recs] == seqs)
        recs, seqs = recs[keep], seqs[keep]
        size = max(len(self.recs), 2 * (len(recs) + extra))
        self.recs = np.empty(size, dtype=np.int64)
        self.seqs = np.empty(size, dtype=np.uint64)
        self.recs[: len(recs)] = recs
        self.seqs[: len(seqs)] = seqs
        self.head, self.tail = 0, len(recs)


class Table:
    """One table: its spec, capacity, live items, sampler and remover."""

    def __init__(
        self,
        name: str,
        capacity: int,
        spec: TableSpec,
        sampler: str = "uniform",
        remover: str = "fifo",
        seed: int | None = None,
    ):
        if sampler not in SAMPLERS:
            raise ConfigError(f"table {name!r}: sampler {sampler!r} unknown (have {SAMPLERS})")
        if remover not in REMOVERS:
            raise ConfigError(f"table {name!r}: remover {remover!r} unknown (have {REMOVERS})")
        self.name = name
        self.capacity = capacity
        self.spec = spec
        self.sampler = sampler
        self.remover = remover
        self.store = ItemStore(min(capacity, 1 << 16) + 1024)
        self.live = np.empty(self.store.capacity, dtype=np.int64)
        self.size = 0
        self._fifo = _Fifo(min(capacity, 1 << 16) * 2 + 1024)
        self._seq = 0
        self._rng = np.random.default_rng(seed)
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    # -- inserts and evictions -------------------------------------------
    def add(self, node: int, keys, offsets, generations, priorities) -> Freed:
        """Make a batch of stored items sampleable; evict FIFO past capacity."""
        k = len(keys)
        recs = self.store.alloc(k)
        if len(self.live) < self.store.capacity:
            grown = np.empty(self.store.capacity, dtype=np.int64)
            grown[: self.size] = self.live[: self.size]
            self.live = grown
        s = self.store
        s.key[recs] = keys
        s.node[recs] = node
        s.offset[recs] = offsets
        s.generation[recs] = generations
        s.priority[recs] = priorities
        s.times_sampled[recs] = 0
        s.leases[recs] = 0
        s.state[recs] = LIVE
        seqs = self._seq + np.arange(k, dtype=np.uint64)
        self._seq += k
        s.seq[recs] = seqs
        s.live_pos[recs] = self.size + np.arange(k)
        self.live[self.size : self.size + k] = recs
        self.size += k
        self._fifo.push(recs, seqs, s)
        self.inserts += k
        excess = self.size - self.capacity
        if excess <= 0:
            return Freed.empty()
        return self._retire(self._fifo.pop_oldest(excess, s))

    def drop_node(self, node: int) -> int:
        """Take every item stored on `node` out of the table (the node died)."""
        s = self.store
        recs = self.live[: self.size][s.node[self.live[: self.size]] == node]
        self._retire(recs, count_as_delete=False)
        # Slots of a dead node are never freed there; forget them once unleased.
        dead = np.flatnonzero((s.state == RETIRED) & (s.node == node) & (s.leases == 0))
        s.release(dead)
        return len(recs)

    def _retire(self, recs: np.ndarray, count_as_delete: bool = True) -> Freed:
        """Take live records out of the table; free the unleased ones."""
        if len(recs) == 0:
            return Freed.empty()
        s = self.store
        pos = s.live_pos[recs]
        new_size = self.size - len(recs)
        s.live_pos[recs] = -1
        tail = self.live[new_size : self.size]
        movers = tail[s.live_pos[tail] >= 0]
        holes = pos[pos < new_size]
        self.live[holes] = movers
        s.live_pos[movers] = holes
        self.size = new_size
        if count_as_delete:
            self.deletes += len(recs)
        leased = s.leases[recs] > 0
        s.state[recs[leased]] = RETIRED
        unleased = recs[~leased]
        freed = Freed(s.node[unleased].copy(), s.offset[unleased].copy())
        s.release(unleased)
        return freed

    # -- sampling and leases ---------------------------------------------
    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n records drawn uniformly with replacement, and their probabilities."""
        if self.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        recs = self.live[self._rng.integers(0, self.size, n)]
        np.add.at(self.store.times_sampled, recs, 1)
        self.samples += n
        return recs, np.full(n, 1.0 / self.size)

    def lease(self, recs: np.ndarray) -> None:
        """Protect the records' slots from reuse until `unlease`."""
        np.add.at(self.store.leases, recs, 1)

    def unlease(self, recs: np.ndarray) -> Freed:
        """Drop one lease per record; frees RETIRED records left unleased."""
        s = self.store
        np.subtract.at(s.leases, recs, 1)
        done = np.unique(recs[(s.leases[recs] == 0) & (s.state[recs] == RETIRED)])
        freed = Freed(s.node[done].copy(), s.offset[done].copy())
        s.release(done)
        return freed

    def leased(self) -> int:
        """Records currently under at least one lease."""
        return int(np.count_nonzero(self.store.leases))

    def info(self) -> dict:
        """The table's state, as `client.table_info` returns it."""
        return {
            "name": self.name,
            "capacity": self.capacity,
            "size": self.size,
            "spec": self.spec.to_wire(),
            "item_bytes": self.spec.item_bytes,
            "slot_size": self.spec.slot_size,
            "sampler": self.sampler,
            "remover": self.remover,
            "inserts": self.inserts,
            "samples": self.samples,
            "deletes": self.deletes,
            "leased": self.leased(),
        }


__all__ = ["Table", "Freed", "SAMPLERS", "REMOVERS", "FREE", "LIVE", "RETIRED"]
