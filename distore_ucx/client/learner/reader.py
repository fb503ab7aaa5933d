"""Reading sampled batches into the learner's ring, one slot after another.

Each batch goes into the next slot of the ring (client/learner/ring.py):
the next reply of the sample stream, read by the gather. What a slot's
batch needs until it is handed out is kept with the slot: its items'
locations (their headers are re-checked at hand-out), each row's P_min
(a repaired row's weight), a table of slices' positions and flags, and,
for a batch the prefetch thread read ahead, its leases, held until the
batch is handed out so that an item evicted meanwhile keeps its slot
marked (client/learner/recheck.py).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ...protocol import ITEM_LOCATION
from .batch import Batch
from .weights import importance_weights


class BatchReader:
    """Reads batches into the ring's slots in turn (`read`), re-reads rows of
    one (`repair`), and holds each slot's locations, steps and leases."""

    def __init__(self, ring, stream, gather, peers, rows: int, slice_len: int):
        self._ring = ring
        self._stream = stream
        self._gather = gather
        self._peers = peers
        self._rows = rows
        self._slice_len = slice_len
        slots = len(ring)
        self.next_slot = 0  # the slot the next batch is read into
        self.locations: list = [None] * slots  # per ring slot: its items' locations
        # per ring slot, a table of slices: each row's (position, flags)
        self.steps: list = [None] * slots
        self._min_probs: list = [None] * slots  # per ring slot: each row's P_min
        # Per ring slot, while iterating: the (session, leases, deadline) of
        # each read into it (the batch, then any repair), held until it is
        # handed out (SampleStream.collect_leases), before the earliest
        # deadline.
        self._slot_leases: list[list] = [[] for _ in range(slots)]

    def read(self, wait: float, transfer_timeout: float, beta: float | None,
             hold: bool = False) -> tuple[int, Batch]:
        """Sample and read one batch into the next ring slot: (slot, batch),
        with importance weights for `beta` (None: none; the learner's, read
        at each call, as it may be annealed). `hold` (the prefetch thread):
        its leases are kept for the slot until the batch is handed out
        (`give_back_leases`), not released with the next request."""
        self._stream.starting()
        slot = self.next_slot
        self.next_slot = (self.next_slot + 1) % len(self._ring)
        self.give_back_leases(slot)  # a batch of this slot never handed out (an error)
        dest = self._ring.acquire(slot)
        n = self._rows
        keys = np.empty(n, np.uint64)
        probs = np.empty(n, np.float64)
        locs = self.locations[slot] = np.empty(n, ITEM_LOCATION)  # re-checked at hand-out
        # each row's reply's smallest probability (the weights' P_min)
        min_probs = self._min_probs[slot] = np.empty(n, np.float64)
        if hold:
            self._stream.collect_leases()  # and the deadline of the reply read
        try:
            reply, renewed = self._stream.next(wait)
            if renewed:
                # A new control-plane connection (it restarted, or the link
                # broke): a control plane that started afresh numbers nodes anew.
                self._peers.forget_all("the control-plane connection is new")
            steps = None
            if self._slice_len:
                steps = self.steps[slot] = (np.empty(n, np.uint32), np.empty(n, np.uint8))
            table_size = self._gather.read_rows(reply, self._gather.all_rows, dest, slot, keys,
                                                probs, min_probs, locs, wait,
                                                transfer_timeout, steps)
        finally:
            if hold:
                self._slot_leases[slot].append(self._stream.collected())
        self._ring.fill(slot, n)
        self._stream.read()
        weights = None
        if beta is not None:
            weights = importance_weights(probs, min_probs, beta)
        return slot, Batch(None, keys, probs, table_size, weights)

    def repair(self, slot: int, batch: Batch, rows: np.ndarray, wait: float,
               transfer_timeout: float, beta: float | None) -> Batch:
        """On the prefetch thread: resample `rows` of a batch it read ahead
        (their items were evicted since) into the same ring slot."""
        dest = self._ring.acquire(slot)
        min_probs = self._min_probs[slot]
        self._stream.collect_leases()  # the new rows' leases, held with the batch's
        try:
            batch.table_size = self._gather.reread_rows(rows, dest, slot, batch.keys,
                                                        batch.probabilities, min_probs,
                                                        self.locations[slot], wait,
                                                        transfer_timeout, self.steps[slot])
        finally:
            self._slot_leases[slot].append(self._stream.collected())
        self._ring.fill(slot, self._rows)
        if batch.weights is not None:
            batch.weights = importance_weights(batch.probabilities, min_probs, beta)
        return batch

    def leases_may_have_expired(self, slot: int) -> bool:
        """Whether the earliest lease held for `slot` is past its deadline."""
        return time.monotonic() >= min((d for _, _, d in self._slot_leases[slot]),
                                       default=math.inf)

    def give_back_leases(self, slot: int) -> None:
        """Release (with the next request) the leases held for ring slot `slot`."""
        held, self._slot_leases[slot] = self._slot_leases[slot], []
        for session, leases, _ in held:
            self._stream.give_back(session, leases)

    def give_back_all(self) -> None:
        """Release the leases held for every slot (batches read ahead, never
        handed out)."""
        for slot in range(len(self._slot_leases)):
            self.give_back_leases(slot)
