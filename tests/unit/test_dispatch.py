"""Request routing (transport/dispatch.py): every operation the control
plane serves has one handler, as has every request and push a storage node
serves; an unknown one is refused (a push: ignored) saying so."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from distore_ucx.config import ControlConfig, NodeConfig
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


def storage_node(disk: ThreadPoolExecutor | None = None):
    """A StorageNode's parts as its start-up makes them, without UCX: a
    stand-in pull thread, and `disk` as its disk threads (a disk tier)."""
    from distore_ucx.storage.node import StorageNode

    node = StorageNode(NodeConfig(control="127.0.0.1:1", arena_bytes=1 << 20, name="a"))
    node.puller = SimpleNamespace(progress_between_pulls=lambda: None)
    node._disk_thread = disk
    return node, node._make_parts()


def test_a_storage_node_routes_writers_requests_to_its_insert_server():
    node, dispatch = storage_node()
    assert set(dispatch.routes) == {"insert", "node_info"}
    assert dispatch.routes["insert"] == node.inserts.op_insert
    with pytest.raises(InvalidRequest, match="storage node a does not serve 'sample'"):
        asyncio.run(dispatch.handle(None, "sample", {}))


def test_a_storage_node_routes_the_control_planes_pushes(caplog):
    node, _ = storage_node()
    assert set(node.session._pushes.routes) == {"free", "retire"}
    freed = []
    node.state.arena = SimpleNamespace(
        free=lambda table, offsets, live_only: freed.append((table, offsets.tolist(),
                                                             live_only)))
    push = node.session._on_push
    asyncio.run(push("free", {"table": "t", "offsets": np.array([64, 128], np.uint64)}))
    assert freed == [("t", [64, 128], True)]
    # Without a disk tier nothing is staged: the push is logged, not served.
    with caplog.at_level(logging.WARNING, logger="distore_ucx.storage.session"):
        asyncio.run(push("stage", {}))
    assert "ignoring unexpected push 'stage'" in caplog.text
    node.state.arena = None


def test_a_storage_node_with_a_disk_tier_stages_cold_items():
    with ThreadPoolExecutor(1) as disk:
        node, _ = storage_node(disk)
        assert set(node.session._pushes.routes) == {"free", "retire", "stage", "unstage"}
