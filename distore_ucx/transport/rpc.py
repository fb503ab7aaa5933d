"""The control channel: framed msgpack requests over TCP.

Control traffic (placement, locations, leases, inserts) is small next to the
sample path and must work whatever UCX transports are loaded: UCX cannot
make sockaddr (listener) connections when only shared memory is enabled, so
this channel is plain TCP, and UCX carries the one-sided reads.

`Client` is a blocking connection for user threads (writers, learners, the
CLI); `serve` runs an asyncio server whose handler answers each request;
`AsyncClient` is the asyncio side used by storage nodes towards the control
plane, and also receives the control plane's pushes on the same socket.
All three authenticate through transport/auth.py and read frames through
transport/frames.py, which bounds a frame's length before reading it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import resource
import select
import socket
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from .. import errors, protocol
from . import auth
from .frames import FrameTooLarge, read_frame, recv_exact

__all__ = [
    "AsyncClient",
    "Client",
    "FrameTooLarge",
    "Peer",
    "parse_address",
    "read_frame",
    "serve",
]

# Defaults of what one authenticated connection may hold in flight on a
# server (the control plane takes its own from ControlConfig).
MAX_PENDING = 64  # requests read but not yet answered
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to authenticate
# Seconds a client waits for a greeting before asking the silent peer whether
# it is an HTTP server (a metrics port given as the control plane's address).
PROBE_AFTER = 1.0
# What connections may cost a server, whoever opens them (docs/operations.md):
MAX_UNSENT = 1 << 20  # bytes of replies a peer leaves unread before its requests are not read
MAX_PER_PEER = 4096  # connections from one host (IP address)
MAX_UNAUTHENTICATED_PER_PEER = 64  # of them still authenticating: the oldest goes first
FD_RESERVE = 128  # descriptors never given to connections (files, UCX, /metrics, logs)
LISTEN_BACKLOG = 1024  # connections the kernel completes before we accept them
BURST_LOG_EVERY = 10.0  # s: one log line per burst of refusals, not one per connection

log = logging.getLogger(__name__)

Handler = Callable[["Peer", str, dict[str, Any]], Awaitable[dict[str, Any] | None]]


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'host:port' (or ':port') -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ConfigError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:7700)")
    return host.strip("[]") or default_host, int(port)


def _interrupted() -> bool:
    """Whether this thread is unwinding a KeyboardInterrupt (a ^C running
    `with` exits and `finally` clauses). The store's processes of a local
    cluster got the same ^C and are gone: waiting for the control plane to
    come back would hold the exit up for the whole reconnect time."""
    exc = sys.exc_info()[1]
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


class _Bursts:
    """One log line per burst of like events (refused connections, accept
    failures) rather than one per event: the first is logged, then at most
    one line every BURST_LOG_EVERY s with the count since the last."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._since: Counter = Counter()

    def note(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        self._since[key] += 1
        last = self._last.get(key)
        if last is not None and now - last < BURST_LOG_EVERY:
            return
        n = self._since.pop(key)
        more = f" ({n} times in the last {now - last:.0f} s)" if last is not None else ""
        log.warning(message + more, *args)
        self._last[key] = now


_bursts = _Bursts()
_fd_limit: int | None = None


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (once
    per process), saying so in the log; returns the soft limit now. Every
    connection takes a descriptor: at the common default of 1,024, a few
    thousand idle connections would leave a server unable to accept its own
    clients."""
    global _fd_limit
    if _fd_limit is not None:
        return _fd_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("raised the open-file limit from %d to %d (its hard limit): every "
                     "connection takes one", soft, want)
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d (%s)", soft, want, exc)
    if soft < 4 * FD_RESERVE + MAX_UNAUTHENTICATED_PER_PEER:
        log.warning("the open-file limit is %d (hard %d): this process serves at most %d "
                    "connections; raise it (ulimit -n, LimitNOFILE=) for more", soft, hard,
                    soft - FD_RESERVE)
    _fd_limit = soft
    return soft


_quiet_loops: weakref.WeakSet = weakref.WeakSet()


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop` log an accept that fails for lack of descriptors once per
    burst, not with a traceback per attempt (asyncio retries every second)."""
    if loop in _quiet_loops:
        return
    _quiet_loops.add(loop)
    previous = loop.get_exception_handler()

    def handler(loop, context):
        if "accept" in str(context.get("message", "")) and \
                isinstance(context.get("exception"), OSError):
            _bursts.note("accept", "cannot accept connections: %s (out of descriptors or "
                         "memory); retrying", context["exception"])
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _Admission:
    """Connections of one server, by peer host: at most MAX_PER_PEER per host
    and `limit` in all; at most MAX_UNAUTHENTICATED_PER_PEER per host still
    authenticating, the oldest closed to make room (so a flood of idle
    connections costs a few dozen descriptors and never locks out a client
    that answers its challenge at once)."""

    def __init__(self, limit: int, authenticating: bool):
        self.limit = limit
        self.authenticating = authenticating
        self.total = 0
        self.by_host: Counter = Counter()
        self.waiting: dict[str, OrderedDict] = {}  # host -> peers not yet authenticated

    def admit(self, peer: Peer, host: str) -> bool:
        if self.by_host[host] >= MAX_PER_PEER:
            _bursts.note("per-peer", "refusing connections from %s: it holds %d (at most %d "
                         "per host)", host, self.by_host[host], MAX_PER_PEER)
            return False
        if self.total >= self.limit and not self._evict_oldest():
            _bursts.note("total", "refusing connections: %d open, the most this process "
                         "serves with its open-file limit", self.total)
            return False
        if self.authenticating:
            mine = self.waiting.setdefault(host, OrderedDict())
            if len(mine) >= MAX_UNAUTHENTICATED_PER_PEER:
                self._evict(next(iter(mine)), host)
                _bursts.note("unauthenticated", "closing the oldest of %d connections from %s "
                             "that have not authenticated, to take a new one",
                             MAX_UNAUTHENTICATED_PER_PEER, host)
            mine[peer] = None
        self.total += 1
        self.by_host[host] += 1
        return True

    def authenticated(self, peer: Peer, host: str) -> None:
        mine = self.waiting.get(host)
        if mine is not None:
            mine.pop(peer, None)
            if not mine:
                del self.waiting[host]

    def left(self, peer: Peer, host: str) -> None:
        self.authenticated(peer, host)
        self.total -= 1
        self.by_host[host] -= 1
        if self.by_host[host] <= 0:
            del self.by_host[host]

    def _evict(self, victim: Peer, host: str) -> None:
        self.authenticated(victim, host)  # out of the queue now; counted until it ends
        victim.close()

    def _evict_oldest(self) -> bool:
        for host, mine in self.waiting.items():
            if mine:
                self._evict(next(iter(mine)), host)
                return True
        return False


class Client:
    """A blocking request/reply connection; thread safe (one request at a time).

    `send` and `receive` let a caller keep several requests in flight on one
    connection: replies come back in order.

    With `reconnect` > 0 (connections to the control plane), a lost
    connection is made again on the next request, retrying for up to
    `reconnect` seconds (the control plane may be restarting), and `call`
    sends a request again once if the connection broke before its reply
    came: every control-plane request may be repeated safely. `session`
    counts the connections made, so a caller can tell that it has a new one
    (leases and node ids of the old one may be gone).
    """

    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        name: str = "control plane",
        token: bytes | None = None,
        reconnect: float = 0.0,
        expect: str | None = None,
    ):
        """Connect, read the server's greeting and answer its challenge with
        `token` when it asks for one. With `expect` (a role, "control
        plane"), a server of another kind, or an HTTP server, is refused at
        once, saying what answered."""
        self.expect = expect
        self.address = address
        self.name = f"{name} at {address}"
        self.timeout = timeout
        self.reconnect = reconnect
        self.session = 0
        self._token = token
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # _ensure() authenticates while a request holds it
        self._pending: list[int] = []
        self._sock: socket.socket | None = None
        self._closed = False
        self._give_up = threading.Event()  # stop_reconnecting()
        self._connect()

    def _connect(self, probe: bool = True) -> None:
        host, port = parse_address(self.address)
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as exc:
            raise errors.ConnectionFailed(
                f"cannot connect to the {self.name}: {exc}. Is it running, and is the "
                "address right?"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._pending = []
        try:
            self._authenticate(self._token, probe)
        except auth.SlowGreeting:
            self._drop()
            if not probe:
                raise
            self._connect(probe=False)  # a busy server: wait for its greeting, no probe
            return
        except BaseException:
            self._drop()
            raise
        self.session += 1

    def _ensure(self) -> None:
        """A live connection: the current one, or a new one within `reconnect` s."""
        if self._sock is not None:
            return
        if self._closed:
            raise errors.ConnectionFailed(f"the connection to the {self.name} was closed")
        if self.reconnect <= 0 or self._give_up.is_set():
            raise errors.ConnectionFailed(f"lost the connection to the {self.name}")
        if _interrupted():
            raise errors.ConnectionFailed(
                f"lost the connection to the {self.name} while stopping on ^C; not waiting "
                "for it to come back")
        deadline = time.monotonic() + self.reconnect
        delay = 0.05
        while True:
            try:
                self._connect()
                log.info("connected again to the %s (session %d)", self.name, self.session)
                return
            except errors.AuthenticationFailed:
                raise
            except (errors.ConnectionFailed, errors.Timeout) as exc:
                left = deadline - time.monotonic()
                if self._give_up.is_set():
                    raise errors.ConnectionFailed(
                        f"lost the connection to the {self.name}; not connecting again: "
                        "its owner is closing") from None
                if left <= 0:
                    raise errors.ConnectionFailed(
                        f"lost the connection to the {self.name} and could not connect again "
                        f"within {self.reconnect:g} s ({exc}). If it was restarted, start it "
                        "with --restore to keep its tables"
                    ) from None
                self._give_up.wait(min(delay, left))  # a bounded back-off, not a spin
                delay = min(delay * 2, 1.0)

    def _authenticate(self, token: bytes | None, probe: bool = False) -> None:
        with self._lock:
            auth.client_handshake(self._sock, token, self.name, self.expect,
                                  PROBE_AFTER if probe and self.expect else None)

    def call(self, op: str, reply_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises the peer's error.

        `reply_timeout` overrides the connection's timeout for this reply.
        """
        with self._lock:
            if self._pending:
                raise RuntimeError("call() while pipelined requests are outstanding")
            for attempt in range(2 if self.reconnect > 0 else 1):
                self._ensure()
                try:
                    self._send(op, fields)
                    return self._receive(reply_timeout)
                except errors.ConnectionFailed:
                    if attempt or self.reconnect <= 0 or self._sock is not None \
                            or self._give_up.is_set() or _interrupted():
                        raise  # an error reply (the connection is fine), a second loss,
                        # or a ^C unwinding: never resend then
                    log.warning("lost the connection to the %s during %s; sending it again",
                                self.name, op)
            raise AssertionError("unreachable")

    def send(self, op: str, **fields: Any) -> int:
        """Send a request without waiting; `receive` returns its reply later."""
        with self._lock:
            self._ensure()  # a lost connection took its pending requests with it
            return self._send(op, fields)

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The reply to the oldest request sent with `send`."""
        with self._lock:
            if self._sock is None:  # the connection broke: its requests are lost
                raise errors.ConnectionFailed(f"lost the connection to the {self.name}")
            return self._receive(timeout)

    def wait_readable(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the reply to the oldest request to start
        arriving (or the connection to break); True if `receive` would not
        wait. Unlike a `receive` that times out, keeps the connection."""
        with self._lock:
            sock = self._sock
        if sock is None:
            return True
        try:
            # poll, not select: servers raise their open-file limit, and
            # select() cannot take a descriptor numbered 1,024 or more.
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            ready = poller.poll(max(0, int(timeout * 1000)))
        except (OSError, ValueError):  # closed meanwhile: receive will say so
            return True
        return bool(ready)

    @property
    def connected(self) -> bool:
        """Whether the connection is up (False after a loss, until the next request)."""
        return self._sock is not None

    @property
    def in_flight(self) -> int:
        """Requests sent with `send` whose replies were not yet received."""
        return len(self._pending)

    def _send(self, op: str, fields: dict[str, Any]) -> int:
        mid = next(self._ids)
        frame = protocol.encode(protocol.request(op, mid, **fields))
        try:
            self._sock.sendall(frame[0] + frame[1])
            if len(frame) == 3:  # a payload goes as is, never copied into one buffer
                self._sock.sendall(frame[2])
        except OSError as exc:
            self._drop()
            raise errors.ConnectionFailed(
                f"lost the connection to the {self.name}: {exc}") from None
        self._pending.append(mid)
        return mid

    def _receive(self, timeout: float | None) -> dict[str, Any]:
        if not self._pending:
            raise RuntimeError("no request outstanding")
        self._sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            n, meta = protocol.read_header(self._recv_exact(protocol.HEADER_SIZE))
            msg = protocol.decode(self._recv_exact(n), meta)
        except TimeoutError:
            self._drop()
            waited = self.timeout if timeout is None else timeout
            raise errors.Timeout(
                f"no reply from the {self.name} within {waited} s; the connection was closed"
            ) from None
        except (OSError, protocol.ProtocolError) as exc:
            self._drop()
            raise errors.ConnectionFailed(
                f"lost the connection to the {self.name}: {exc}") from None
        if msg.get("id") == 0 and not msg.get("ok"):
            # The server refused this connection's traffic (a frame over its
            # limit, a malformed message) and hangs up: say why.
            self._drop()
            raise protocol.remote_error(msg, self.name)
        mid = self._pending.pop(0)
        if msg.get("id") != mid:
            self._drop()
            raise errors.ConnectionFailed(f"{self.name} answered out of order; connection closed")
        if not msg.get("ok"):
            raise protocol.remote_error(msg, self.name)
        return msg

    def _recv_exact(self, n: int) -> bytes:
        return recv_exact(self._sock, n)

    def _drop(self) -> None:
        """Close a failed connection; the next request may make a new one."""
        sock, self._sock = self._sock, None
        self._pending = []
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def stop_reconnecting(self) -> None:
        """Make a reconnect in progress on another thread (a learner's
        prefetch thread) give up at once, and later ones fail: the owner is
        closing and would otherwise wait up to `reconnect` s for it."""
        self._give_up.set()

    def close(self) -> None:
        """Close the connection for good (idempotent)."""
        self._closed = True
        self._give_up.set()
        self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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

    Connections are admitted by `_Admission`: at most MAX_PER_PEER per host,
    as many in all as the open-file limit (raised to its hard limit first)
    leaves, and MAX_UNAUTHENTICATED_PER_PEER still authenticating per host,
    the oldest closed for a new one. Refusals and failed accepts are logged
    once per burst.
    """
    fd_limit = raise_open_file_limit()
    admission = _Admission(max(16, fd_limit - FD_RESERVE), token is not None)
    # asyncio accepts up to `backlog` connections in one go before any is
    # admitted: with few descriptors, a smaller queue, so a burst never
    # runs out of them (an accept that fails pauses accepting for 1 s).
    backlog = max(64, min(LISTEN_BACKLOG, (fd_limit - FD_RESERVE) // 4))
    _quiet_accept_errors(asyncio.get_running_loop())

    async def drained(writer) -> bool:
        """Wait while this connection's unsent replies are over MAX_UNSENT;
        False if it closed meanwhile."""
        if writer.transport.get_write_buffer_size() > MAX_UNSENT:
            try:
                await writer.drain()
            except (ConnectionError, RuntimeError):  # closed, or closing
                return False
        return not writer.is_closing()

    async def answer(peer: Peer, writer, mid: int, op: str, fields: dict,
                     after: asyncio.Task | None = None) -> None:
        try:
            result = await handler(peer, op, fields)
        except errors.DistoreError as exc:
            result = exc
        except Exception as exc:  # a bug here must not take the server down
            log.exception("error handling %s from %s", op, peer.address)
            result = exc
        if after is not None:  # the reply to the request before this one goes first
            await asyncio.wait([after])
        if mid == 0 or not await drained(writer):  # push: no reply; or the peer is gone
            return
        if isinstance(result, BaseException):
            writer.writelines(protocol.encode(protocol.error_reply(mid, result)))
        else:
            writer.writelines(protocol.encode(protocol.reply(mid, **(result or {}))))

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = Peer(reader, writer)
        peer.state["authenticated"] = False
        addr = writer.get_extra_info("peername")
        host = addr[0] if addr else "?"
        if not admission.admit(peer, host):
            writer.close()
            return
        last: asyncio.Task | None = None  # the latest `ordered` request's answer
        try:
            try:
                ok = await asyncio.wait_for(
                    auth.server_handshake_async(reader, writer, token, peer.address, role),
                    handshake_timeout)
            except asyncio.TimeoutError:
                _bursts.note("handshake", "authentication failed for %s: no answer within %g s",
                             peer.address, handshake_timeout)
                ok = False
            if not ok:
                return
            peer.state["authenticated"] = True
            admission.authenticated(peer, host)
            while True:
                if len(peer.tasks) >= max_pending:
                    # Enough of this connection's requests are waiting: read
                    # no more of it until one is answered.
                    await asyncio.wait(set(peer.tasks), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if not await drained(writer):  # its replies unread: read no more until they go
                    break
                try:
                    msg = await read_frame(reader, max_frame)
                except protocol.ProtocolError as exc:
                    log.warning("closing %s: %s", peer.address, exc)
                    writer.writelines(protocol.encode(protocol.error_reply(0, exc)))
                    break
                if msg is None:
                    break
                mid = msg["id"]
                try:
                    op, fields = protocol.validate_request(msg)
                except protocol.ProtocolError as exc:
                    log.warning("closing %s: %s", peer.address, exc)
                    writer.writelines(protocol.encode(protocol.error_reply(mid, exc)))
                    break
                if op in concurrent or op in ordered:
                    after = None
                    if op in ordered:
                        after = last if last is not None and not last.done() else None
                    task = asyncio.get_running_loop().create_task(
                        answer(peer, writer, mid, op, fields, after)
                    )
                    peer.tasks.add(task)
                    task.add_done_callback(peer.tasks.discard)
                    if op in ordered:
                        last = task
                    continue
                if last is not None:
                    if not last.done():  # ordered replies still to go: this one after them
                        await asyncio.wait([last])
                    last = None
                await answer(peer, writer, mid, op, fields)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # The server is shutting down. Ending quietly keeps Python 3.11's
            # stream callback from logging a traceback for the cancelled task.
            pass
        finally:
            admission.left(peer, host)
            peer.closed.set()
            for task in list(peer.tasks):
                task.cancel()
            if on_close is not None:
                on_close(peer)
            writer.close()

    # A deep accept queue: a burst of connections is taken in and sorted
    # out here (admission), instead of SYNs dropped and clients waiting 1 s.
    return await asyncio.start_server(connection, host, port, limit=1 << 20, backlog=backlog)


class AsyncClient:
    """asyncio request/reply connection that also dispatches pushes (id 0)."""

    def __init__(self, reader, writer, name: str, on_push=None):
        self._reader = reader
        self._writer = writer
        self.name = name
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._on_push = on_push
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        self.closed = asyncio.Event()

    @classmethod
    async def connect(
        cls, address: str, name: str, on_push=None, timeout: float = 10.0,
        token: bytes | None = None,
    ):
        """Connect to `address` ('host:port'), answering its challenge with `token`."""
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
            await auth.client_handshake_async(reader, writer, token, label, timeout)
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
        self._writer.writelines(protocol.encode(protocol.request(op, mid, **fields)))
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
            self._writer.writelines(protocol.encode(protocol.request(op, 0, **fields)))

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
