"""The control channel (transport/rpc.py): what one connection may hold in
flight, pipelined requests and their errors, reconnecting, authentication;
each on both event loops a server may run on (asyncio's and uvloop,
transport/event_loop.py)."""

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

    new_loop = staticmethod(asyncio.new_event_loop)  # the `loop_kind` fixture's

    def __init__(self, extra=None, **kwargs):
        self.started = 0
        self.loop = self.new_loop()
        self.gate: asyncio.Event | None = None
        ready = threading.Event()

        async def handler(peer, op, fields):
            if extra is not None and op in extra:
                result = extra[op](peer, fields)
                return await result if asyncio.iscoroutine(result) else result
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


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def loop_kind(request, monkeypatch):
    """Every test here runs its server on asyncio's loop and on uvloop."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        monkeypatch.setattr(Server, "new_loop", staticmethod(uvloop.new_event_loop))
    return request.param


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_connection_has_at_most_max_pending_requests_waiting():
    server = Server(max_pending=3, token=TOKEN)
    try:
        with rpc.RpcClient(server.address, timeout=10, token=TOKEN) as client:
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
        with rpc.RpcClient(server.address, timeout=10) as client:
            assert client.call("list_tables")["op"] == "list_tables"
            with pytest.raises(errors.DistoreError, match="accepts at most 65536"):
                client.call("status", blob=b"x" * (1 << 17))
            assert not client.connected
    finally:
        server.close()


def test_pipelined_requests_are_answered_in_order_and_an_error_stays_with_its_request():
    def missing(peer, fields):
        raise errors.TableNotFound(f"no table {fields['name']!r}")

    server = Server(extra={"table_info": missing})
    try:
        with rpc.RpcClient(server.address, timeout=10) as client:
            ops = ["list_tables", "status", "table_info", "list_tables", "status"]
            for op in ops:
                client.send(op, **({"name": "gone"} if op == "table_info" else {}))
            assert client.in_flight == 5
            got = []
            for op in ops:
                if op == "table_info":
                    with pytest.raises(errors.TableNotFound, match="no table 'gone'.*from control"):
                        client.receive()
                    got.append(op)
                else:
                    got.append(client.receive()["op"])
            assert got == ops and client.in_flight == 0
            assert client.connected  # an error reply does not cost the connection
    finally:
        server.close()


def test_a_lost_connection_is_made_again_when_reconnect_allows_it():
    def hang_up(peer, fields):
        peer.close()

    server = Server(extra={"checkpoint": hang_up})
    try:
        with rpc.RpcClient(server.address, timeout=10, reconnect=5) as client:
            assert client.session == 1
            # The server drops the connection before answering: call() makes a
            # new one and sends the request again once; the second time the
            # server hangs up again, and the error says so.
            with pytest.raises(errors.ConnectionFailed):
                client.call("checkpoint")
            assert client.call("list_tables")["op"] == "list_tables"
            assert client.session >= 2
        with rpc.RpcClient(server.address, timeout=10) as client:  # reconnect=0: no second try
            with pytest.raises(errors.ConnectionFailed):
                client.call("checkpoint")
            with pytest.raises(errors.ConnectionFailed, match="lost the connection"):
                client.call("list_tables")
    finally:
        server.close()


def test_reconnecting_gives_up_after_its_time_and_says_what_to_do():
    server = Server()
    address = server.address
    client = rpc.RpcClient(address, timeout=5, reconnect=0.5)
    try:
        client._drop()  # as when the connection breaks
        server.close()  # and nobody listens there any more
        t0 = time.monotonic()
        with pytest.raises(errors.ConnectionFailed, match="within 0.5 s"):
            client.call("list_tables")
        assert time.monotonic() - t0 < 10  # bounded back-off, with slack for a busy machine
    finally:
        client.close()


def test_a_wrong_or_missing_token_is_refused_and_the_server_serves_on():
    server = Server(token=TOKEN)
    try:
        with pytest.raises(errors.AuthenticationFailed):
            rpc.RpcClient(server.address, timeout=10, token=b"w" * 32)
        with pytest.raises(errors.AuthenticationFailed):
            rpc.RpcClient(server.address, timeout=10)
        # An authentication failure is not retried as a lost connection.
        with pytest.raises(errors.AuthenticationFailed):
            rpc.RpcClient(server.address, timeout=10, token=b"w" * 32, reconnect=5)
        with rpc.RpcClient(server.address, timeout=10, token=TOKEN) as client:
            assert client.call("status")["op"] == "status"
    finally:
        server.close()




def test_ordered_requests_run_at_once_but_are_answered_in_order():
    # table_info is `ordered` here; "slow" waits for the gate, "quick"
    # answers at once. The second starts while the first waits (a learner's
    # second sample has its node reading while the first one's node reads),
    # yet its reply comes second, and that of a plain request after them third.
    started = []

    async def info(peer, fields):
        started.append(fields["name"])
        if fields["name"] == "slow":
            await server.gate.wait()
        return {"name": fields["name"]}

    server = Server(extra={"table_info": info}, ordered=frozenset({"table_info"}))
    try:
        with rpc.RpcClient(server.address, timeout=10) as client:
            client.send("table_info", name="slow")
            client.send("table_info", name="quick")
            client.send("status")
            wait_for(lambda: started == ["slow", "quick"])  # the second began meanwhile
            assert not client.wait_readable(0.3)  # and its reply waits for the first's
            server.release()
            assert client.receive()["name"] == "slow"
            assert client.receive()["name"] == "quick"
            assert client.receive()["op"] == "status"
    finally:
        server.close()
