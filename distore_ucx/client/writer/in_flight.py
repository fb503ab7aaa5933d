"""A writer's batches in flight: sent, waiting for acknowledgement, resent, settled.

A batch goes to the node placement chooses (client/writer/placement.py) and waits
in a queue, oldest first, for the node's acknowledgement; its staging buffer
is refilled only after that. Each batch waits at most the writer's
`timeout` from when it was sent; while a node's reply takes longer than
HUNG_CHECK s, the control plane is asked whether the node is still live.
A batch unacknowledged for WAIT_NOTICE s is logged once (until the next
acknowledgement), saying why it waits where the control plane can tell: a
table whose rate limiter holds inserts until learners sample it (a
process whose learners have stopped otherwise sits silent in `flush()`,
or at exit, for the whole timeout).

A node that dies (or is marked unresponsive) with a batch in flight: the
batch goes to another node (the control plane drops whatever the dead node
held, so nothing is doubled). A node that answers StorageFull: another node
is tried, and StorageFull is raised only when none is left. Any other
failure settles the writer: every other batch in flight is waited for, the
open ones are dropped, and the failure says what was and was not stored
(client/writer/failures.py). Thread safety: none (a writer is used by one
thread).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from ... import metrics
from ...errors import ConnectionFailed, StorageFull
from ...protocol import check_reply
from ...transport import rpc
from .connections import node_state
from .failures import Failed, deadlock_hint, waiting_for_samples
from .keys import KeyRange
from .placement import Placement
from .send import Sender
from .staging import StagedBatch, StagingPool

log = logging.getLogger(__name__)

# While a node's reply takes longer than this, the writer checks every this
# often that the control plane still lists the node.
HUNG_CHECK = 0.5
# A batch unacknowledged this many seconds after it was sent is logged.
WAIT_NOTICE = 5.0


class InFlight:
    """The writer's batches sent and not yet acknowledged, oldest first."""

    def __init__(self, client, pool: StagingPool, placement: Placement, sender: Sender,
                 keys: KeyRange, timeout: float):
        self._client = client
        self._pool = pool
        self._placement = placement
        self._sender = sender
        self._keys = keys
        self.timeout = timeout
        self.queue: deque[tuple[rpc.RpcClient, StagedBatch, int, set[int]]] = deque()
        self.inserted = 0
        self._noticed = False  # a wait was logged since the last acknowledgement
        self.stats = metrics.WriterStats()  # ds.metrics.registry() reads it (writer.stats)

    def open_batch(self, table: str, spec) -> StagedBatch:
        """A new batch of `table` being filled; waits for acknowledgements
        when every staging buffer holds a batch."""
        pool = self._pool
        while (buf := pool.spare()) is None:
            if self.queue:
                self.complete_oldest()
            else:  # every buffer holds another table's open batch: send one
                self.send(pool.open.pop(next(iter(pool.open))), set())
        return pool.open_batch(table, spec, buf)

    def send(self, batch: StagedBatch, exclude: set[int], full: StorageFull | None = None) -> None:
        """Send `batch` to a node not in `exclude`. `full`: a node's StorageFull
        that made us try another; raised (it says what holds the space) when
        no other node is left."""
        batch.group_episodes()  # a table of slices: each episode's steps together
        nbytes = batch.n * batch.spec.item_bytes
        while True:
            try:
                node, conn = self._placement.choose(exclude, batch.buffer.index, nbytes,
                                                    self.timeout)
            except StorageFull as exc:
                raise self._settle(full or exc, batch) from None
            node_id = node["node_id"]
            try:
                self._sender.send(node, conn, batch, self.timeout)
            except ConnectionFailed as exc:
                log.warning("storage node %d unreachable (%s); trying another", node_id, exc)
                self._placement.drop(node_id)
                exclude.add(node_id)
                continue
            batch.sent = time.perf_counter()
            self.queue.append((conn, batch, node_id, exclude))
            self._placement.sent(node_id, nbytes)
            return

    def wait_all(self) -> None:
        """Wait until every batch in flight is acknowledged (or resent and then
        acknowledged)."""
        while self.queue:
            self.complete_oldest()

    def complete_oldest(self) -> None:
        """Wait for the oldest batch's acknowledgement and take its buffer
        back; resend it when its node was lost or full."""
        conn, batch, node_id, exclude = self.queue.popleft()
        try:
            self._wait_for_node(conn, node_id, batch)
            # the node's own deadline comes first
            reply = check_reply("insert", conn.receive(self.timeout + 15.0), conn.name)
        except ConnectionFailed as exc:
            if rpc.interrupted():
                # ^C: the store's nodes stop with it (a LocalCluster's, a
                # terminal's process group); resending would only wait.
                raise
            # The node died (or is leaving); the control plane drops whatever
            # it had stored, and our buffer still holds the batch.
            log.warning("lost storage node %d during an insert (%s); resending", node_id, exc)
            self._placement.drop(node_id)
            self.send(batch, exclude | {node_id})  # acknowledged later, like the rest
            return
        except StorageFull as exc:
            # This node has no room (for this table's slots): another may.
            log.info("storage node %d is full (%s); trying another", node_id, exc)
            self._placement.full(node_id)
            self.send(batch, exclude | {node_id}, exc)
            return
        except Exception as exc:
            raise self._settle(exc, batch) from None
        self._stored(batch, node_id, reply)

    def _wait_for_node(self, conn: rpc.RpcClient, node_id: int, batch: StagedBatch) -> None:
        """Wait for a node's reply; while it takes more than HUNG_CHECK s, ask
        the control plane every HUNG_CHECK s whether the node is still live.
        A node it marked unresponsive or gone (stopped, hung, cut off) fails
        like a lost one (the batch goes to another node) instead of holding
        the writer for the whole timeout. `batch` (the one waited for) is
        logged once it has waited WAIT_NOTICE s."""
        deadline = time.monotonic() + self.timeout + 15.0
        while not conn.wait_readable(HUNG_CHECK) and time.monotonic() < deadline:
            if not self._noticed and time.perf_counter() - batch.sent >= WAIT_NOTICE:
                self._noticed = True
                self._notice_wait(batch, node_id)
            # Only a node this control plane knows as unresponsive or gone is
            # given up on: it can no longer register the batch (the control
            # plane refuses inserts placed before a node's latest unresponsive
            # spell, and a key it holds already is not stored twice). An id
            # it does not know yet is a node that has not re-joined a
            # restarted control plane: it will, under the same id, and
            # register the batch; resending it would store it twice.
            state = node_state(self._client, node_id)  # "live" while the control plane is away
            if state != "live":
                raise ConnectionFailed(
                    f"storage node {node_id} is {state} (no heartbeat: stopped, hung or cut "
                    "off) while it held an insert"
                )

    def _notice_wait(self, batch: StagedBatch, node_id: int) -> None:
        """Log that `batch` has waited WAIT_NOTICE s or more, and why if the
        control plane can tell."""
        waited = time.perf_counter() - batch.sent
        info = waiting_for_samples(self._client, batch.table, batch.n)
        if info is not None:
            why = (f"table {batch.table!r} takes no more inserts until it is sampled "
                   f"(its rate limiter; samples so far: {info['samples']}): are its learners "
                   "still sampling?")
        else:
            why = "the node is live and has not answered yet."
        log.warning("writer %d: %d items for table %r have waited %.0f s for storage node %d "
                    "to store them: %s The writer waits up to its timeout (%g s) for each "
                    "batch, then fails it.", self._keys.writer_id, batch.n, batch.table, waited,
                    node_id, why, self.timeout)

    def _stored(self, batch: StagedBatch, node_id: int, reply: dict) -> None:
        self._noticed = False
        self.inserted += batch.n
        st = self.stats  # metrics: once per batch
        st.batches, st.items = st.batches + 1, st.items + batch.n
        st.bytes += batch.n * batch.spec.item_bytes
        st.latency.observe(time.perf_counter() - batch.sent)
        self._pool.release(batch.buffer)
        via = reply["via"]
        paths = self._placement.paths
        if paths.get(node_id) != via:
            paths[node_id] = via
            log.info("writer %d: storage node %d reads inserts via %s", self._keys.writer_id,
                     node_id, via)

    def _settle(self, exc: Exception, failed: StagedBatch) -> Failed:
        """After `failed` could not be stored: wait for every other batch in
        flight, drop the open ones, and describe what was and was not stored."""
        stored, unstored = [], [failed.all_keys()]
        pool = self._pool
        pool.release(failed.buffer)
        while self.queue:
            conn, batch, node_id, _ = self.queue.popleft()
            try:
                self._wait_for_node(conn, node_id, batch)
                reply = check_reply("insert", conn.receive(self.timeout + 15.0), conn.name)
            except Exception:
                unstored.append(batch.all_keys())
                pool.release(batch.buffer)
                continue
            stored.append(batch.all_keys())
            self._stored(batch, node_id, reply)
        for batch in pool.open.values():
            if batch.n:
                unstored.append(batch.all_keys())
            pool.release(batch.buffer)
        pool.open.clear()
        hint = deadlock_hint(self._client, exc, failed.table, failed.n)
        return Failed(exc, stored, unstored, hint)
