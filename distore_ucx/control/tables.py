"""A replay table on the control plane: item records, selectors, limits.

Which item a sample returns and which leaves at capacity is decided by the
native TableCore (Reverb's selectors: uniform, prioritized with a sum tree,
FIFO, LIFO, min/max heap; `max_times_sampled`), one call per batch. This
module keeps where each item's bytes are and the leases on them: an item
evicted while a learner still reads its slot stays RETIRED until its last
lease is released or expires, and only then is its slot freed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from .._native_loader import _native
from ..errors import ConfigError
from ..spec import TableSpec
from .items import FREE, LIVE, RETIRED, ItemStore
from .rate_limiters import MinSize, RateLimiter
from .selectors import KINDS, Fifo, Selector, Uniform

# Selector names a table accepts, as sampler or as remover (config checks).
SAMPLERS = REMOVERS = KINDS


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


class Table:
    """One table: spec, capacity, selectors, rate limiter, item records."""

    def __init__(
        self,
        name: str,
        capacity: int,
        spec: TableSpec,
        sampler: Selector | None = None,
        remover: Selector | None = None,
        rate_limiter: RateLimiter | None = None,
        max_times_sampled: int = 0,
        seed: int | None = None,
    ):
        self.name = name
        self.capacity = capacity
        self.spec = spec
        limiter = rate_limiter or MinSize(1)
        if limiter.kind == "queue":
            # A queue hands out each item once, oldest first.
            sampler, remover = sampler or Fifo(), remover or Fifo()
            if sampler.kind != "fifo" or remover.kind != "fifo" or max_times_sampled not in (0, 1):
                raise ConfigError(
                    f"table {name!r}: a Queue rate limiter needs the Fifo sampler and remover "
                    "and max_times_sampled=1 (leave them unset)"
                )
            max_times_sampled = 1
            if capacity < limiter.max_diff:
                raise ConfigError(
                    f"table {name!r}: capacity {capacity} is smaller than the queue size "
                    f"{int(limiter.max_diff)}: items would be evicted before being sampled"
                )
        self.sampler = sampler or Uniform()
        self.remover = remover or Fifo()
        self.rate_limiter = limiter
        if not isinstance(max_times_sampled, int) or max_times_sampled < 0:
            raise ConfigError(f"max_times_sampled must be an integer >= 0, got {max_times_sampled}")
        self.max_times_sampled = max_times_sampled
        self.core = _native.TableCore(
            self.sampler.kind, self.sampler.alpha, self.remover.kind, self.remover.alpha,
            capacity, max_times_sampled, secrets.randbits(63) if seed is None else seed,
        )
        self.store = ItemStore(min(capacity, 1 << 16) + 1024)
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    @property
    def size(self) -> int:
        """Items in the table (sampleable)."""
        return self.core.size

    # -- inserts and evictions -------------------------------------------
    def add(self, node: int, keys, offsets, generations, priorities) -> Freed:
        """Make a batch of stored items sampleable; evicts by the remover at capacity."""
        recs = self.store.alloc(len(keys))
        s = self.store
        s.key[recs] = keys
        s.node[recs] = node
        s.offset[recs] = offsets
        s.generation[recs] = generations
        s.leases[recs] = 0
        s.state[recs] = LIVE
        evicted = self.core.insert(recs, np.ascontiguousarray(keys, np.uint64),
                                   np.ascontiguousarray(priorities, np.float64))
        self.inserts += len(keys)
        return self._retire(evicted)

    def drop_node(self, node: int) -> int:
        """Take every item stored on `node` out of the table (the node died)."""
        s = self.store
        recs = np.flatnonzero((s.state == LIVE) & (s.node == node))
        self.core.remove(recs)
        self._retire(recs, count_as_delete=False)
        # Slots of a dead node are never freed there; forget them once unleased.
        dead = np.flatnonzero((s.state == RETIRED) & (s.node == node) & (s.leases == 0))
        s.release(dead)
        return len(recs)

    def _retire(self, recs: np.ndarray, count_as_delete: bool = True) -> Freed:
        """Records that left the core: free the unleased, keep the leased RETIRED."""
        if len(recs) == 0:
            return Freed.empty()
        s = self.store
        if count_as_delete:
            self.deletes += len(recs)
        leased = s.leases[recs] > 0
        s.state[recs[leased]] = RETIRED
        unleased = recs[~leased]
        freed = Freed(s.node[unleased].copy(), s.offset[unleased].copy())
        s.release(unleased)
        return freed

    # -- sampling, priorities and leases ---------------------------------
    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray, Freed]:
        """Draw n records under leases: (records, probabilities, slots freed).

        Items that reach max_times_sampled leave the table; their slots are
        freed once the learner releases this lease.
        """
        recs, probs, exhausted = self.core.sample(n)
        self.samples += len(recs)
        self.lease(recs)
        return recs, probs, self._retire(exhausted)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        """Set priorities by key; returns how many keys were still in the table."""
        return self.core.update_priorities(
            np.ascontiguousarray(keys, np.uint64), np.ascontiguousarray(priorities, np.float64)
        )

    def lease(self, recs: np.ndarray) -> None:
        """Protect the records' slots from reuse until `unlease`."""
        _native.lease_add(self.store.leases, recs)

    def unlease(self, recs: np.ndarray) -> Freed:
        """Drop one lease per record; frees RETIRED records left unleased."""
        s = self.store
        done = _native.lease_release(s.leases, s.state, recs, RETIRED)
        if len(done) == 0:
            return Freed.empty()
        freed = Freed(s.node[done].copy(), s.offset[done].copy())
        s.release(done)
        return freed

    def leased(self) -> int:
        """Records currently under at least one lease."""
        return int(np.count_nonzero(self.store.leases))

    # -- rate limiting ---------------------------------------------------
    def can_insert(self, n: int) -> bool:
        """May a batch of n items be inserted now?"""
        return self.rate_limiter.can_insert(self.size, self.inserts, self.samples, n)

    def can_sample(self, n: int) -> bool:
        """May n items be sampled now (rate limiter, and enough uses left)?"""
        if self.size == 0:
            return False
        if self.max_times_sampled and self.core.remaining_uses < n:
            return False
        return self.rate_limiter.can_sample(self.size, self.inserts, self.samples, n)

    def limiter_state(self) -> dict:
        """The rate limiter's counters and thresholds."""
        return self.rate_limiter.state(self.size, self.inserts, self.samples)

    def info(self) -> dict:
        """The table's state, as `client.table_info` returns it."""
        return {
            "name": self.name,
            "capacity": self.capacity,
            "size": self.size,
            "spec": self.spec.to_wire(),
            "item_bytes": self.spec.item_bytes,
            "slot_size": self.spec.slot_size,
            "sampler": self.sampler.to_wire(),
            "remover": self.remover.to_wire(),
            "rate_limiter": self.rate_limiter.to_wire(),
            "rate_limiter_state": self.limiter_state(),
            "max_times_sampled": self.max_times_sampled,
            "inserts": self.inserts,
            "samples": self.samples,
            "deletes": self.deletes,
            "leased": self.leased(),
        }

    def definition(self) -> tuple:
        """What create_table must match for an existing table to be reused."""
        return (self.capacity, self.spec, self.sampler, self.remover, self.rate_limiter,
                self.max_times_sampled)


__all__ = ["Table", "Freed", "FREE", "LIVE", "RETIRED", "SAMPLERS", "REMOVERS"]
