"""A learner's priority updates, sent without waiting for their replies.

`Learner.update_priorities` hands its keys and priorities to a
`PriorityUpdates` and returns: the update goes to the control plane at once
on a connection of its own when none is in flight, else it waits (with
every update made meanwhile) until the one in flight is answered, and then
all of them go as one request. So a learner that updates after every
training step never waits for a round trip, and one that updates back to
back sends a few large requests instead of many small ones (the control
plane applies a request's keys in order: a key updated twice keeps the
later priority, as two requests would leave it).

Replies are taken when they have come, at the next update, and whenever
everything must be applied (`settle`):
- before each sample request the learner sends (SampleStream's
  `before_request`), so a batch asked for after `update_priorities`
  returned follows the new priorities, as when updates waited;
- by `flush()` (`Learner.flush_priorities`), which also reports how many
  keys were updated and how many were missing since the last flush.
An update the control plane refused (an unknown table, a malformed request)
is raised by the next `update()` or `flush()`, never lost. A connection
lost with an update in flight sends it again once reconnected (setting a
priority twice is harmless).

Thread safety: `update` (the training thread) and `settle` (the prefetch
thread) may run at once; a lock orders them.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ...errors import ConnectionFailed, Timeout
from ...protocol.replies import check_reply

# Keys held while an update is in flight, past which update() waits for it:
# a learner far ahead of the control plane is slowed, not grown without bound.
MAX_HELD_KEYS = 1 << 20


def checked_priorities(keys, priorities) -> tuple[np.ndarray, np.ndarray]:
    """Keys (uint64) and priorities (float64) as flat arrays; ValueError
    unless there is one finite, non-negative priority per key."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
    prios = np.ascontiguousarray(priorities, dtype=np.float64).reshape(-1)
    if len(keys) != len(prios):
        raise ValueError(f"{len(keys)} keys but {len(prios)} priorities")
    if not np.isfinite(prios).all() or (prios < 0).any():
        bad = prios[~(np.isfinite(prios) & (prios >= 0))][:3]
        raise ValueError(f"priorities must be finite and >= 0; got {bad.tolist()}")
    return keys, prios


class PriorityUpdates:
    """Priority updates of one table over a connection made by `connect()`
    on first use (see the module docstring); `timeout`: how long settle and
    flush wait for the control plane."""

    def __init__(self, connect, table: str, timeout: float):
        self._connect = connect
        self.table = table
        self.timeout = timeout
        self._rpc = None
        self._lock = threading.Lock()
        self._held: list[tuple[np.ndarray, np.ndarray]] = []  # not sent yet
        self._held_keys = 0
        self._sent: tuple[np.ndarray, np.ndarray] | None = None  # in flight
        self._error: BaseException | None = None
        self.requests = 0  # update requests sent
        self.updated = self.missing = 0  # since the last flush
        self.missing_total = 0

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Send (or hold, while one is in flight) an update of `keys`
        (checked arrays: checked_priorities); raises an earlier update's
        error first."""
        with self._lock:
            self._raise_error()
            # Copies: a batch's keys are a view into the learner's ring,
            # rewritten by later samples while an update may still be held
            # (or sent again after a lost connection).
            self._held.append((keys.copy(), priorities.copy()))
            self._held_keys += len(keys)
            if self._sent is not None and self._rpc.wait_readable(0):
                self._take_reply(self.timeout)  # answered already: no wait
            if self._sent is None:
                self._send_held()
            deadline = time.monotonic() + self.timeout
            while self._held_keys > MAX_HELD_KEYS:
                self._take_reply(max(0.0, deadline - time.monotonic()))
                self._send_held()

    def settle(self) -> None:
        """Return once every update made so far is applied on the control
        plane (an error is kept for the next update or flush)."""
        with self._lock:
            self._settle()

    def flush(self) -> dict:
        """settle(), then raise a refused update's error, or return
        {"updated", "missing"}: keys updated, and keys no longer in the
        table (skipped), since the last flush."""
        with self._lock:
            self._settle()
            self._raise_error()
            counts = {"updated": self.updated, "missing": self.missing}
            self.updated = self.missing = 0
            return counts

    def close(self) -> None:
        """Apply what is held (best effort: an error is logged by the
        caller's close, not raised) and close the connection."""
        with self._lock:
            try:
                if self._rpc is not None or self._held:
                    self._settle()
            finally:
                if self._rpc is not None:
                    self._rpc.close()
                    self._rpc = None

    def _settle(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self._sent is not None or self._held:
            if self._sent is not None:
                self._take_reply(max(0.0, deadline - time.monotonic()))
            if self._held and self._error is None:
                self._send_held()
            elif self._error is not None:
                self._held, self._held_keys = [], 0  # refused: raised at the next call
                break

    def _send_held(self) -> None:
        """Send every held update as one request (nothing in flight)."""
        if not self._held:
            return
        if len(self._held) == 1:
            keys, prios = self._held[0]
        else:
            keys = np.concatenate([k for k, _ in self._held])
            prios = np.concatenate([p for _, p in self._held])
        self._held, self._held_keys = [], 0
        if self._rpc is None:
            self._rpc = self._connect()
        self._sent = (keys, prios)
        self.requests += 1
        try:
            self._rpc.send("update_priorities", table=self.table, keys=keys, priorities=prios)
        except ConnectionFailed:
            pass  # sent again by _take_reply, on the new connection

    def _take_reply(self, timeout: float) -> None:
        """Wait for the reply to the update in flight and count it; a lost
        connection sends it again once, a refusal is kept."""
        for attempt in range(2):
            try:
                if self._rpc.in_flight == 0:  # the connection broke while sending
                    raise ConnectionFailed(f"lost the connection to the {self._rpc.name}")
                reply = check_reply("update_priorities", self._rpc.receive(timeout),
                                    "control plane")
            except (ConnectionFailed, Timeout) as exc:
                if attempt or isinstance(exc, Timeout) or self._rpc.connected:
                    # a second loss, no reply in time, or an error reply
                    self._fail(exc)
                    return
                keys, prios = self._sent
                try:
                    self._rpc.send("update_priorities", table=self.table, keys=keys,
                                   priorities=prios)
                except ConnectionFailed as again:
                    self._fail(again)
                    return
                continue
            except Exception as exc:  # the control plane refused it
                self._fail(exc)
                return
            self._sent = None
            self.updated += reply["updated"]
            self.missing += reply["missing"]
            self.missing_total += reply["missing"]
            return

    def _fail(self, exc: BaseException) -> None:
        self._sent = None
        if self._error is None:
            self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

