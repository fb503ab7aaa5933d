"""Leases: a sampled item's slot is not reused until the learner has read it.

A learner's sample takes one lease on every item of the batch; it releases
the lease with its next request (piggybacked) or explicitly, and a lease
that is never released expires after `timeout` seconds, so a learner that
dies cannot pin memory forever.

A lease belongs to the connection that took it. Its id is unguessable (a
keyed permutation of a counter, so ids never repeat within a run, and each
run draws a new key), and only its owner may release it: another
connection's release of it is refused and counted, and the lease stays.
When a connection closes its leases are *not* released: its reads may still
be in flight over UCX, so they expire normally.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..slot_format import COLD

ID_BITS = 62  # lease ids are in [1, 2**62]: they fit msgpack's and numpy's int64
_HALF = ID_BITS // 2
_MASK = (1 << _HALF) - 1


class LeaseIds:
    """Lease ids in [1, 2**62]: unguessable, and never repeated by one instance.

    The n-th id is 1 + a 4-round Feistel permutation of n over 62 bits,
    keyed by 128 random bits (BLAKE2b as the round function). Knowing some
    ids tells nothing about the others without the key; a new instance (a
    restarted control plane) draws a new key, so an old id names a new lease
    only by a 2**-62 chance, and even then the new lease's owner is another
    connection.
    """

    def __init__(self, key: bytes | None = None):
        key = key or secrets.token_bytes(16)
        self._rounds = [hashlib.blake2b(key=key, digest_size=8, person=b"lease%d" % i)
                        for i in range(4)]
        self._n = 0

    def _permute(self, x: int) -> int:
        left, right = x >> _HALF, x & _MASK
        for keyed in self._rounds:
            h = keyed.copy()
            h.update(right.to_bytes(4, "little"))
            left, right = right, left ^ (int.from_bytes(h.digest(), "little") & _MASK)
        return left << _HALF | right

    def next(self) -> int:
        """The next id."""
        self._n += 1
        return self._permute(self._n) + 1


@dataclass
class Lease:
    table: str
    recs: np.ndarray
    deadline: float
    owner: Any = None  # the connection (rpc.Peer) that took it
    # (node id, extent) of staged cold items this lease covers (control/tiers.py)
    staged: list = field(default_factory=list)
    # (records, node id, offsets) of the copies staged for its cold items:
    # marked retired with the records if they are evicted (staged_copies)
    copies: list = field(default_factory=list)


class Leases:
    """Outstanding leases by id, with their owners and per-owner item counts."""

    def __init__(self, timeout: float, key: bytes | None = None):
        """`key`: the id permutation's key (random by default; tests fix it)."""
        self.timeout = timeout
        self._ids = LeaseIds(key)
        self._leases: dict[int, Lease] = {}
        self._held: dict[Any, int] = {}  # owner -> leased items outstanding
        self.refused = 0  # releases of another connection's lease, refused

    def grant(self, table: str, recs: np.ndarray, owner: Any = None,
              now: float | None = None) -> int:
        """A new lease id covering `recs` of `table`, owned by `owner`."""
        lid = self._ids.next()
        self._leases[lid] = Lease(table, recs, (now or time.monotonic()) + self.timeout, owner)
        self._held[owner] = self._held.get(owner, 0) + len(recs)
        return lid

    def get(self, lid: int) -> Lease | None:
        """The outstanding lease `lid`, or None (released or expired)."""
        return self._leases.get(lid)

    def held(self, owner: Any) -> int:
        """Leased items `owner` holds now."""
        return self._held.get(owner, 0)

    def _drop(self, lid: int) -> Lease:
        lease = self._leases.pop(lid)
        left = self._held[lease.owner] - len(lease.recs)
        if left:
            self._held[lease.owner] = left
        else:
            del self._held[lease.owner]
        return lease

    def take(self, lease_ids, owner: Any = None) -> tuple[list[Lease], int]:
        """Remove and return `owner`'s leases among the given ids, and how many
        ids named another owner's lease (refused: those leases stay). Unknown
        ids are ignored (expired, or from before a restart)."""
        out, refused = [], 0
        for lid in lease_ids:
            if not isinstance(lid, int) or isinstance(lid, bool):
                continue
            lease = self._leases.get(lid)
            if lease is None:
                continue
            if lease.owner is not owner:
                refused += 1
                continue
            out.append(self._drop(lid))
        self.refused += refused
        return out, refused

    def staged_copies(self, table: str, retired):
        """The copies staged for leases of `table` of the cold records among
        `retired` (evictions.Retired), as Retired rows at their staging offsets
        with the records' generations: a learner that read one ahead reads
        it there, not from the disk slot, so that is what must be marked
        (control/retirements.py). Only leases with staged copies are looked
        at: a table without a disk tier costs nothing here."""
        cold = retired.offsets >= COLD
        if not cold.any():
            return type(retired).empty()
        recs, gens = retired.recs[cold], retired.generations[cold]
        order = np.argsort(recs)
        ranked = recs[order]
        out = type(retired).empty()
        for lease in self._leases.values():
            if lease.table != table:
                continue
            for copy_recs, node_id, offsets in lease.copies:
                hit = np.isin(copy_recs, recs)
                if hit.any():
                    which = order[np.searchsorted(ranked, copy_recs[hit])]
                    out = out + type(retired)(np.full(len(which), node_id, np.uint32),
                                              offsets[hit], gens[which], copy_recs[hit])
        return out

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = now or time.monotonic()
        gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        return [self._drop(lid) for lid in gone]

    def __len__(self) -> int:
        return len(self._leases)
