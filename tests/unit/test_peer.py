"""Per-connection state (transport/peer.py): typed fields, and the dict-style
access the roles' code uses reaching the same fields."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from distore_ucx.transport.peer import PeerState


def test_fields_start_absent_and_read_as_the_dict_did():
    s = PeerState()
    assert not s.authenticated
    assert s.get("node_id") is None and s.get("verified_pid") is None
    assert s.get("leases_refused", 0) == 0 and not s.get("refusal_logged")
    s["node_id"] = 7
    assert s.node_id == 7 and s.get("node_id") == 7 and s["node_id"] == 7


def test_setdefault_and_pop_keep_dict_semantics():
    s = PeerState()
    s.setdefault("writer_ids", set()).add(3)
    assert s.writer_ids == {3}
    cache = s["sources"] = OrderedDict()
    s["worker_addresses"] = {b"w"}
    assert s.pop("sources", None) is cache and s.sources is None
    assert s.pop("worker_addresses", ()) == {b"w"}
    assert s.pop("worker_addresses", ()) == ()  # gone now: the default
    with pytest.raises(KeyError):
        s.pop("worker_addresses")
    with pytest.raises(KeyError):
        s["sources"]  # noqa: B018 - absent, as a dict's missing key


def test_an_undeclared_name_is_refused():
    s = PeerState()
    with pytest.raises(KeyError, match="declare it"):
        s.get("typo")
    with pytest.raises(KeyError, match="declare it"):
        s["typo"] = 1
    with pytest.raises(AttributeError):
        s.typo = 1
