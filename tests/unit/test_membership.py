"""Node states (live, unresponsive, gone) and what the control plane does
with inserts and samples of an unresponsive node, on a ControlPlane driven
directly (no processes)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from distore_ucx.config import ControlConfig
from distore_ucx.control.checkpoint import IdState
from distore_ucx.control.membership import GONE, LIVE, UNRESPONSIVE, Membership
from distore_ucx.control.server import ControlPlane
from distore_ucx.control.tables import Table
from distore_ucx.errors import InvalidRequest, NodeGone
from distore_ucx.spec import TableSpec


class FakePeer:
    """A connection as the control plane sees it: state, pushes recorded."""

    def __init__(self):
        self.state: dict = {}
        self.pushes: list = []

    def push(self, op, **fields):
        self.pushes.append((op, fields))

    def close(self):
        pass


def node_fields(i: int) -> dict:
    return dict(name=f"n{i}", host="127.0.0.1", port=1000 + i, worker_address=b"w",
                rkey=b"k", arena_base=0, arena_size=1 << 20, pid=100 + i)


def test_a_silent_node_is_unresponsive_then_live_again_or_gone_after_the_grace():
    members = Membership(heartbeat_timeout=2.0, ids=IdState(None), grace=10.0)
    node = members.register(FakePeer(), node_fields(1))
    t0 = node.last_seen
    assert members.silent(t0 + 1.9) == []
    assert members.silent(t0 + 2.1) == [node]
    members.unresponsive(node, t0 + 2.1)
    assert node.state == UNRESPONSIVE and node.alive and not node.live and node.epoch == 1
    assert members.away() == [node.node_id] and members.live() == [] and members.alive() == [node]
    assert members.expired(t0 + 12.0) == []
    # The control plane's own stall is not silence: it moves the grace too.
    members.credit(5.0)
    assert members.expired(t0 + 16.0) == []
    assert members.expired(t0 + 17.2) == [node]
    # A heartbeat within the grace: live again, same id, a new epoch kept.
    assert members.heartbeat(node.node_id, 123) is node
    assert node.state == LIVE and node.used_bytes == 123 and node.epoch == 1
    assert members.heartbeat(node.node_id, 124) is None  # already live
    node.state = GONE
    assert members.heartbeat(node.node_id, 1) is None and node.state == GONE
    assert node.describe(with_keys=False)["state"] == GONE


def plane(nodes: int = 1):
    cp = ControlPlane(ControlConfig(heartbeat_timeout=2.0, unresponsive_grace=60.0, seed=1))
    peers = [FakePeer() for _ in range(nodes)]
    found = [cp.members.register(p, node_fields(i)) for i, p in enumerate(peers)]
    cp.tables["t"] = Table.make("t", 1000, TableSpec.parse(((8,), "uint8")), seed=1)
    return cp, peers, found


def request(cp, peer, op: str, f: dict):
    """Answer one request as the control plane's server does."""
    return asyncio.run(cp.handle(peer, op, f))


def added(cp, peer, node, keys, offsets, **extra) -> dict:
    n = len(keys)
    return asyncio.run(cp.handle(peer, "items_added", dict(
        node_id=node.node_id, table="t", keys=np.array(keys, np.uint64),
        offsets=np.array(offsets, np.uint64), generations=np.ones(n, np.uint64),
        priorities=np.ones(n, np.float64), **extra)))


def test_a_key_the_table_holds_is_not_stored_twice():
    # A batch resent after its node went unresponsive, both copies arriving.
    cp, (pa, pb), (a, b) = plane(2)
    assert "duplicate_offsets" not in added(cp, pa, a, [1, 2, 3], [0, 64, 128])
    reply = added(cp, pb, b, [3, 4], [192, 256])
    assert reply["duplicate_offsets"].tolist() == [192]  # the node frees that slot
    assert cp.tables["t"].size == 4


def test_inserts_placed_before_a_node_was_unresponsive_are_refused():
    cp, (peer,), (node,) = plane()
    assert added(cp, peer, node, [1], [0], epoch=0)["evicted"] == 0
    cp.members.unresponsive(node)
    with pytest.raises(NodeGone):  # while unresponsive: the writer resends
        added(cp, peer, node, [2], [64])
    request(cp, peer, "heartbeat", {"node_id": node.node_id, "used_bytes": 64})
    assert node.state == LIVE
    with pytest.raises(NodeGone):  # placed in epoch 0: maybe resent elsewhere
        added(cp, peer, node, [3], [128], epoch=0)
    added(cp, peer, node, [4], [192], epoch=1)
    assert cp.tables["t"].size == 2


def test_samples_leave_out_items_of_unresponsive_nodes_and_they_stay():
    cp, (pa, pb), (a, b) = plane(2)
    added(cp, pa, a, range(100), np.arange(100) * 64)
    added(cp, pb, b, range(100, 200), np.arange(100) * 64)
    cp.members.unresponsive(a)
    for _ in range(20):
        reply = request(cp, pb, "sample", {"table": "t", "n": 64})
        assert set(reply["items"]["node"].tolist()) == {b.node_id}
        request(cp, pb, "release", {"leases": [reply["lease"]]})
    assert cp.tables["t"].size == 200 and cp.tables["t"].leased() == 0
    request(cp, pa, "heartbeat", {"node_id": a.node_id, "used_bytes": 0})
    reply = request(cp, pb, "sample", {"table": "t", "n": 256})
    assert set(reply["items"]["node"].tolist()) == {a.node_id, b.node_id}


def test_a_node_whose_event_loop_stopped_running_stops_heartbeating():
    # The heartbeat thread beats while the node's loop merely lags (a busy
    # host); a loop that has not run for LOOP_WEDGED s serves nothing, and
    # the node must then look unresponsive.
    from distore_ucx.config import NodeConfig
    from distore_ucx.storage.session import LOOP_WEDGED, ControlSession
    from distore_ucx.storage.state import NodeState

    state = NodeState(NodeConfig(control="127.0.0.1:1", arena_bytes=1 << 20), "a")
    session = ControlSession(state, None, dict, lambda: None, asyncio.Event())
    state.arena = type("A", (), {"used_bytes": 4096})()
    state.node_id = 7
    assert session.beat() is None  # not registered yet
    state.joined.set()
    session._loop_seen -= LOOP_WEDGED / 2  # late, not wedged
    assert session.beat() == {"node_id": 7, "used_bytes": 4096,
                              "beat_secret": session.beat_secret}
    session._loop_seen -= LOOP_WEDGED
    assert session.beat() is None
    session._loop_seen = time.monotonic()
    assert session.beat() is not None


def test_items_with_a_use_limit_are_not_used_up_by_routing_around():
    # With max_times_sampled a draw is a use: drawing again around an
    # unresponsive node would use up items that nobody receives.
    cp, (pa, pb), (a, b) = plane(2)
    cp.tables["t"] = Table.make("t", 1000, TableSpec.parse(((8,), "uint8")),
                                max_times_sampled=1, seed=1)
    added(cp, pa, a, range(100), np.arange(100) * 64)
    added(cp, pb, b, range(100, 200), np.arange(100) * 64)
    cp.members.unresponsive(a)
    got = 0
    for _ in range(2):
        reply = request(cp, pb, "sample", {"table": "t", "n": 64})
        got += len(reply["items"])
        request(cp, pb, "release", {"leases": [reply["lease"]]})
    assert cp.tables["t"].size == 200 - got


def test_a_node_that_registers_inserts_is_not_silent_while_its_heartbeat_is_late():
    members = Membership(heartbeat_timeout=2.0, ids=IdState(None), grace=10.0)
    node = members.register(FakePeer(), node_fields(1))
    node.last_seen -= 1.9
    members.heard(node.node_id)  # an items_added from it
    assert members.silent(time.monotonic() + 1.0) == []
    assert node.gap_max == 0.0  # a gap of heartbeats is still measured as such
    members.unresponsive(node)
    members.heard(node.node_id)  # does not make it live: only a heartbeat does
    assert node.state == UNRESPONSIVE


def test_only_the_node_beats_for_itself():
    # Heartbeats come on a connection of their own (storage/heartbeat.py):
    # one that is not the node's registration connection must carry the
    # secret the node registered with, or it changes nothing.
    cp, (peer, other), (node, _) = plane(2)
    node.beat_secret = b"s" * 16
    cp.members.unresponsive(node)
    with pytest.raises(InvalidRequest, match="not it"):
        request(cp, other, "heartbeat", {"node_id": node.node_id, "used_bytes": 0})
    with pytest.raises(InvalidRequest, match="not it"):
        request(cp, other, "heartbeat", {"node_id": node.node_id, "used_bytes": 0,
                                         "beat_secret": b"x" * 16})
    assert node.state != LIVE
    request(cp, other, "heartbeat", {"node_id": node.node_id, "used_bytes": 0,
                                     "beat_secret": b"s" * 16})
    assert node.state == LIVE


def test_a_slice_sample_wakes_an_insert_its_rate_limiter_holds():
    # A table of slices samples through its SliceIndex, not the core's draw:
    # the rate limiter's waiters must still be woken by it, or an insert that
    # waits for samples sits out its timeout.
    import distore_ucx as ds
    from distore_ucx.spec import TableSpec
    from distore_ucx.table_definition import TableDefinition

    cp, (peer,), (node,) = plane()
    cp.tables["s"] = Table(TableDefinition.make(
        "s", 1000, TableSpec.parse(((8,), "uint8")), slice_len=2,
        rate_limiter=ds.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=2,
                                            error_buffer=4.0)), seed=1)

    def steps(first, n):
        return dict(node_id=node.node_id, table="s",
                    keys=np.arange(first, first + n, dtype=np.uint64),
                    offsets=np.arange(first, first + n, dtype=np.uint64) * 64,
                    generations=np.ones(n, np.uint64), priorities=np.ones(n),
                    episodes=np.full(n, 1, np.uint64),
                    positions=np.arange(first, first + n, dtype=np.uint32),
                    step_flags=np.zeros(n, np.uint8), timeout=5.0)

    async def run():
        await cp.handle(peer, "items_added", steps(0, 6))  # up to the limiter's buffer
        held = asyncio.ensure_future(cp.handle(peer, "items_added", steps(6, 4)))
        await asyncio.sleep(0.05)
        assert not held.done(), "the limiter did not hold the insert"
        t0 = time.monotonic()
        await cp.handle(peer, "sample", {"table": "s", "n": 2 * 4})  # 4 slices
        await asyncio.wait_for(held, 2.0)
        return time.monotonic() - t0

    assert asyncio.run(run()) < 1.0


def batches(node, *sizes, first_key=1, **extra) -> dict:
    """One items_added carrying several inserts of these sizes (a node's
    coalesced registrations, storage/registrations.py)."""
    n = sum(sizes)
    keys = np.arange(first_key, first_key + n, dtype=np.uint64)
    return dict(node_id=node.node_id, table="t", keys=keys, offsets=keys * 64,
                generations=np.ones(n, np.uint64), priorities=np.ones(n),
                batches=list(sizes), **extra)


def test_several_inserts_in_one_request_are_added_and_refused_each_on_its_own():
    cp, (peer,), (node,) = plane()
    reply = request(cp, peer, "items_added", batches(node, 2, 3, 1))
    assert reply == {"evicted": 0} and cp.tables["t"].size == 6
    # One with a negative priority is refused alone; a key held already is
    # not stored twice, whichever insert of the request it is in.
    f = batches(node, 2, 2, 2, first_key=6)
    f["priorities"] = np.array([1, 1, 1, -1, 1, 1], np.float64)
    reply = request(cp, peer, "items_added", f)
    assert [e[:2] for e in reply["errors"]] == [[1, "invalid_request"]]
    assert "priorities must be >= 0" in reply["errors"][0][2]
    assert reply["duplicate_offsets"].tolist() == [6 * 64]  # key 6, in the first
    assert cp.tables["t"].size == 6 + 3  # keys 7, 10, 11
    assert (cp.tables["t"].core.lookup(np.array([8, 9], np.uint64)) < 0).all()


def test_an_insert_the_rate_limiter_holds_past_its_timeout_fails_alone():
    import distore_ucx as ds
    from distore_ucx.table_definition import TableDefinition

    cp, (peer,), (node,) = plane()
    cp.tables["t"] = Table(TableDefinition.make(
        "t", 1000, TableSpec.parse(((8,), "uint8")),
        rate_limiter=ds.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1,
                                            error_buffer=4.0)), seed=1)
    # The limiter admits 4 more inserts: the first two fit, the third (3
    # items) would pass its buffer and may not wait (timeout 0); the fourth
    # (1 item) still fits after it.
    reply = request(cp, peer, "items_added", batches(node, 1, 2, 3, 1, timeouts=[0, 0, 0, 5]))
    assert [e[:2] for e in reply["errors"]] == [[2, "rate_limiter_timeout"]]
    assert cp.tables["t"].size == 4
    # Malformed: sizes that do not add up to the keys, a timeout per insert missing.
    with pytest.raises(InvalidRequest, match="add up"):
        request(cp, peer, "items_added", {**batches(node, 1, 1, first_key=50), "batches": [1]})
    with pytest.raises(InvalidRequest, match="timeouts"):
        request(cp, peer, "items_added", batches(node, 1, 1, first_key=50, timeouts=[1]))


def test_a_request_of_several_inserts_from_a_node_not_live_is_refused_whole():
    cp, (peer,), (node,) = plane()
    cp.members.unresponsive(node)
    with pytest.raises(NodeGone):  # the node's inserts each fail, and are resent
        request(cp, peer, "items_added", batches(node, 1, 1))
    assert cp.tables["t"].size == 0


def test_a_writer_asks_one_nodes_state_and_an_unknown_id_is_live_to_it():
    # A writer waiting on a node asks for its state (not the whole status,
    # which hundreds of waiting writers made the control plane build twice a
    # second each); an id the control plane has not seen is a node that has
    # not re-joined a restarted control plane: it will, and register the batch.
    from distore_ucx.client.writer.connections import node_state

    cp, (peer,), (node,) = plane()

    class Client:
        def call(self, op, **f):
            return request(cp, peer, op, f)

    assert request(cp, peer, "node_state", {"node_id": node.node_id}) == {"state": LIVE}
    cp.members.unresponsive(node)
    assert node_state(Client(), node.node_id) == UNRESPONSIVE
    assert request(cp, peer, "node_state", {"node_id": 99}) == {"state": "unknown"}
    assert node_state(Client(), 99) == LIVE
