"""Leases: a sampled item's slot is not reused until the learner has read it.

A learner's sample takes one lease on every item of the batch; it releases
the lease with its next request (piggybacked) or explicitly, and a lease
that is never released expires after `timeout` seconds, so a learner that
dies cannot pin memory forever.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Lease:
    table: str
    recs: np.ndarray
    deadline: float


class Leases:
    """Outstanding leases by id."""

    def __init__(self, timeout: float, first_id: int = 1):
        """`first_id`: where lease ids start; each control-plane run starts
        elsewhere, so a lease id from before a restart never names a new lease."""
        self.timeout = timeout
        self._ids = itertools.count(first_id)
        self._leases: dict[int, Lease] = {}

    def grant(self, table: str, recs: np.ndarray, now: float | None = None) -> int:
        """A new lease id covering `recs` of `table`."""
        lid = next(self._ids)
        self._leases[lid] = Lease(table, recs, (now or time.monotonic()) + self.timeout)
        return lid

    def take(self, lease_ids) -> list[Lease]:
        """Remove and return the given leases (unknown ids are ignored: expired)."""
        out = []
        for lid in lease_ids:
            lease = self._leases.pop(lid, None) if isinstance(lid, int) else None
            if lease is not None:
                out.append(lease)
        return out

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = now or time.monotonic()
        gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        return self.take(gone)

    def __len__(self) -> int:
        return len(self._leases)
