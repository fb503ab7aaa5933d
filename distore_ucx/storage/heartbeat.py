"""A storage node's heartbeat: a thread and a control-plane connection of its own.

Sent from the node's event loop, a heartbeat waited behind whatever the
loop was doing (pulling and copying insert batches, registering them),
and on the control connection behind the node's own requests; on a busy
host (a storage node beside 128 actors on 2 cores) it came late by more
than the heartbeat timeout. Here a thread that only sleeps, sends a small
frame and reads the replies does it: the kernel wakes a sleeper promptly
and the thread holds the GIL for microseconds. The control plane also
measures the gaps between heartbeats (`heartbeat_gap_max` in `distore
status`). Thread safety: the node's loop only reads `fields()`; the thread
owns its connection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import DistoreError
from ..transport import rpc

log = logging.getLogger(__name__)

# Replies the control plane may owe before the thread stops sending (it is
# not reading them: more heartbeats would only fill the socket).
MAX_UNANSWERED = 64


class Heartbeat:
    """Sends `fields()` as a heartbeat every `interval()` seconds until closed.

    `fields` returns the heartbeat's fields, or None while the node is not
    registered (nothing is sent then).

    >>> beat = Heartbeat("127.0.0.1:7700", None, lambda: 0.5, node_fields, "node a")
    >>> beat.start(); ...; beat.close()
    """

    def __init__(self, address: str, token: bytes | None, interval: Callable[[], float],
                 fields: Callable[[], dict | None], name: str):
        self._address, self._token = address, token
        self._interval, self._fields = interval, fields
        self._name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.sent = 0

    def start(self) -> Heartbeat:
        """Start the thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (its connection closes with it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        conn: rpc.RpcClient | None = None
        last_error = ""
        due = time.monotonic()
        while True:
            interval = self._interval()
            due = max(due + interval, time.monotonic())  # no burst after a stall
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
            fields = self._fields()
            if fields is None:
                continue
            try:
                if conn is None:
                    conn = rpc.RpcClient(self._address, timeout=max(1.0, 4 * interval),
                                         name="control plane", token=self._token)
                while conn.in_flight and conn.wait_readable(0):
                    conn.receive(1.0)  # {"state": ...}: nothing to act on here
                if conn.in_flight < MAX_UNANSWERED:
                    conn.send("heartbeat", **fields)
                    self.sent += 1
                last_error = ""
            except DistoreError as exc:
                # The control plane is away: the node's control connection
                # sees it too and re-joins; beats resume on a new connection.
                if str(exc) != last_error:
                    log.info("%s: heartbeat: %s", self._name, exc)
                    last_error = str(exc)
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()
