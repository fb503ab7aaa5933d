"""Request routing (transport/dispatch.py): every operation the control
plane serves has one handler, and an unknown one is refused saying so."""

from __future__ import annotations

import asyncio

import pytest

from distore_ucx.config import ControlConfig
from distore_ucx.control.server import ControlPlane
from distore_ucx.errors import InvalidRequest
from distore_ucx.transport.dispatch import Dispatcher

SERVED = {
    # writers and learners
    "register_writer", "create_table", "table_info", "list_tables", "nodes", "node_state",
    "sample",
    "release", "update_priorities", "status", "checkpoint",
    # storage nodes
    "register_node", "heartbeat", "deregister_node", "items_added", "items_restored",
    "items_resent", "demote", "items_moved", "staged", "evict", "retired",
}


def test_the_control_plane_routes_every_operation_it_serves():
    assert set(ControlPlane(ControlConfig()).dispatch.routes) == SERVED


def test_an_unknown_operation_is_refused():
    plane = ControlPlane(ControlConfig())
    with pytest.raises(InvalidRequest, match="the control plane does not serve 'insert'"):
        asyncio.run(plane.handle(None, "insert", {}))


def test_plain_and_async_handlers_are_answered_alike():
    class Handler:
        def op_plain(self, peer, f):
            return {"plain": f["x"]}

        async def op_waits(self, peer, f):
            await asyncio.sleep(0)
            return {"waits": f["x"]}

    dispatch = Dispatcher(Handler(), server="s", peers="p")
    assert asyncio.run(dispatch.handle(None, "plain", {"x": 1})) == {"plain": 1}
    assert asyncio.run(dispatch.handle(None, "waits", {"x": 2})) == {"waits": 2}


def test_two_handlers_of_one_operation_are_a_mistake():
    class A:
        def op_x(self, peer, f):
            return {}

    with pytest.raises(ValueError, match="two handlers serve 'x'"):
        Dispatcher(A(), A(), server="s", peers="p")
