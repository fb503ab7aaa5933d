"""Reading and writing whole control-channel frames, with a length limit.

A frame is a header and msgpack metadata (protocol/framing.py). The reader
checks the announced length against a caller's limit *before* reading the
body, so a peer that announces more than it may send is refused without a
byte of its body being buffered. Used by the RPC layer (transport/rpc.py)
and the authentication handshake (transport/auth.py), over asyncio streams
and over plain blocking sockets alike.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from .. import protocol


class FrameTooLarge(protocol.ProtocolError):
    """A peer announced a frame longer than this connection accepts."""


def check_length(n: int, limit: int, what: str = "frame") -> None:
    """Raise FrameTooLarge when an announced body length `n` exceeds `limit`."""
    if n > limit:
        raise FrameTooLarge(
            f"{what} of {n} bytes announced; this connection accepts at most {limit}"
        )


async def read_frame(reader: asyncio.StreamReader, limit: int = protocol.MAX_FRAME,
                     what: str = "frame") -> dict[str, Any] | None:
    """Next message from an asyncio stream, or None at a clean end of stream.

    Raises protocol.ProtocolError (FrameTooLarge when the header announces
    more than `limit` bytes; the body is then not read).
    """
    try:
        header = await reader.readexactly(protocol.HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise protocol.ProtocolError("connection closed inside a frame header") from None
        return None
    n, meta = protocol.read_header(header)
    check_length(n, limit, what)
    return protocol.decode(await reader.readexactly(n), meta)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes from a blocking socket (ConnectionResetError at EOF)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = protocol.MAX_FRAME,
               what: str = "frame") -> dict[str, Any]:
    """Next message from a blocking socket (its timeout applies).

    Raises protocol.ProtocolError (FrameTooLarge as read_frame), OSError, or
    socket.timeout.
    """
    n, meta = protocol.read_header(recv_exact(sock, protocol.HEADER_SIZE))
    check_length(n, limit, what)
    return protocol.decode(recv_exact(sock, n), meta)


def send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Encode and send one message on a blocking socket (OSError on failure)."""
    head, meta = protocol.encode(msg)
    sock.sendall(head + meta)


class Outbox:
    """Frames queued for one connection's stream writer: everything queued
    in one turn of the event loop goes out in one write (a send system call
    per reply was a third of the control plane's CPU under a fan-in of 256
    actors, and a sixth of a node's), in the order queued. Used from the
    event loop's thread."""

    def __init__(self, writer):
        self._writer = writer
        self._frames: list | None = None  # queued this turn; None: no flush scheduled
        # Asked once: Python 3.11's get_running_loop() makes a getpid system
        # call each time (5% of a node's event loop under a fan-in).
        self._loop = asyncio.get_running_loop()

    def send(self, frames: list) -> None:
        """Queue encoded frames; they go at the end of this turn."""
        if self._frames is None:
            self._frames = []
            self._loop.call_soon(self.flush)
        self._frames.extend(frames)

    def flush(self) -> None:
        """Write what is queued now (a connection about to close calls it)."""
        frames, self._frames = self._frames, None
        if frames and not self._writer.is_closing():
            self._writer.writelines(frames)

