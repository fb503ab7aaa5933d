"""A storage node's insert server (storage/inserts.py) around its
registration, with the control plane, the arena and the writer faked: a
batch's slots are committed with its registration, and freed only when it
was not registered."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
from helpers import turns_until

from distore_ucx.config.roles import NodeConfig
from distore_ucx.errors import NodeGone
from distore_ucx.metrics import NodeStats
from distore_ucx.storage.held_frees import HeldFrees
from distore_ucx.storage.inserts import InsertServer
from distore_ucx.storage.registrations import Registrations
from distore_ucx.storage.state import NodeState


class FakeArena:
    """Slots as a dict offset -> state, as storage/slots.py keeps them."""

    def __init__(self):
        self.slots: dict[int, str] = {}
        self.used_bytes = 0
        self._gen = 0

    def next_generations(self, k):
        self._gen += k
        return np.arange(self._gen - k + 1, self._gen + 1, dtype=np.uint64)

    def allocate(self, table, slot_size, k):
        start = len(self.slots)
        offsets = np.arange(start, start + k, dtype=np.uint64) * slot_size
        self.slots.update({int(o): "allocated" for o in offsets})
        return offsets

    def commit(self, table, offsets, keys, generations, priorities, steps):
        for o in offsets.tolist():
            assert self.slots[o] == "allocated"
            self.slots[o] = "live"

    def free(self, table, offsets, live_only=False):
        for o in np.asarray(offsets).tolist():
            if not live_only or self.slots[o] == "live":
                self.slots[o] = "free"


class FakeControl:
    """A control plane connection whose items_added replies the test releases."""

    name = "the control plane"

    def __init__(self):
        self.replies: list[asyncio.Future] = []
        self.closed = asyncio.Event()

    async def call(self, op, reply_timeout=None, **fields):
        assert op == "items_added"
        reply = asyncio.get_running_loop().create_future()
        self.replies.append(reply)
        return await reply


def server() -> tuple[InsertServer, FakeArena, FakeControl]:
    state = NodeState(NodeConfig(control="127.0.0.1:1"), "a")
    state.arena, state.node_id, state.control = FakeArena(), 1, FakeControl()
    state.joined.set()
    source = types.SimpleNamespace(name="a writer", via="mapped", mapping=object(), base=0)
    puller = types.SimpleNamespace(
        am_inbox=None, sources=lambda: types.SimpleNamespace(get=lambda peer, f: source),
        pulled_here=lambda *args: True)
    room = types.SimpleNamespace(allocate_now=state.arena.allocate)
    inserts = InsertServer(state, puller, room,
                           Registrations(state.used_bytes, state.commit_registered),
                           HeldFrees(lambda fields: None), NodeStats())
    return inserts, state.arena, state.control


def insert(k: int, first: int = 0) -> dict:
    keys = np.arange(first, first + k, dtype=np.uint64)
    return {"table": "t", "node_id": 1, "keys": keys, "item_bytes": 8, "slot_size": 64,
            "lengths": np.full(k, 8, np.uint64), "offsets": keys * 8,
            "priorities": np.ones(k), "timeout": 5.0}


def peer():
    return types.SimpleNamespace(state={"watched": True}, writer=None)



def test_a_registered_batch_is_committed_and_a_refused_one_freed():
    async def run():
        inserts, arena, control = server()
        first = asyncio.ensure_future(inserts.op_insert(peer(), insert(2)))
        await turns_until(lambda: len(control.replies) == 1, "the insert's items_added request")
        second = asyncio.ensure_future(inserts.op_insert(peer(), insert(3, 10)))
        await asyncio.sleep(0)
        control.replies[0].set_result({"evicted": 0})
        assert (await first)["n"] == 2
        await turns_until(lambda: len(control.replies) == 2, "the insert's items_added request")
        control.replies[1].set_result(
            {"evicted": 0, "errors": [[0, "node_gone", "storage node 1 was unresponsive"]]})
        with pytest.raises(NodeGone):
            await second
        assert arena.slots == {0: "live", 64: "live", 128: "free", 192: "free", 256: "free"}
        assert inserts.inserted == 2 and inserts.stats.failed_batches == 1

    asyncio.run(run())


def test_a_batch_cancelled_after_its_registration_keeps_its_committed_slots():
    # The writer's connection closed (its tasks are cancelled) in the turn
    # between the registration's reply and the insert's resumption: the
    # control plane holds the items, so their slots must stay LIVE (freeing
    # them left items registered in slots that the next insert reuses).
    async def run():
        inserts, arena, control = server()
        task = asyncio.ensure_future(inserts.op_insert(peer(), insert(2)))
        await turns_until(lambda: len(control.replies) == 1, "the insert's items_added request")
        control.replies[0].set_result({"evicted": 0})
        await asyncio.sleep(0)  # the registration settles: committed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert arena.slots == {0: "live", 64: "live"}
        assert inserts.stats.failed_batches == 0

    asyncio.run(run())
