"""Writer: inserts items (actor side), batched under the hood.

`insert` packs items by the table's spec and returns their keys at once;
items are sent to storage nodes in batches (round robin over live nodes),
with a bounded number of batches in flight. They are sampleable once the
node has acknowledged them: `flush()` sends what is buffered and waits for
every acknowledgement, and raises if any insert failed. Nothing is dropped
silently: a failed batch raises from `insert` or `flush`.

Order: a table's FIFO order is the order in which the control plane
registers batches. With `max_in_flight` > 1, two batches of one writer sent
to different nodes may be registered in either order; `max_in_flight=1`
keeps a writer's items in insertion order, at some cost in insert rate.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import ConnectionFailed, ConfigError, StorageFull
from ..transport import rpc
from .client import check_insert, ensure_open

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    table: str
    rows: np.ndarray  # (n, item_bytes) uint8
    keys: np.ndarray
    priorities: np.ndarray


class Writer:
    """Inserts items into tables; one per actor thread.

    >>> keys = writer.insert("replay", {"obs": obs, "action": a, "reward": r}, priority=1.0)
    >>> writer.flush()
    """

    def __init__(
        self,
        client,
        batch_bytes: int = 4 << 20,
        max_items: int = 1024,
        max_in_flight: int = 2,
        timeout: float = 60.0,
    ):
        """`timeout`: how long an insert may wait for a rate limiter (or a node)
        before failing with RateLimiterTimeout (or Timeout)."""
        if batch_bytes < 1 or max_items < 1 or max_in_flight < 1:
            raise ConfigError("batch_bytes, max_items and max_in_flight must be positive")
        self._client = client
        self.batch_bytes = batch_bytes
        self.max_items = max_items
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        reply = client.call("register_writer")
        self.writer_id = reply["writer_id"]
        self._key_base = np.uint64(self.writer_id << reply["key_bits"])
        self._seq = 0
        self._pending: dict[str, list[_Batch]] = {}
        self._pending_bytes: dict[str, int] = {}
        self._in_flight: deque[tuple[rpc.Client, _Batch, int, set[int]]] = deque()
        # Keyed by node id and address: a control plane that restarted afresh
        # may give a known address another id, or a known id another node.
        self._conns: dict[tuple[int, str], rpc.Client] = {}
        self._nodes: list[dict] = []
        self._rr = itertools.count()
        self._sent: dict[int, int] = {}  # bytes sent to each node (placement)
        self.inserted = 0
        self._closed = False

    def insert(self, table: str, data, priority=1.0) -> np.ndarray:
        """Insert one item or a batch (leading dimension); returns the new keys.

        `priority` is a scalar or one value per item. Keys are uint64, unique
        across the control plane.
        """
        check_insert(self, table, data, priority)
        spec = self._client.spec(table)
        rows = spec.pack(data)
        n = len(rows)
        prio = np.broadcast_to(np.asarray(priority, dtype=np.float64), (n,)).copy()
        if not np.isfinite(prio).all() or (prio < 0).any():
            raise ValueError("priorities must be finite and non-negative")
        keys = self._key_base + np.uint64(self._seq) + np.arange(n, dtype=np.uint64)
        self._seq += n
        self._pending.setdefault(table, []).append(_Batch(table, rows, keys, prio))
        self._pending_bytes[table] = self._pending_bytes.get(table, 0) + rows.nbytes
        pending_items = sum(len(b.keys) for b in self._pending[table])
        if self._pending_bytes[table] >= self.batch_bytes or pending_items >= self.max_items:
            self._send_pending(table)
        return keys

    def flush(self) -> None:
        """Send everything buffered and wait until every item is stored."""
        ensure_open(self, "writer")
        for table in list(self._pending):
            self._send_pending(table)
        while self._in_flight:
            self._complete_oldest()

    def close(self) -> None:
        """Flush, then close the connections to storage nodes."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------
    def _send_pending(self, table: str) -> None:
        batches = self._pending.pop(table, [])
        self._pending_bytes.pop(table, None)
        if not batches:
            return
        rows = np.concatenate([b.rows for b in batches]) if len(batches) > 1 else batches[0].rows
        keys = np.concatenate([b.keys for b in batches]) if len(batches) > 1 else batches[0].keys
        prio = (
            np.concatenate([b.priorities for b in batches])
            if len(batches) > 1
            else batches[0].priorities
        )
        # Messages stay bounded and large inserts spread over the nodes.
        step = max(1, min(self.max_items, self.batch_bytes // max(1, rows.shape[1])))
        for i in range(0, len(keys), step):
            while len(self._in_flight) >= self.max_in_flight:
                self._complete_oldest()
            chunk = _Batch(table, rows[i : i + step], keys[i : i + step], prio[i : i + step])
            self._send(chunk, exclude=set())

    def _send(self, batch: _Batch, exclude: set[int]) -> None:
        spec = self._client.spec(batch.table)
        while True:
            node_id, conn = self._next_node(exclude)
            try:
                conn.send(
                    "insert",
                    table=batch.table,
                    slot_size=spec.slot_size,
                    item_bytes=spec.item_bytes,
                    keys=batch.keys,
                    priorities=batch.priorities,
                    payload=batch.rows,
                    timeout=float(self.timeout),
                )
            except ConnectionFailed as exc:
                log.warning("storage node %d unreachable (%s); trying another", node_id, exc)
                self._drop(node_id)
                exclude.add(node_id)
                continue
            self._in_flight.append((conn, batch, node_id, exclude))
            self._sent[node_id] = self._sent.get(node_id, 0) + batch.rows.nbytes
            return

    def _complete_oldest(self) -> None:
        conn, batch, node_id, exclude = self._in_flight.popleft()
        try:
            conn.receive(self.timeout + 15.0)  # the node's own deadline comes first
        except ConnectionFailed as exc:
            # The node died; the control plane drops whatever it had stored.
            log.warning("lost storage node %d during an insert (%s); resending", node_id, exc)
            self._drop(node_id)
            self._send(batch, exclude | {node_id})  # acknowledged later, like the rest
            return
        except Exception as exc:
            # Settle every other batch in flight, so that after the error the
            # writer is in a known state, and say how many items were lost.
            lost = len(batch.keys)
            while self._in_flight:
                other = self._in_flight.popleft()
                try:
                    other[0].receive(self.timeout + 15.0)
                    self.inserted += len(other[1].keys)
                except Exception:
                    lost += len(other[1].keys)
            exc.args = (f"{exc.args[0] if exc.args else exc} [{lost} items not stored]",)
            raise
        self.inserted += len(batch.keys)

    def _next_node(self, exclude: set[int]) -> tuple[int, rpc.Client]:
        nodes = [n for n in self._nodes if n["node_id"] not in exclude]
        if not nodes:
            self._nodes = self._client.nodes()
            nodes = [n for n in self._nodes if n["node_id"] not in exclude]
        if not nodes:
            raise StorageFull(
                "no live storage node to insert into"
                + (f" (tried nodes {sorted(exclude)})" if exclude else "")
                + ": start storage nodes (distore node --control ...)"
            )
        # The node this writer has sent the fewest bytes to: round robin by
        # batch would send every first chunk of a split insert to one node.
        node = min(nodes, key=lambda n: (self._sent.get(n["node_id"], 0), next(self._rr)))
        conn = self._conns.get((node["node_id"], node["address"]))
        if conn is None:
            conn = rpc.Client(node["address"], self.timeout, name=f"storage node {node['name']}",
                              token=self._client.token)
            self._conns[(node["node_id"], node["address"])] = conn
        return node["node_id"], conn

    def _drop(self, node_id: int) -> None:
        for key in [k for k in self._conns if k[0] == node_id]:
            self._conns.pop(key).close()
        self._nodes = [n for n in self._nodes if n["node_id"] != node_id]
