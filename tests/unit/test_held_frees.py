"""A storage node's frees from the control plane wait for the registrations
in flight when they came, so that a free never misses slots an insert has
not committed yet."""

from __future__ import annotations

from distore_ucx.storage.held_frees import HeldFrees


def test_a_free_with_no_registration_in_flight_is_applied_at_once():
    applied = []
    frees = HeldFrees(applied.append)
    frees.free({"n": 1})
    assert applied == [{"n": 1}]


def test_a_free_waits_for_the_registrations_in_flight_when_it_came():
    applied = []
    frees = HeldFrees(applied.append)
    a = frees.begin()
    frees.free({"n": 1})  # may name items of registration a
    b = frees.begin()  # began after the free: the free need not wait for it
    assert applied == []
    frees.end(a)
    assert applied == [{"n": 1}]
    frees.end(b)
    assert applied == [{"n": 1}]


def test_held_frees_are_applied_in_the_order_they_came():
    applied = []
    frees = HeldFrees(applied.append)
    a = frees.begin()
    frees.free({"n": 1})
    b = frees.begin()
    frees.free({"n": 2})  # waits for a and b
    frees.end(b)
    assert applied == []  # a is still in flight
    frees.end(a)
    assert applied == [{"n": 1}, {"n": 2}]
