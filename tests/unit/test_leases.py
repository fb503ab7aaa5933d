"""Leases: unguessable ids, owned by the connection that took them."""

from __future__ import annotations

import numpy as np

from distore_ucx.control.leases import ID_BITS, LeaseIds, Leases


def test_ids_never_repeat_and_are_not_sequential():
    ids = LeaseIds(b"k" * 16)
    got = [ids.next() for _ in range(50_000)]
    assert len(set(got)) == len(got)
    assert all(0 < i <= 1 << ID_BITS for i in got)
    # Neighbours of an id are not ids: guessing around one's own lease finds nothing.
    gaps = np.diff(np.array(got, dtype=np.int64))
    assert (np.abs(gaps) > 1 << 32).mean() > 0.99
    # A run with another key (a restarted control plane) gives other ids.
    other = {LeaseIds(b"j" * 16).next() for _ in range(50_000)}
    assert not other & set(got)


def test_ids_use_all_their_bits():
    got = np.array([LeaseIds().next() for _ in range(2000)], dtype=np.uint64)
    ones = [(got >> np.uint64(b) & np.uint64(1)).mean() for b in range(ID_BITS)]
    assert 0.4 < min(ones) and max(ones) < 0.6


def test_only_the_owner_releases():
    leases = Leases(timeout=5.0)
    victim, attacker = object(), object()
    mine = leases.grant("t", np.arange(3), victim, now=100.0)
    theirs = leases.grant("t", np.arange(2), attacker, now=100.0)
    assert leases.held(victim) == 3 and leases.held(attacker) == 2
    got, refused = leases.take([mine, theirs, mine + 1, "x", True], attacker)
    assert [lease.recs.tolist() for lease in got] == [[0, 1]]
    assert refused == 1 and leases.refused == 1
    assert leases.held(victim) == 3 and leases.held(attacker) == 0
    got, refused = leases.take([mine], victim)
    assert len(got) == 1 and refused == 0 and leases.held(victim) == 0
    assert len(leases) == 0


def test_expired_leases_leave_their_owners_counts():
    leases = Leases(timeout=5.0)
    owner = object()
    leases.grant("t", np.arange(4), owner, now=100.0)
    b = leases.grant("t", np.arange(6), owner, now=103.0)
    assert leases.held(owner) == 10
    assert len(leases.expired(now=105.5)) == 1
    assert leases.held(owner) == 6
    assert leases.take([b], owner)[0][0].recs.tolist() == list(range(6))
    assert leases.held(owner) == 0
