"""The asyncio side of the control channel: `AsyncClient`.

Storage nodes use it towards the control plane: requests are matched to
their replies by id, so several may wait at once, and the control plane's
pushes (id 0) arrive on the same socket and go to `on_push`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Any

from .. import errors, protocol
from . import auth
from .address import parse_address
from .auth import PROBE_AFTER
from .frames import Outbox, read_frame

__all__ = ["AsyncClient"]

log = logging.getLogger(__name__)


class AsyncClient:
    """asyncio request/reply connection that also dispatches pushes (id 0)."""

    def __init__(self, reader, writer, name: str, on_push=None):
        self._reader = reader
        self._writer = writer
        self.name = name
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._on_push = on_push
        self._outbox = Outbox(writer)  # the requests of one loop turn go in one write
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        self.closed = asyncio.Event()

    @classmethod
    async def connect(
        cls, address: str, name: str, on_push=None, timeout: float = 10.0,
        token: bytes | None = None, expect: str | None = None,
    ):
        """Connect to `address` ('host:port'), answering its challenge with `token`.

        With `expect` (a role, "control plane"), a server of another kind, or
        an HTTP server, is refused within about a second (errors.WrongPeer),
        saying what answered, as blocking clients do (transport/auth.py)."""
        host, port = parse_address(address)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=1 << 20), timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise errors.ConnectionFailed(
                f"cannot connect to the {name} at {address}: {exc}") from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        label = f"{name} at {address}"
        try:
            await auth.client_handshake_async(reader, writer, token, label, timeout, expect,
                                              PROBE_AFTER if expect else None)
        except auth.SlowGreeting:
            writer.close()
            if expect is None:
                raise
            # A busy server greeted after the probe: connect again, no probe.
            return await cls.connect(address, name, on_push, timeout, token)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, label, on_push)

    async def call(self, op: str, reply_timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Send a request and await its reply; raises the peer's error."""
        if self.closed.is_set():
            raise errors.ConnectionFailed(f"the connection to the {self.name} is closed")
        mid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[mid] = fut
        self._outbox.send(protocol.encode(protocol.request(op, mid, **fields)))
        try:
            msg = await asyncio.wait_for(fut, reply_timeout)
        except asyncio.TimeoutError:
            raise errors.Timeout(
                f"no reply to {op} from the {self.name} within {reply_timeout} s"
            ) from None
        finally:
            self._waiting.pop(mid, None)
        if not msg.get("ok"):
            raise protocol.remote_error(msg, self.name)
        return msg

    def push(self, op: str, **fields: Any) -> None:
        """Send a message that expects no reply."""
        if not self.closed.is_set():
            self._outbox.send(protocol.encode(protocol.request(op, 0, **fields)))

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await read_frame(self._reader)
                if msg is None:
                    break
                if msg["id"] == 0 and "op" in msg:
                    op, fields = protocol.validate_request(msg)
                    if self._on_push is not None:
                        await self._on_push(op, fields)
                    continue
                fut = self._waiting.get(msg["id"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ConnectionError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
            log.warning("connection to the %s failed: %s", self.name, exc)
        finally:
            self.closed.set()
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(
                        errors.ConnectionFailed(f"lost the connection to the {self.name}")
                    )

    async def close(self) -> None:
        """Close the connection and wait for the reader task to end."""
        self._outbox.flush()  # requests made this turn go first
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
