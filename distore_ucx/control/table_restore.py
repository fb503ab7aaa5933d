"""One table's side of checkpoints and restores: its image in a checkpoint,
a table rebuilt from one, and the items its nodes re-send afterwards.

`Table` (tables.py) inherits `Restorable`, so a table is written, rebuilt
and refilled by its own methods; they are kept here, apart from the live
table's inserts, samples and leases. The restore as a whole (which tables
come back, when it ends) is restore.py; the checkpointed items awaiting
their nodes are pending.py; the file is checkpoint.py.
"""

from __future__ import annotations

import numpy as np

from ..protocol import STEP_FIELDS
from ..slot_format import COLD
from ..table_definition import TableDefinition
from .checkpoint import TableImage
from .evictions import Freed
from .items import LIVE, RETIRED
from .pending import Pending, survivors


class Restorable:
    """The checkpoint and restore methods of `Table`: they use its item
    store, table core, slice index and `pending` items (a restore in
    progress)."""

    def image(self) -> TableImage:
        """This table as a checkpoint holds it (each item with its insertion
        sequence, so the file needs no order).

        During a restore, checkpointed items that no node has re-sent yet
        are carried over, so that a second restart loses nothing, as many
        as fit beside the live items: the capacity bounds the image too.
        Those the remover would evict first are written as retired, so a
        node that re-sends them after a restart from this image frees them.
        Runs on the event loop: the keys and the other per-item values come
        from the table core, one native gather each.
        """
        s = self.store
        live = np.flatnonzero(s.state == LIVE)
        keys, seqs = self.core.keys(live), self.core.sequences(live)
        prios, times = self.core.priorities(live), self.core.times_sampled(live)
        retired = s.keys(s.state == RETIRED)
        p = self.pending
        if p is not None:
            left = np.flatnonzero(~p.claimed)
            keep = survivors(self.remover, p.priorities[left], p.sequences[left],
                             self.capacity - len(live), self._rng)
            over, left = left[~keep], left[keep]
            keys = np.concatenate([keys, p.keys[left]])
            prios = np.concatenate([prios, p.priorities[left]])
            times = np.concatenate([times, p.times_sampled[left]])
            seqs = np.concatenate([seqs, p.sequences[left]])
            retired = np.concatenate([retired, p.retired, p.keys[over]])
        steps = {}
        if self.slices is not None:  # each step's place in its episode, restored with it
            parts = [(self.slices.episode(live), self.slices.position(live),
                      self._step_flags[live])]
            if p is not None and p.steps is not None:
                parts.append(tuple(a[left] for a in p.steps))
            steps = {name: np.concatenate([part[i] for part in parts])
                     for i, name in enumerate(STEP_FIELDS)}
        return TableImage(self.definition.to_wire(), self.inserts, self.samples, self.deletes,
                          self.core.next_seq, keys, prios, times, seqs, retired, **steps)

    @classmethod
    def from_image(cls, image: TableImage, seed: int | None = None):
        """A table rebuilt from a checkpoint, empty until nodes re-send its items.

        A checkpoint holding more items than the capacity (written during a
        restore by an older release) gives back as many as the capacity,
        those the remover keeps; a node that re-sends one of the others
        frees it.
        """
        table = cls(TableDefinition.from_wire(image.definition), seed)
        table.inserts, table.samples, table.deletes = image.inserts, image.samples, image.deletes
        table.core.raise_next_seq(image.next_seq)
        keep = None
        if len(image.keys) > table.capacity:
            keep = survivors(table.remover, image.priorities, image.sequences, table.capacity,
                             table._rng)
        table.pending = Pending.from_image(image, keep)
        return table

    def restore_items(self, node: int, keys, offsets, generations,
                      priorities, steps: tuple | None = None) -> tuple[Freed, dict]:
        """Items a node re-sends after a control-plane restart: (slots to free, counts).

        A checkpointed key comes back with its checkpointed priority, use
        count and place in insertion order; a key that had left the table
        (retired while leased) or that the table already holds is freed on
        the node; any other key was inserted after the checkpoint and is
        taken as a new insert with the priority it was inserted with. In a
        table of slices, `steps` (each item's episode, position and flags,
        as the node kept them) places such a step in its episode.
        """
        keys = np.ascontiguousarray(keys, np.uint64)
        offsets = np.ascontiguousarray(offsets, np.uint64)
        generations = np.asarray(generations, np.uint64)
        priorities = np.ascontiguousarray(priorities, np.float64)
        if (offsets >= COLD).any():  # items on the node's disk tier come back cold
            self.may_hold_cold = True
        discard, keep_slot = self._copies_to_discard(node, keys, offsets)
        idx, back, new = self._sort_resent(keys, discard, steps)
        evicted = []
        if len(back):
            evicted.append(self._take_back(node, back, idx[back], keys, offsets, generations,
                                           steps))
        if len(new):
            evicted.append(self._adopt(node, new, keys, offsets, generations, priorities, steps))
        if evicted and self.slices is not None:
            self.slices.remove(np.concatenate(evicted))
        freed = self._retire(np.concatenate(evicted)) if evicted else Freed.empty()
        drop = discard.copy()
        drop[keep_slot] = False
        if drop.any():
            freed = freed + Freed(np.full(int(drop.sum()), node, np.uint32), offsets[drop])
        return freed, {"restored": len(back), "adopted": len(new), "discarded": int(drop.sum())}

    def _copies_to_discard(self, node: int, keys: np.ndarray,
                           offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which re-sent items are copies the table cannot take: a key a
        second time in the report, or a key the table holds already (by
        item); and which of those are the very slot the table points at,
        whose slot stays (their indices)."""
        discard = np.ones(len(keys), dtype=bool)
        discard[np.unique(keys, return_index=True)[1]] = False  # a key once per report
        ids = self.core.lookup(keys)
        held = ids >= 0
        if not held.any():
            return discard, np.empty(0, np.int64)
        # The table has these keys already: free the reported copy unless it
        # is the very slot the table points at.
        recs = ids[held]
        same = (self.store.node[recs] == node) & (self.store.offset[recs] == offsets[held])
        discard[held] = True
        return discard, np.flatnonzero(held)[same]

    def _sort_resent(self, keys: np.ndarray, discard: np.ndarray,
                     steps: tuple | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each re-sent item's index among the pending ones (-1: none), and
        which come back (`back`: checkpointed) and which are new (inserted
        after the checkpoint). Marks in `discard` what a retired key or an
        unplaceable step adds to it."""
        p = self.pending
        if p is not None:
            discard |= p.is_retired(keys)
            idx = p.find(keys)
            idx[discard] = -1
        else:
            idx = np.full(len(keys), -1, np.int64)
        back = np.flatnonzero(idx >= 0)
        new = np.flatnonzero((idx < 0) & ~discard)
        if self.slices is not None and steps is None:
            # A step whose episode and position are known neither here (a
            # file that kept no episodes, or inserted after the checkpoint)
            # nor from its node (a node of an older release): freed, never
            # sampled wrong (counted as discarded; the node logs it).
            if p is None or p.steps is None:
                discard[back], back = True, back[:0]
            discard[new], new = True, new[:0]
        return idx, back, new

    def _take_back(self, node: int, rows: np.ndarray, j: np.ndarray, keys, offsets,
                   generations, steps: tuple | None) -> np.ndarray:
        """Place checkpointed items (re-sent `rows`, pending rows `j`) as they
        were: their priority, use count and insertion sequence; what that
        evicted."""
        p = self.pending
        recs = self._place(node, keys[rows], offsets[rows], generations[rows])
        if self.slices is not None:
            self._add_steps(recs, tuple(a[j] for a in p.steps) if p.steps is not None
                            else tuple(np.asarray(a)[rows] for a in steps), p.priorities[j])
        evicted = self.core.restore(recs, keys[rows], p.priorities[j], p.times_sampled[j],
                                    p.sequences[j])
        p.claimed[j] = True
        return evicted

    def _adopt(self, node: int, rows: np.ndarray, keys, offsets, generations, priorities,
               steps: tuple | None) -> np.ndarray:
        """Insert re-sent `rows` the checkpoint does not know (inserted after
        it), as their node kept them; what that evicted."""
        recs = self._place(node, keys[rows], offsets[rows], generations[rows])
        if self.slices is not None:  # inserted after the checkpoint: as the node kept them
            self._add_steps(recs, tuple(np.asarray(a)[rows] for a in steps), priorities[rows])
        evicted = self.core.insert(recs, keys[rows], priorities[rows])
        self.inserts += len(rows)
        return evicted

    def end_restore(self) -> int:
        """Close a restore: checkpointed items no node re-sent are gone; their count."""
        p, self.pending = self.pending, None
        return 0 if p is None else p.unclaimed
