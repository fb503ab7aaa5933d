"""A replay table on the control plane: item records, selectors, limits.

Which item a sample returns and which leaves at capacity is decided by the
native TableCore (Reverb's selectors: uniform, prioritized with a sum tree,
FIFO, LIFO, min/max heap; `max_times_sampled`), one call per batch. This
module keeps where each item's bytes are and the leases on them: an item
evicted while a learner still reads its slot stays RETIRED until its last
lease is released or expires, and only then is its slot freed.

A table of slices (`slice_len` > 0) holds steps of episodes as its items;
the native SliceIndex keeps each step's episode and position and the set
of valid slice starts, up to date as steps come and go, and draws starts
from it (uniformly or by the start step's priority); a sample is each
slice's steps in order, all leased (docs/semantics.md, "Slices").
"""

from __future__ import annotations

import secrets

import numpy as np

from .. import _tables
from ..errors import InvalidRequest
from ..metrics import TableStats
from ..protocol import STEP_LAST, STEP_PAD
from ..rate_limiters import RateLimiter
from ..selectors import KINDS, Selector
from ..table_definition import SLICE_PADS, TableDefinition
from .evictions import Evicted, Freed, Retired
from .items import FREE, LIVE, RETIRED, ItemStore
from .pending import Pending
from .table_restore import Restorable


class Table(Restorable):
    """One table: its definition (spec, capacity, selectors, rate limiter) and
    its item records. Its checkpoint image and restore are table_restore.py's."""

    def __init__(self, definition: TableDefinition, seed: int | None = None):
        self.definition = definition
        self.name = definition.name
        self.capacity = definition.capacity
        self.spec = definition.spec
        self.sampler = definition.sampler
        self.remover = definition.remover
        self.rate_limiter = definition.rate_limiter
        self.max_times_sampled = definition.max_times_sampled
        # A table of slices draws from its SliceIndex, never from the core's
        # sampler: the core has none (no memory a step).
        core_sampler = (_tables.NO_SAMPLER if definition.slices
                        else KINDS.index(self.sampler.kind))
        self.core = _tables.TableCore(
            core_sampler, self.sampler.alpha,
            KINDS.index(self.remover.kind), self.remover.alpha,
            self.capacity, self.max_times_sampled,
            secrets.randbits(63) if seed is None else seed,
        )
        # Records beyond the capacity hold items evicted while leased.
        self.store = ItemStore(min(self.capacity, 1 << 16) + 1024,
                               limit=self.capacity + min(self.capacity // 16, 1 << 20) + 1024,
                               keys=self.core)
        self.inserts = 0
        self.samples = 0
        self.slice_len = definition.slice_len
        self.slices = None  # a table of slices: its native SliceIndex
        self._step_flags = np.zeros(0, np.uint8)  # by record: bit 0, it ends its episode
        if definition.slices:
            self.slices = _tables.SliceIndex(
                definition.slice_len, definition.slice_period,
                prioritized=self.sampler.kind == "prioritized", alpha=self.sampler.alpha,
                seed=secrets.randbits(63) if seed is None else seed + 1,
                pad=SLICE_PADS.index(definition.slice_pad))
        self.deletes = 0
        self.stats = TableStats()  # read by the metrics collector at scrape time
        self.pending: Pending | None = None  # a restore from a checkpoint in progress
        # Set once any item of this table has been on a disk tier (demoted or
        # restored cold); never cleared. Its samples then ask one batch per
        # request: nodes' staging areas are sized for three batches of cold
        # items per learner (control/sampling.py).
        self.may_hold_cold = False
        # Picks which checkpointed items a random remover drops at capacity
        # (restores only; `survivors`).
        self._rng = np.random.default_rng(seed)

    @classmethod
    def make(cls, name: str, capacity: int, spec, sampler: Selector | None = None,
             remover: Selector | None = None, rate_limiter: RateLimiter | None = None,
             max_times_sampled: int = 0, seed: int | None = None) -> Table:
        """A table from the parts of its definition (TableDefinition.make checks them)."""
        return cls(TableDefinition.make(name, capacity, spec, sampler, remover, rate_limiter,
                                        max_times_sampled), seed)

    @property
    def size(self) -> int:
        """Items in the table (sampleable)."""
        return self.core.size

    @property
    def sampleable(self) -> int:
        """What a sample draws from: items, or a table of slices' valid starts."""
        return self.size if self.slices is None else self.slices.valid_starts

    @property
    def min_probability(self) -> float:
        """The smallest probability the sampler can draw an item with now
        (0 when empty): importance weights are (P(i) / this)^-beta, so the
        least likely item in the table weighs 1, as in TorchRL's buffers."""
        if self.slices is not None:
            return self.slices.min_probability
        return self.core.min_probability

    # -- inserts and evictions -------------------------------------------
    def add(self, node: int, keys, offsets, generations, priorities,
            steps: tuple | None = None) -> Evicted:
        """Make a batch of stored items sampleable; evicts by the remover at
        capacity and returns what it evicted: slots to free, and leased
        items to mark retired (Evicted). A table of slices takes `steps`:
        each item's (episode, position, flags) arrays (InvalidRequest
        without them, or with them for a table of items)."""
        self._check_steps(len(keys), steps)
        keys = np.ascontiguousarray(keys, np.uint64)
        if self.pending is not None:
            # A batch whose acknowledgement the old control plane never sent:
            # it is here now, so its checkpointed copy must not come back too.
            idx = self.pending.find(keys)
            self.pending.claimed[idx[idx >= 0]] = True
        recs = self._place(node, keys, offsets, generations)
        priorities = np.ascontiguousarray(priorities, np.float64)
        if self.slices is not None:
            self._add_steps(recs, steps, priorities)
        evicted = self.core.insert(recs, keys, priorities)
        if self.slices is not None:
            # The steps evicted (of this batch too, when it is larger than
            # the room left) end the slices through them.
            self.slices.remove(evicted)
        self.inserts += len(keys)
        leased = self._leased(evicted)
        return Evicted(self._retire(evicted), leased)

    def _check_steps(self, n: int, steps: tuple | None) -> None:
        """Steps of episodes go to a table of slices, and only there."""
        if self.slices is None and steps is not None:
            raise InvalidRequest(f"table {self.name!r} holds items, not steps of episodes: "
                                 "insert them with writer.insert, not writer.append")
        if self.slices is not None:
            if steps is None:
                raise InvalidRequest(
                    f"table {self.name!r} holds steps of episodes sampled as slices of "
                    f"{self.slice_len}: add them with writer.append(table, steps, env=...), "
                    "not writer.insert")
            if any(len(a) != n for a in steps):
                raise InvalidRequest(f"table {self.name!r}: episodes, positions and step_flags "
                                     f"must give one value per item ({n})")

    def _add_steps(self, recs: np.ndarray, steps: tuple, priorities: np.ndarray) -> None:
        """Put new records in the SliceIndex with their (episode, position, flags)."""
        episodes, positions, flags = steps
        flags = np.ascontiguousarray(flags, np.uint8) & STEP_LAST
        self.slices.add(recs, np.ascontiguousarray(episodes, np.uint64),
                        np.ascontiguousarray(positions, np.uint32), priorities, flags)
        self._set_flags(recs, flags)

    def _set_flags(self, recs: np.ndarray, flags) -> None:
        """Record the steps' flags by record id (grown with the item store)."""
        if len(self._step_flags) < self.store.capacity:
            grown = np.zeros(self.store.capacity, np.uint8)
            grown[:len(self._step_flags)] = self._step_flags
            self._step_flags = grown
        self._step_flags[recs] = flags & STEP_LAST  # STEP_PAD is a sample row's

    def _leased(self, recs: np.ndarray) -> Retired:
        """Where those of `recs` that a learner holds a lease on are."""
        s = self.store
        held = recs[s.leases[recs] > 0]
        return Retired(s.node[held].copy(), s.offset[held].copy(), s.generation[held].copy(),
                       np.asarray(held, np.int64))

    def _place(self, node: int, keys, offsets, generations) -> np.ndarray:
        """New LIVE records for items stored at (node, offsets); their ids."""
        recs = self.store.alloc(len(keys))
        s = self.store
        s.set_keys(recs, keys)  # the core takes them at insert
        s.node[recs] = node
        s.offset[recs] = offsets
        s.generation[recs] = generations
        s.leases[recs] = 0
        s.state[recs] = LIVE
        return recs

    def evict(self, recs: np.ndarray) -> Freed:
        """Take LIVE records out of the table as its remover would (counted
        as deletes): to make room in a full arena (control/room.py)."""
        self.core.remove(recs)
        if self.slices is not None:
            self.slices.remove(recs)
        return self._retire(recs)

    def drop_node(self, node: int) -> int:
        """Take every item stored on `node` out of the table (the node died)."""
        s = self.store
        recs = np.flatnonzero((s.state == LIVE) & (s.node == node))
        self.core.remove(recs)
        if self.slices is not None:  # slices through its steps are no longer drawn
            self.slices.remove(recs)
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

    def sample_slices(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Draw n // slice_len slices under leases: (the slices' steps'
        records in order, each row's probability (its slice start's draw),
        each row's position in its episode, each row's flags). `samples`
        counts slices. A short slice (slice_pad) repeats its last step up to
        slice_len rows, the repeats flagged STEP_PAD."""
        starts, probs = self.slices.sample(n // self.slice_len)
        if self.slices.pad:
            recs, lengths = self.slices.expand_lengths(starts)
        else:
            recs, lengths = self.slices.expand(starts), None
        self.samples += len(starts)
        self.lease(recs)
        flags = self._step_flags[recs]
        if lengths is not None:
            padded = np.arange(self.slice_len) >= lengths.astype(np.int64)[:, None]
            flags[padded.ravel()] |= STEP_PAD
        return (recs, np.repeat(probs, self.slice_len), self.slices.position(recs), flags)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        """Set priorities by key; returns how many keys were still in the table."""
        keys = np.ascontiguousarray(keys, np.uint64)
        priorities = np.ascontiguousarray(priorities, np.float64)
        updated = self.core.update_priorities(keys, priorities)
        if self.slices is not None:
            # A slice's key is its start step's: its draw weight follows.
            ids = self.core.lookup(keys)
            known = ids >= 0
            self.slices.set_priorities(ids[known], priorities[known])
        self.stats.priority_updates += updated  # metrics: once per request
        self.stats.priority_missing += len(keys) - updated
        return updated

    def locations(self, recs: np.ndarray) -> np.ndarray:
        """Where records `recs` are, as protocol.ITEM_LOCATION records (a sample
        reply's "items")."""
        return self.store.locations(recs)

    def lease(self, recs: np.ndarray) -> None:
        """Protect the records' slots from reuse until `unlease`."""
        _tables.lease_add(self.store.cols["leases"], recs)

    def unlease(self, recs: np.ndarray) -> Freed:
        """Drop one lease per record; frees RETIRED records left unleased."""
        s = self.store
        done = _tables.lease_release(s.cols["leases"], s.cols["state"], recs, RETIRED)
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
        if self.size == 0 or self.sampleable == 0:
            return False
        if self.slices is not None:  # rows of slices: the rate limiter counts slices
            n = max(1, n // self.slice_len)
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
            **({"slice_len": self.slice_len, "slice_period": self.definition.slice_period,
                "slice_pad": self.definition.slice_pad,
                "valid_starts": self.slices.valid_starts} if self.slices is not None else {}),
            "inserts": self.inserts,
            "samples": self.samples,
            "deletes": self.deletes,
            "leased": self.leased(),
            "awaiting_restore": 0 if self.pending is None else self.pending.unclaimed,
        }


# Freed, Retired and Evicted (evictions.py) are what a table's methods return:
# importable from here with it.
__all__ = ["Table", "Freed", "Retired", "Evicted", "FREE", "LIVE", "RETIRED"]
