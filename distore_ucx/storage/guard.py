"""The storage node's guard against peers' remote writes (native/guard.h).

A node's arena is registered for remote READ only, but over TCP UCX takes a
put to whatever address a peer names. Before the node's UCX worker exists,
`guard_remote_access` makes this process refuse such puts and returns the
UCX options that go with it; `watch_guard` then logs what the guard refused.
"""

from __future__ import annotations

import asyncio
import logging

from .._native_loader import _native
from ..config import ucx_tls
from ..transport.runtime import without_direct_writes

log = logging.getLogger(__name__)

# s between looks at the remote-access guard's counters, and at the listeners'
# connections (one that has not authenticated within a second is closed then)
GUARD_CHECK = 0.5


def guard_remote_access() -> dict[str, str]:
    """Make this process refuse UCX puts from peers (native/guard.h); returns
    the UCX options the node's runtime needs for it.

    Over TCP a put is a write to whatever address the peer names: UCP's
    software put (endpoints with peer-failure handling) is dropped by its
    handler; the TCP transport's own put (endpoints without) ends the
    peer's connection unless it lands in a slot the node is receiving an
    insert into. Where that cannot be installed, the node stops advertising
    TCP puts (UCX_TCP_PUT_ENABLE=n: stock UCX peers then use the software
    put) and says so. Same-host transports that write memory directly
    (cma: process_vm_writev) are left out of the node's UCX_TLS, so that a
    peer's UCX never puts through them.

    UCX_ADAPTIVE_PROGRESS=n: with adaptive progress UCX deactivates a
    transport when its last endpoint goes, and over TCP the node then never
    woke for a new reader again once a reader without peer-failure handling
    had been its only one and left. Both are tested in
    tests/integration/test_remote_writes.py."""
    options = {"ADAPTIVE_PROGRESS": "n", "TLS": without_direct_writes(ucx_tls())}
    why = _native.refuse_remote_writes()
    if why:
        log.warning("cannot refuse UCX software puts (%s): a peer's put over TCP could fault "
                    "or corrupt this node", why)
    why = _native.refuse_tcp_puts()
    if why:
        options["TCP_PUT_ENABLE"] = "n"
        log.warning("cannot guard UCX's TCP transport against puts (%s): this node does not "
                    "advertise TCP puts, so stock UCX peers do not use them, but a modified "
                    "peer could still write into it; run UCX 1.19-1.22 for the guard", why)
    return options


async def watch_guard(name: str, checks=()) -> None:
    """Log each burst of remote accesses the guard refused (native/guard.h) on
    node `name`: one line per check that saw new ones, with the last in words;
    call each of `checks` (other counters' watches) at the same pace. Runs
    until cancelled."""
    seen, accepted = (0, 0, 0), 0
    while True:
        await asyncio.sleep(GUARD_CHECK)
        for check in checks:
            check()
        g = _native.refused_remote_access()
        if g["tcp_puts_accepted"] != accepted:
            accepted = g["tcp_puts_accepted"]
            log.debug("node %s: %d TCP puts landed in slots receiving inserts so far",
                      name, accepted)
        now = (g["software_writes"], g["reads"], g["tcp_puts"])
        if now == seen:
            continue
        new = [a - b for a, b in zip(now, seen)]
        seen = now
        log.warning("node %s refused remote access: %d software put(s) or atomic(s), %d "
                    "read(s) outside the arena, %d TCP connection(s) ended for a put "
                    "outside an insert%s; the node serves on", name, *new,
                    f" (last: {g['last_tcp_put']})" if new[2] else "")
