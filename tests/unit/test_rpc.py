"""What one connection may hold in flight on an rpc server (transport/rpc.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from distore_ucx import errors
from distore_ucx.transport import rpc

TOKEN = b"t" * 32


class Server:
    """An rpc server on its own event-loop thread; 'nodes' requests wait
    for `release` (they are answered concurrently), others answer at once."""

    def __init__(self, **kwargs):
        self.started = 0
        self.loop = asyncio.new_event_loop()
        self.gate: asyncio.Event | None = None
        ready = threading.Event()

        async def handler(peer, op, fields):
            if op == "nodes":
                self.started += 1
                await self.gate.wait()
            return {"op": op}

        async def main():
            self.gate = asyncio.Event()
            self.server = await rpc.serve("127.0.0.1", 0, handler,
                                          concurrent=frozenset({"nodes"}), **kwargs)
            self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop).result(10)
        assert ready.wait(10)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.set)

    def close(self) -> None:
        async def shutdown():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_connection_has_at_most_max_pending_requests_waiting():
    server = Server(max_pending=3, token=TOKEN)
    try:
        with rpc.Client(server.address, timeout=10, token=TOKEN) as client:
            for _ in range(8):
                client.send("nodes")
            wait_for(lambda: server.started == 3)
            # The server reads no more of this connection while 3 wait.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                assert server.started == 3
                time.sleep(0.05)
            server.release()
            assert [client.receive()["op"] for _ in range(8)] == ["nodes"] * 8
            assert server.started == 8
    finally:
        server.close()


def test_a_frame_over_max_frame_closes_the_connection_unread():
    server = Server(max_frame=1 << 16)
    try:
        with rpc.Client(server.address, timeout=10) as client:
            assert client.call("list_tables")["op"] == "list_tables"
            with pytest.raises(errors.DistoreError, match="accepts at most 65536"):
                client.call("status", blob=b"x" * (1 << 17))
            assert not client.connected
    finally:
        server.close()
