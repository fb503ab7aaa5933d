"""One accepted connection on a server: `Peer`, what a request handler gets."""

from __future__ import annotations

import asyncio
from typing import Any

from .. import protocol

__all__ = ["Peer"]


class Peer:
    """One accepted connection on a server: where it came from, how to push."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        addr = writer.get_extra_info("peername")
        self.address = f"{addr[0]}:{addr[1]}" if addr else "?"
        self.state: dict[str, Any] = {}
        self.closed = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()  # requests being answered concurrently

    def push(self, op: str, **fields: Any) -> None:
        """Send a message that expects no reply (id 0)."""
        if not self.writer.is_closing():
            self.writer.writelines(protocol.encode(protocol.request(op, 0, **fields)))

    def close(self) -> None:
        """Close the connection; the serving task then ends."""
        if not self.writer.is_closing():
            self.writer.close()
