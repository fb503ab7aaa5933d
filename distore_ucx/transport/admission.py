"""What connections may cost a server, whoever opens them (docs/operations.md).

A server (transport/server.py) admits each accepted connection here: at
most MAX_PER_PEER per host, as many in all as the open-file limit leaves
(raised to its hard limit first), and at most MAX_UNAUTHENTICATED_PER_PEER
per host still authenticating, the oldest closed for a new one. Refusals
and failed accepts are logged once per burst, not once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import weakref
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .peer import Peer

__all__ = [
    "FD_RESERVE",
    "MAX_PER_PEER",
    "MAX_UNAUTHENTICATED_PER_PEER",
    "ConnectionAdmission",
    "bursts",
    "quiet_accept_errors",
    "raise_open_file_limit",
]

MAX_PER_PEER = 4096  # connections from one host (IP address)
MAX_UNAUTHENTICATED_PER_PEER = 64  # of them still authenticating: the oldest goes first
FD_RESERVE = 128  # descriptors never given to connections (files, UCX, /metrics, logs)
BURST_LOG_EVERY = 10.0  # s: one log line per burst of refusals, not one per connection

log = logging.getLogger(__name__)


class Bursts:
    """One log line per burst of like events (refused connections, accept
    failures) rather than one per event: the first is logged, then at most
    one line every BURST_LOG_EVERY s with the count since the last."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._since: Counter = Counter()

    def note(self, key: str, message: str, *args: Any) -> None:
        """Count one event of kind `key`; log `message` if its burst's line is due."""
        now = time.monotonic()
        self._since[key] += 1
        last = self._last.get(key)
        if last is not None and now - last < BURST_LOG_EVERY:
            return
        n = self._since.pop(key)
        more = f" ({n} times in the last {now - last:.0f} s)" if last is not None else ""
        log.warning(message + more, *args)
        self._last[key] = now


bursts = Bursts()
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


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop` log an accept that fails for lack of descriptors once per
    burst, not with a traceback per attempt (asyncio retries every second)."""
    if loop in _quiet_loops:
        return
    _quiet_loops.add(loop)
    previous = loop.get_exception_handler()

    def handler(loop, context):
        if "accept" in str(context.get("message", "")) and \
                isinstance(context.get("exception"), OSError):
            bursts.note("accept", "cannot accept connections: %s (out of descriptors or "
                         "memory); retrying", context["exception"])
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class ConnectionAdmission:
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
        """Take a new connection from `host`, or say False (it is then closed)."""
        if self.by_host[host] >= MAX_PER_PEER:
            bursts.note("per-peer", "refusing connections from %s: it holds %d (at most %d "
                         "per host)", host, self.by_host[host], MAX_PER_PEER)
            return False
        if self.total >= self.limit and not self._evict_oldest():
            bursts.note("total", "refusing connections: %d open, the most this process "
                         "serves with its open-file limit", self.total)
            return False
        if self.authenticating:
            mine = self.waiting.setdefault(host, OrderedDict())
            if len(mine) >= MAX_UNAUTHENTICATED_PER_PEER:
                self._evict(next(iter(mine)), host)
                bursts.note("unauthenticated", "closing the oldest of %d connections from %s "
                             "that have not authenticated, to take a new one",
                             MAX_UNAUTHENTICATED_PER_PEER, host)
            mine[peer] = None
        self.total += 1
        self.by_host[host] += 1
        return True

    def authenticated(self, peer: Peer, host: str) -> None:
        """`peer` answered its challenge: it can no longer be evicted as idle."""
        mine = self.waiting.get(host)
        if mine is not None:
            mine.pop(peer, None)
            if not mine:
                del self.waiting[host]

    def left(self, peer: Peer, host: str) -> None:
        """`peer`'s connection ended: it no longer counts."""
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
