"""A learner's stream of sample replies from the control plane.

One control connection, replies in order. The next batch's request is sent
before the current batch is read, so its round trip overlaps the transfer
(pipelining). While `sample()` is called back to back, one request asks for
`sample_ahead` batches at once, and its reply is split into one-batch
replies (sampling ahead). While replies carry cold items (read from a
node's disk tier while the control plane holds the reply) COLD_DEPTH
requests are kept in flight, so the node reads one batch while the other's
reads complete.

Leases: a reply's lease covers every batch split from it; once the last of
them is read, the lease is released with the next request (and whatever
is still held, when the stream is closed). A learner's prefetch thread
collects the leases of each batch it reads ahead instead
(`collect_leases`) and gives them back once the batch is handed out
(`give_back`, from the consumer's thread): an item evicted while its batch
waits to be taken is then still leased, so its node marks its slot and
the hand-out re-check finds it (client/learner/recheck.py).

A lease lasts the control plane's lease_timeout from its grant, which the
reply gives with the time the request waited there (`held`). Each reply's
`deadline` counts from when its request was sent, less a quarter of the
timeout for the read and the hand-out re-check: a batch of a reply past it
(a learner that paused longer than the lease, with a reply asked ahead or
sampled ahead) is dropped and sampled again, never read: an item evicted
once its lease expired is freed unmarked, header intact, and no check
could tell it from a live one. The prefetch thread's batches carry the
earliest deadline of their replies (`collected`) for the hand-out.

Each reply is checked against its declaration as it arrives (`check_reply`,
cheap enough for once per batch): a malformed one fails here, naming the
field, not in the gather that reads it.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time

import numpy as np

from ...config import sample_ahead_from_env
from ...errors import ConfigError, ConnectionFailed, DistoreError, NoData, RateLimiterTimeout
from ...protocol import ITEM_LOCATION, check_reply

log = logging.getLogger(__name__)

# Sampling ahead (see Learner): items one control-plane request asks for at
# most by default, and whatever the caller asks.
SAMPLE_AHEAD_ITEMS = 256
MAX_SAMPLE_AHEAD_ITEMS = 4096
# ... and at most this many bytes of items by default: a request's items stay
# leased until its last batch is read, and an item evicted while leased keeps
# its slot until then (10 MB items, batches of 4: 6 batches ahead, not 8).
SAMPLE_AHEAD_BYTES = 256 << 20
# A learner samples ahead only while sample() is called back to back: gaps
# between one batch read and the next call shorter than this, twice running.
# A training step between samples is longer; then a request asks one batch,
# leases live one step, and priority updates show a batch later, as before.
AHEAD_GAP = 0.001
# Sample requests a learner keeps in flight while its replies carry cold
# items (read from a node's disk tier while the control plane holds the
# reply): the node then has the next request before it has finished the
# current one, and the disk never waits for the learner's round trip. Each
# adds one batch to the staging space a learner holds (docs/operations.md).
COLD_DEPTH = 2
# A reply's batches are read, and the prefetch thread's handed out, within
# this share of its lease (from the request's sending); the rest is margin
# for the read and the hand-out re-check to finish while it still holds.
LEASE_USE = 0.75


def resolve_sample_ahead(asked: int | None, batch_size: int, consuming: bool,
                 slot_bytes: int = 0) -> int:
    """Batches per control-plane request (see Learner's `sample_ahead`);
    `slot_bytes` (an item's slot) bounds the default by SAMPLE_AHEAD_BYTES.

    >>> resolve_sample_ahead(None, 32, consuming=False)  # DISTORE_SAMPLE_AHEAD unset
    4
    """
    if consuming:
        if asked not in (None, 1):
            raise ConfigError(
                f"sample_ahead={asked}: this table's sampling uses items up (max_times_sampled, "
                "a queue or a rate limiter), so batches cannot be sampled ahead; leave it out")
        return 1
    if asked is None:
        asked = sample_ahead_from_env()
        if asked is None:
            by_bytes = SAMPLE_AHEAD_BYTES // max(1, batch_size * slot_bytes)
            return max(1, min(8, SAMPLE_AHEAD_ITEMS // batch_size, by_bytes))
    if asked < 1 or asked * batch_size > MAX_SAMPLE_AHEAD_ITEMS:
        raise ConfigError(
            f"sample_ahead={asked} with batch_size={batch_size}: it must be at least 1 and ask "
            f"for at most {MAX_SAMPLE_AHEAD_ITEMS} items per request (1 turns it off)")
    return asked


class SampleStream:
    """Sample replies of one table, one batch each, over the learner's own
    control connection `rpc` (which the learner owns and closes). Used
    from one thread at a time (the prefetch thread, while iterating).

    `pipelined`: keep the next request in flight (and ask for the first
    batch now, without waiting for data); `ahead`: batches one request asks
    for while samples come back to back; `before_request`: called before
    each request is sent.
    """

    def __init__(self, rpc, table: str, batch_size: int, ahead: int, pipelined: bool,
                 before_request=None):
        self.rpc = rpc
        # Called before each sample request goes: the learner's priority
        # updates made so far are applied first (PriorityUpdates.settle).
        self._before_request = before_request
        self.table = table
        self.batch_size = batch_size
        self.per_request = ahead
        self.pipelined = pipelined
        self.session = rpc.session  # a new one means a new control-plane connection
        self.requests = 0  # sample requests sent to the control plane
        self.done_leases: list[int] = []  # leases of batches already read
        # done_leases is also extended by the consumer's thread (give_back)
        # while the prefetch thread sends requests: this guards it.
        self._leases_lock = threading.Lock()
        # Leases being collected for a batch read ahead (collect_leases), or
        # None: released with the next request as read.
        self._collecting: list[int] | None = None
        self._collect_deadline = math.inf  # the earliest deadline of those rows' replies
        # When each request in flight was sent (replies come in order): a
        # reply's deadline counts from its request's.
        self._sent: collections.deque[float] = collections.deque()
        self.expired = 0  # batches dropped unread: their lease might have expired
        # Replies received but not yet used (a resample had to wait behind
        # them); the requests still in flight are self.rpc.in_flight.
        self.received: list[dict] = []
        # Sample requests kept in flight ahead of the batch being read: one,
        # or COLD_DEPTH while replies carry cold items (set in _next_reply).
        self.depth = 1
        # Batches of a reply sampled ahead, not yet read; the last one carries
        # the reply's lease (released once every batch of it has been read).
        self.ahead: list[dict] = []
        self._fast = 0  # back-to-back samples in a row (see AHEAD_GAP), up to 2
        self._read_at: float | None = None  # when the last batch was read
        # The first batch's locations are asked for first (without waiting for
        # data): the control plane answers while the learner makes its ring,
        # endpoints and mappings, so the first sample() finds the reply
        # waiting. Not where sampling uses items up (see Learner._consuming).
        self._early = False
        if pipelined:
            self._send(0.0)
            self._early = True

    def starting(self) -> None:
        """A batch is about to be sampled: count back-to-back calls."""
        now = time.monotonic()
        if self._read_at is not None:
            self._fast = min(self._fast + 1, 2) if now - self._read_at < AHEAD_GAP else 0

    def read(self) -> None:
        """The batch sampled last has been read."""
        self._read_at = time.monotonic()

    def next(self, wait: float) -> tuple[dict, bool]:
        """The next batch's reply, and whether the control-plane connection
        is new since the last one (its leases are gone: a control plane
        that started afresh numbers nodes anew, so look every node up
        again). With pipelining, the last batch of a reply sends the next
        requests before it is read."""
        reply = self._next_reply(wait)
        if self.pipelined and not self.ahead:
            self._top_up(wait)  # the last batch of a reply: ask for the next ones
        renewed = self.rpc.session != self.session
        if renewed:
            self.session = self.rpc.session
            with self._leases_lock:
                self.done_leases = []
            self.ahead = []  # sampled under the old connection: its leases are gone
            self.received = []
        return reply, renewed

    def release_later(self, leases: list[int]) -> None:
        """Leases of rows read: released with the next request (or kept for
        the batch being read ahead, see collect_leases)."""
        if self._collecting is not None:
            self._collecting.extend(leases)
            return
        with self._leases_lock:
            self.done_leases.extend(leases)

    def collect_leases(self) -> None:
        """From now until `collected()`, keep the leases of the rows read
        instead of releasing them (the prefetch thread, reading a batch that
        will wait to be taken)."""
        self._collecting = []
        self._collect_deadline = math.inf

    def collected(self) -> tuple[int, list[int], float]:
        """Stop collecting: (session, the leases collected, the earliest
        deadline of the replies read meanwhile: the batch must be handed
        out before it), for give_back."""
        leases, self._collecting = self._collecting or [], None
        return self.session, leases, self._collect_deadline

    def _using(self, reply: dict) -> dict:
        """`reply` is about to be read: its deadline joins the collected one."""
        if self._collecting is not None:
            self._collect_deadline = min(self._collect_deadline, reply["deadline"])
        return reply

    def give_back(self, session: int, leases: list[int]) -> None:
        """Leases collected for a batch that was handed out (or dropped):
        released with the next request. Any thread. Leases of an earlier
        control-plane connection are dropped: they went with it."""
        if not leases or session != self.session:
            return
        with self._leases_lock:
            self.done_leases.extend(leases)

    def resample(self, n: int, wait: float) -> dict:
        """n items now, for rows that failed their read; replies of the
        requests in flight are kept for the next batches."""
        while self.rpc.in_flight:  # their replies come first: keep them for the next batches
            try:
                self.received.append(self._receive(wait + 10.0))
            except ConnectionFailed as exc:  # the rest went with the connection
                log.warning("table %r: %s; asking again", self.table, exc)
        return self._using(self._call(n, wait))

    def release_all(self, timeout: float) -> None:
        """Release every lease the stream holds: of batches read, sampled
        ahead and in flight (their replies are waited for, up to `timeout`
        s each). A connection that is gone keeps them: they expire."""
        try:
            if not self.rpc.connected:
                # Lost with the control plane: its leases are gone or will
                # expire; do not wait for it to come back just to say so.
                self.received, self.done_leases, self.ahead = [], [], []
            self.done_leases.extend(r["lease"] for r in self.ahead if r["lease"] is not None)
            self.ahead = []
            while self.rpc.in_flight:
                try:
                    self.received.append(self._receive(timeout + 10.0))
                except (NoData, RateLimiterTimeout):
                    pass  # that request was answered without a lease
            self.done_leases.extend(r["lease"] for r in self.received)
            self.received = []
            if self.done_leases:
                self.rpc.call("release", leases=self.done_leases)
        except DistoreError:
            pass  # the leases will expire
        self.done_leases = []

    # -- requests (one connection, replies in order) -----------------------
    def _fields(self, n: int, wait: float) -> dict:
        if self._before_request is not None:
            self._before_request()
        self.requests += 1
        self._sent.append(time.monotonic())
        with self._leases_lock:
            release, self.done_leases = self.done_leases, []
        fields = {"table": self.table, "n": n, "release": release, "timeout": wait}
        if n > self.batch_size:  # sampled ahead: the answer may hold fewer batches
            fields["batch"] = self.batch_size
        return fields

    def _next_reply(self, wait: float) -> dict:
        """The next batch's reply: one sampled ahead, or a new reply split
        into `sample_ahead` batches; never one past its deadline (see the
        module's docstring): those are dropped, their leases released."""
        while True:
            if not self.ahead:
                reply = self._new_reply(wait)
                self.depth = COLD_DEPTH if reply.get("staged", 0) else 1
                self.ahead = self._split(reply)
            reply = self.ahead.pop(0)
            if time.monotonic() < reply["deadline"]:
                return self._using(reply)
            # Sampled too long ago: it and the rest of its reply go unread.
            self.expired += 1 + len(self.ahead)
            self.give_back(self.session, [r["lease"] for r in [reply, *self.ahead]
                                          if r["lease"] is not None])
            self.ahead = []

    def _split(self, reply: dict) -> list[dict]:
        """A reply of k x batch_size items as k one-batch replies, in order;
        only the last carries the lease (every batch of it must be read
        before it is released)."""
        items = reply["items"]
        n = len(items) // ITEM_LOCATION.itemsize
        if n <= self.batch_size:
            return [reply]
        probs = np.frombuffer(reply["probabilities"], np.float64)
        b, rec = self.batch_size, ITEM_LOCATION.itemsize
        steps = {}  # a table of slices: each row's position and flags too
        if reply.get("positions") is not None:
            steps = {"positions": np.frombuffer(reply["positions"], np.uint32),
                     "step_flags": np.frombuffer(reply["step_flags"], np.uint8)}
        parts = [dict(reply, lease=None, items=items[i * rec:(i + b) * rec],
                      probabilities=probs[i:i + b],
                      **{k: v[i:i + b] for k, v in steps.items()}) for i in range(0, n, b)]
        parts[-1]["lease"] = reply["lease"]
        return parts

    def _new_reply(self, wait: float) -> dict:
        if self.received:
            return self.received.pop(0)
        while self.rpc.in_flight:
            early, self._early = self._early, False
            try:
                return self._receive(wait + 10.0)
            except ConnectionFailed as exc:
                # The control plane went away with our requests (in_flight is
                # now 0), or answered this one with a failure (a node left
                # while it staged cold items) and the next is on its way:
                # take the next, or ask again (the call waits for it to come
                # back, up to the timeout).
                log.warning("table %r: %s; asking again", self.table, exc)
            except (NoData, RateLimiterTimeout):
                if not early:
                    raise
                # The request made at creation does not wait for data: this
                # one does, up to the caller's timeout.
        return self._call(self._ask, wait)

    def _receive(self, timeout: float) -> dict:
        """The reply to the oldest request in flight, checked and given its
        deadline."""
        sent = self._sent[0] if self._sent else time.monotonic()
        try:
            return self._checked(self.rpc.receive(timeout), sent)
        finally:
            self._answered()

    def _call(self, n: int, wait: float) -> dict:
        """Ask for n items and wait for them (nothing else in flight)."""
        fields = self._fields(n, wait)
        sent = self._sent[-1]
        try:
            return self._checked(self.rpc.call("sample", reply_timeout=wait + 10.0, **fields),
                                 sent)
        finally:
            self._answered()

    def _answered(self) -> None:
        """Forget the send times of requests answered (replies come in
        order) or gone with the connection."""
        while len(self._sent) > self.rpc.in_flight:
            self._sent.popleft()

    def _checked(self, reply: dict, sent: float) -> dict:
        """A sample reply, checked against its declaration (protocol/replies.py),
        with its `deadline`: past it, none of its batches is used."""
        reply = check_reply("sample", reply, self.rpc.name)
        reply["deadline"] = sent + reply["held"] + reply["lease_timeout"] * LEASE_USE
        return reply

    @property
    def _ask(self) -> int:
        """Items one sample request asks for: sample_ahead batches while
        samples come back to back, else one."""
        return self.batch_size * (self.per_request if self._fast >= 2 else 1)

    def _send(self, wait: float) -> None:
        self.rpc.send("sample", **self._fields(self._ask, wait))

    def _top_up(self, wait: float) -> None:
        """Send sample requests until `depth` are in flight or received
        but unused. Cold items are read from disk by their node while the
        control plane holds the reply; with two requests in flight the node
        has the next batch's request before it has finished the current
        one's, so the disk does not wait for the learner's round trip."""
        while self.rpc.in_flight + len(self.received) < self.depth:
            self._send(wait)
