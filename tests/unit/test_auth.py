"""The authentication handshake (transport/auth.py) and frame limits
(transport/frames.py), over blocking sockets and asyncio streams."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from distore_ucx import errors, protocol
from distore_ucx.transport import auth
from distore_ucx.transport.frames import FrameTooLarge, recv_frame, send_frame

TOKEN = b"k" * 32


def test_answers_verify_only_with_the_same_token_and_nonce():
    nonce = auth.make_challenge()
    assert len(nonce) == auth.NONCE_BYTES and nonce != auth.make_challenge()
    mac = auth.answer(TOKEN, nonce)
    assert auth.verify(TOKEN, nonce, mac)
    assert not auth.verify(b"x" * 32, nonce, mac)
    assert not auth.verify(TOKEN, auth.make_challenge(), mac)
    assert not auth.verify(TOKEN, nonce, mac[:-1])
    assert not auth.verify(TOKEN, nonce, "not bytes")


def run_pair(server_token, client_token):
    """Blocking handshake over a socket pair: (server result, client error)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    result = {}
    th = threading.Thread(target=lambda: result.update(ok=auth.server_handshake(a, server_token)))
    th.start()
    try:
        auth.client_handshake(b, client_token, "test server")
        err = None
    except errors.DistoreError as exc:
        err = exc
    b.close()  # a client that gave up hangs up; the server must not wait on
    th.join(10)
    a.close()
    return result["ok"], err


def test_blocking_handshake():
    assert run_pair(TOKEN, TOKEN) == (True, None)
    assert run_pair(None, None) == (True, None)
    ok, err = run_pair(TOKEN, b"y" * 32)
    assert not ok and isinstance(err, errors.AuthenticationFailed)
    assert "refused our token" in str(err)
    ok, err = run_pair(TOKEN, None)
    assert isinstance(err, errors.AuthenticationFailed) and "requires a token" in str(err)


def test_an_unauthenticated_large_frame_is_refused_unread():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    # The client announces 1 GiB and sends nothing more: the server must
    # answer at once from the header alone, not wait for the body.
    result = {}
    th = threading.Thread(target=lambda: result.update(ok=auth.server_handshake(a, TOKEN)))
    th.start()
    recv_frame(b)  # the hello
    b.sendall(protocol.HEADER.pack(1 << 30, 16))
    reply = recv_frame(b)
    th.join(5)
    assert not th.is_alive() and result["ok"] is False
    assert reply["ok"] is False and "at most 512" in reply["message"]
    a.close()
    b.close()


def test_frame_limit_applies_before_the_body():
    a, b = socket.socketpair()
    b.settimeout(5)
    a.sendall(protocol.HEADER.pack(1000, 10))  # a header only: the body never comes
    with pytest.raises(FrameTooLarge, match="1000 bytes"):
        recv_frame(b, limit=999)
    a.close()
    b.close()
    a, b = socket.socketpair()
    b.settimeout(5)
    send_frame(a, protocol.request("nodes", 3))
    assert recv_frame(b, limit=999)["op"] == "nodes"  # within the limit: read
    a.close()
    b.close()


def test_async_handshake_matches_the_blocking_one():
    async def main(server_token, client_token):
        result = {}

        async def on_conn(reader, writer):
            result["ok"] = await auth.server_handshake_async(reader, writer, server_token, "p")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await auth.client_handshake_async(reader, writer, client_token, "test", 5.0)
            err = None
        except errors.DistoreError as exc:
            err = exc
        writer.close()
        for _ in range(100):  # the server's side finishes on its own task
            if "ok" in result:
                break
            await asyncio.sleep(0.01)
        server.close()
        return result.get("ok"), err

    assert asyncio.run(main(TOKEN, TOKEN)) == (True, None)
    ok, err = asyncio.run(main(TOKEN, b"z" * 32))
    assert ok is False and isinstance(err, errors.AuthenticationFailed)
    ok, err = asyncio.run(main(TOKEN, None))
    assert isinstance(err, errors.AuthenticationFailed)
