"""The blocking side of the control channel: `RpcClient`, with reconnects.

An `RpcClient` is one TCP connection for user threads (writers, learners, the
CLI): it authenticates through transport/auth.py, sends requests and reads
their replies in order through transport/frames.py. With `reconnect` > 0
(connections to the control plane) a lost connection is made again on the
next request, within a time limit, and a request whose reply was lost is
sent once more.
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import sys
import threading
import time
from typing import Any

from .. import errors, protocol
from . import auth
from .address import parse_address
from .auth import PROBE_AFTER
from .frames import recv_frame, send_frame

__all__ = ["PROBE_AFTER", "RpcClient", "interrupted"]


log = logging.getLogger(__name__)


def interrupted() -> bool:
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


class RpcClient:
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
        if interrupted():
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
                            or self._give_up.is_set() or interrupted():
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
        msg = protocol.request(op, mid, **fields)
        try:
            send_frame(self._sock, msg)
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
            msg = recv_frame(self._sock)
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

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
