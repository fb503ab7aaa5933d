"""The serving side of the control channel: `serve` and its flow control.

`serve` runs an asyncio server whose handler answers each request. What one
connection may hold is bounded here: requests read but not answered
(MAX_PENDING), bytes of replies it leaves unread (MAX_UNSENT), time to
authenticate (HANDSHAKE_TIMEOUT); what connections may cost in all is
transport/admission.py's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from .. import errors, protocol
from . import auth
from .admission import (
    FD_RESERVE,
    ConnectionAdmission,
    bursts,
    quiet_accept_errors,
    raise_open_file_limit,
)
from .frames import read_frame
from .peer import Peer

__all__ = ["HANDSHAKE_TIMEOUT", "MAX_PENDING", "MAX_UNSENT", "Handler", "serve"]

# Defaults of what one authenticated connection may hold in flight on a
# server (the control plane takes its own from ControlConfig).
MAX_PENDING = 64  # requests read but not yet answered
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to authenticate
MAX_UNSENT = 1 << 20  # bytes of replies a peer leaves unread before its requests are not read
LISTEN_BACKLOG = 1024  # connections the kernel completes before we accept them

log = logging.getLogger(__name__)

Handler = Callable[[Peer, str, dict[str, Any]], Awaitable[dict[str, Any] | None]]


async def serve(
    host: str,
    port: int,
    handler: Handler,
    on_close: Callable[[Peer], None] | None = None,
    concurrent: frozenset[str] = frozenset(),
    ordered: frozenset[str] = frozenset(),
    token: bytes | None = None,
    max_frame: int = protocol.MAX_FRAME,
    max_pending: int = MAX_PENDING,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    role: str | None = None,
) -> asyncio.base_events.Server:
    """Start a server; `handler(peer, op, fields)` returns the reply fields.

    Requests on one connection are answered in order, except operations in
    `concurrent`, which may wait (a rate limiter holding an insert) and are
    answered when done while the connection goes on; their senders match
    replies by id. Operations in `ordered` are handled concurrently too
    (a sample waiting for a node to read its cold items from disk while
    the next sample's node starts reading), but their replies, and those
    of every request after them, go out in the order the requests came.
    A malformed message gets an error reply and its connection is closed;
    other connections go on.

    `role` ("control plane", "storage node") goes in the greeting, so that a
    client at the wrong kind of server says so. With a `token`, every
    connection must first answer the greeting's
    challenge (transport/auth.py) within `handshake_timeout` seconds. Until
    it has, no frame longer than auth.MAX_HANDSHAKE_FRAME is read (a longer
    announced one closes the connection, its body unread), and any other
    request gets an error and the connection is closed, so an
    unauthenticated peer learns nothing (no worker address, no remote key,
    no data) and makes the server hold a few hundred bytes at most.

    After it, a frame longer than `max_frame` closes the connection unread,
    and at most `max_pending` requests of one connection wait for their
    answers: beyond that the server stops reading the connection (TCP then
    pushes back on its sender) until one is answered. Likewise while more
    than MAX_UNSENT bytes of its replies wait to be sent (a peer that does
    not read its replies), until they drain.

    Connections are admitted by `ConnectionAdmission`
    (transport/admission.py): at most MAX_PER_PEER per host, as many in all
    as the open-file limit (raised to its hard limit first) leaves, and
    MAX_UNAUTHENTICATED_PER_PEER still authenticating per host, the oldest
    closed for a new one. Refusals and failed accepts are logged once per
    burst.
    """
    fd_limit = raise_open_file_limit()
    admission = ConnectionAdmission(max(16, fd_limit - FD_RESERVE), token is not None)
    # asyncio accepts up to `backlog` connections in one go before any is
    # admitted: with few descriptors, a smaller queue, so a burst never
    # runs out of them (an accept that fails pauses accepting for 1 s).
    backlog = max(64, min(LISTEN_BACKLOG, (fd_limit - FD_RESERVE) // 4))
    quiet_accept_errors(asyncio.get_running_loop())
    served = _Connections(handler, on_close, concurrent, ordered, token, max_frame, max_pending,
                          handshake_timeout, role, admission)
    # A deep accept queue: a burst of connections is taken in and sorted
    # out here (admission), instead of SYNs dropped and clients waiting 1 s.
    return await asyncio.start_server(served.connection, host, port, limit=1 << 20,
                                      backlog=backlog)


async def drained(writer) -> bool:
    """Wait while this connection's unsent replies are over MAX_UNSENT;
    False if it closed meanwhile."""
    if writer.transport.get_write_buffer_size() > MAX_UNSENT:
        try:
            await writer.drain()
        except (ConnectionError, RuntimeError):  # closed, or closing
            return False
    return not writer.is_closing()


def _backed_up(writer) -> bool:
    """Whether `drained` has anything to wait for or refuse (checked first:
    a coroutine a request costs more than these two calls)."""
    return writer.transport.get_write_buffer_size() > MAX_UNSENT or writer.is_closing()


class _Connections:
    """What `serve` does with each connection (see its docstring): admit,
    authenticate, then read and answer requests under its bounds."""

    def __init__(self, handler: Handler, on_close, concurrent: frozenset[str],
                 ordered: frozenset[str], token: bytes | None, max_frame: int, max_pending: int,
                 handshake_timeout: float, role: str | None, admission: ConnectionAdmission):
        self.handler, self.on_close = handler, on_close
        self.concurrent, self.ordered = concurrent, ordered
        self.token, self.role = token, role
        self.max_frame, self.max_pending = max_frame, max_pending
        self.handshake_timeout = handshake_timeout
        self.admission = admission

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """Serve one accepted connection until it closes (asyncio's callback)."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = Peer(reader, writer)
        addr = writer.get_extra_info("peername")
        host = addr[0] if addr else "?"
        if not self.admission.admit(peer, host):
            writer.close()
            return
        try:
            if await self._authenticated(peer):
                self.admission.authenticated(peer, host)
                await self._requests(peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # The server is shutting down. Ending quietly keeps Python 3.11's
            # stream callback from logging a traceback for the cancelled task.
            pass
        finally:
            self.admission.left(peer, host)
            peer.closed.set()
            for task in list(peer.tasks):
                task.cancel()
            if self.on_close is not None:
                self.on_close(peer)
            peer.flush()  # what was answered goes before the connection closes
            writer.close()

    async def _authenticated(self, peer: Peer) -> bool:
        """Whether the peer answered the greeting's challenge in time."""
        try:
            ok = await asyncio.wait_for(
                auth.server_handshake_async(peer.reader, peer.writer, self.token, peer.address,
                                            self.role),
                self.handshake_timeout)
        except asyncio.TimeoutError:
            bursts.note("handshake", "authentication failed for %s: no answer within %g s",
                        peer.address, self.handshake_timeout)
            ok = False
        peer.state.authenticated = bool(ok)
        return bool(ok)

    async def _requests(self, peer: Peer) -> None:
        """Read and answer requests until the peer closes or breaks a rule."""
        last: asyncio.Task | None = None  # the latest `ordered` request's answer
        loop = asyncio.get_running_loop()  # once: a getpid system call each (Python 3.11)
        while True:
            if len(peer.tasks) >= self.max_pending:
                # Enough of this connection's requests are waiting: read
                # no more of it until one is answered.
                await asyncio.wait(set(peer.tasks), return_when=asyncio.FIRST_COMPLETED)
                continue
            if _backed_up(peer.writer) and not await drained(peer.writer):
                return  # its replies unread: read no more until they go; or it closed
            request = await self._read(peer)
            if request is None:
                return
            mid, op, fields = request
            if op in self.concurrent or op in self.ordered:
                after = last if op in self.ordered and last is not None and not last.done() \
                    else None
                task = loop.create_task(self._answer(peer, mid, op, fields, after))
                peer.tasks.add(task)
                task.add_done_callback(peer.tasks.discard)
                if op in self.ordered:
                    last = task
                continue
            if last is not None:
                if not last.done():  # ordered replies still to go: this one after them
                    await asyncio.wait([last])
                last = None
            await self._answer(peer, mid, op, fields)

    async def _read(self, peer: Peer) -> tuple[int, str, dict] | None:
        """The next request (id, op, fields); None when the peer closed, or
        sent a malformed one (answered with an error: the caller closes)."""
        try:
            msg = await read_frame(peer.reader, self.max_frame)
        except protocol.ProtocolError as exc:
            log.warning("closing %s: %s", peer.address, exc)
            peer.send(protocol.encode(protocol.error_reply(0, exc)))
            return None
        if msg is None:
            return None
        try:
            op, fields = protocol.validate_request(msg)
        except protocol.ProtocolError as exc:
            log.warning("closing %s: %s", peer.address, exc)
            peer.send(protocol.encode(protocol.error_reply(msg["id"], exc)))
            return None
        return msg["id"], op, fields

    async def _answer(self, peer: Peer, mid: int, op: str, fields: dict,
                      after: asyncio.Task | None = None) -> None:
        """Handle one request and queue its reply (after `after`'s)."""
        try:
            result = await self.handler(peer, op, fields)
        except errors.DistoreError as exc:
            result = exc
        except Exception as exc:  # a bug here must not take the server down
            log.exception("error handling %s from %s", op, peer.address)
            result = exc
        if after is not None:  # the reply to the request before this one goes first
            await asyncio.wait([after])
        if mid == 0 or (_backed_up(peer.writer) and not await drained(peer.writer)):
            return  # push: no reply; or the peer is gone
        if isinstance(result, BaseException):
            peer.send(protocol.encode(protocol.error_reply(mid, result)))
        else:
            peer.send(protocol.encode(protocol.reply(mid, **(result or {}))))
