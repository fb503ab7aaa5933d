"""Sending a batch to a storage node: the descriptor, and how the items travel.

The writer sends the node a small descriptor over its connection (keys,
priorities, the staging buffer's remote key, address and item offsets); the
node then reads the items itself, straight into its arena slots
(storage/pulls.py), and acknowledges. How it reads them is the batch's path:

- same host, mapping on: the writer hands the node the buffer's sealed memfd
  once, under a random ticket (transport/local_map.py); the descriptor names
  the ticket and the node copies with plain loads from a read-only mapping;
- same host otherwise: process_vm_readv (cma), or a UCX get;
- another host (or shared memory off): to a node that takes them (it
  advertises an `insert_port`: UCX emulates RMA there, and
  DISTORE_AM_INSERTS=0 is not set), items of at least DISTORE_AM_MIN_ITEM
  bytes go as UCX active messages with rendezvous over a connection to the
  node's insert listener (peer-failure handling, zero-copy), posted just
  before the descriptor, which names them by a random batch token; the
  node receives each into its slot. Items that follow one another go
  several to a message, up to the node's `insert_run_bytes` (runs,
  native/am_insert.h), unless DISTORE_AM_INSERT_RUNS=0. Otherwise, and
  for a while after the listener could not be reached, the node reads
  them with UCX gets.

Thread safety: none (a writer is used by one thread).
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import numpy as np

from ..._native_loader import _native
from ...errors import ConnectionFailed, UcxError
from ...protocol import AM_INSERT_AUTH_ID, AM_INSERT_ID
from ...transport import rpc
from ...transport.address import parse_address
from ...transport.local_map import send_staging
from ...transport.same_host import host_id
from .connections import CONNECT_TIMEOUT, Connections
from .keys import KeyRange
from .staging import StagedBatch, StagingBuffer

log = logging.getLogger(__name__)

# Seconds before handing a node that failed to take a staging buffer another
# one (a node too busy to answer within CONNECT_TIMEOUT, hundreds of writers
# starting at once: it reads their batches another way meanwhile).
NO_MAP_RETRY = 10.0
# Seconds a node whose insert listener could not be reached reads this
# writer's batches with gets before the writer tries to connect again.
NO_AM_RETRY = 30.0


class Sender:
    """Sends a writer's batches' descriptors, and their items where they go
    as active messages."""

    def __init__(self, client, connections: Connections, keys: KeyRange, local_map: bool,
                 am_min_item: int | None, runs: bool = True):
        """`local_map`: hand same-host nodes the staging buffers' memfds;
        `am_min_item`: the least item size sent as active messages to nodes
        that offer them (None: never); `runs`: several small items to a
        message where the node takes them (its `insert_run_bytes`)."""
        self._client = client
        self._connections = connections
        self._keys = keys
        self._runtime = client.runtime
        self.me = {"worker_address": self._runtime.address, "pid": os.getpid(),
                   "host_id": host_id()}
        self.local_map = local_map
        self._am_min_item = am_min_item
        self._runs = runs
        # Nodes that could not map our buffers: until when they read them otherwise.
        self._no_map: dict[int, float] = {}
        # Nodes whose insert listener could not be reached: until when they
        # read our batches with gets; and those already warned about.
        self._no_am: dict[int, float] = {}
        self._no_am_warned: set[int] = set()

    def send(self, node: dict, conn: rpc.RpcClient, batch: StagedBatch, timeout: float) -> None:
        """Send `batch`'s descriptor to `node` over `conn` (its items first,
        where they go as active messages); the node's reply comes later.
        Raises ConnectionFailed when the node cannot be reached."""
        ib = batch.spec.item_bytes
        staging = self._staging(node, batch.buffer)
        offsets = np.arange(batch.n, dtype=np.uint64) * np.uint64(ib)
        lengths = np.full(batch.n, ib, np.uint64)
        extra = {"staging": staging} if staging else {}
        if "epoch" in node:  # registered only if the node stays live meanwhile
            extra["epoch"] = node["epoch"]
        # Items as UCX active messages first, the descriptor naming
        # them second: a message the node never claims goes back to us.
        token = None if staging else self._send_messages(node, batch, offsets, lengths)
        if token is not None:
            extra["am_token"] = token
        conn.send(
            "insert",
            table=batch.table,
            slot_size=batch.spec.slot_size,
            item_bytes=ib,
            keys=batch.keys[: batch.n],
            priorities=batch.priorities[: batch.n],
            offsets=offsets,
            lengths=lengths,
            rkey=batch.buffer.rkey,
            base=batch.buffer.base,
            size=batch.buffer.size,
            timeout=float(timeout),
            node_id=node["node_id"],
            **batch.step_fields(),
            **self.me,
            **extra,
        )

    def _staging(self, node: dict, buf: StagingBuffer) -> bytes | None:
        """The ticket under which `node` holds `buf` mapped, handing it over
        first if need be; None when the node reads it otherwise (another
        host, mapping off or refused: it then uses process_vm_readv or UCX)."""
        node_id = node["node_id"]
        if (not self.local_map or buf.fd < 0 or not node.get("local_socket")
                or self._no_map.get(node_id, 0.0) > time.monotonic()
                or node.get("host_id") != self.me["host_id"]):
            return None
        key = (node_id, node["address"], buf.index)
        handed = self._connections.handed
        if handed.get(key) == buf.ticket:
            return buf.ticket
        try:
            send_staging(node["local_socket"], buf.fd, buf.size, buf.ticket,
                         self._client.token, node.get("pid", 0),
                         f"storage node {node['node_id']} ({node['name']})", CONNECT_TIMEOUT)
        except ConnectionFailed as exc:
            # Refused, or no answer within CONNECT_TIMEOUT (a node too busy to
            # accept, or stopped): it reads this writer's batches another way
            # for a while (a stopped one is then given up on as any hung
            # node is), and mapping is tried again after that.
            self._no_map[node_id] = time.monotonic() + NO_MAP_RETRY
            log.warning("writer %d: %s; that node reads this writer's batches another way "
                        "for %g s", self._keys.writer_id, exc, NO_MAP_RETRY)
            return None
        handed[key] = buf.ticket
        return buf.ticket

    def _send_messages(self, node: dict, batch: StagedBatch, offsets: np.ndarray,
                       lengths: np.ndarray) -> int | None:
        """Post the batch's items to `node` as UCX active messages (one native
        call) over a connection to its insert listener, and return the batch
        token its descriptor must name; None when the node reads our buffer
        itself (it has no insert listener, the items are smaller than
        DISTORE_AM_MIN_ITEM, it is on this host and reads us through shared
        memory, or its listener could not be reached lately). Raises
        ConnectionFailed when posting failed (the batch goes elsewhere)."""
        port = node.get("insert_port")
        if not port or self._am_min_item is None or batch.spec.item_bytes < self._am_min_item:
            return None
        if node.get("host_id") == self.me["host_id"] and self._runtime.shared_memory:
            return None  # the node reads this process's memory (cma)
        node_id = node["node_id"]
        if self._no_am.get(node_id, 0.0) > time.monotonic():
            return None
        name = f"storage node {node_id} ({node['name']})"
        host, _ = parse_address(node["address"])
        try:
            # As long as a node has to greet a new connection: a stopped
            # node is then routed around as any (connections.py).
            ep = self._runtime.listener_endpoint(host, port, name, CONNECT_TIMEOUT,
                                                 cap=node.get("am_cap"),
                                                 auth_id=AM_INSERT_AUTH_ID)
        except ConnectionFailed as exc:
            # A firewall that lets the node's RPC port through but not this
            # one, say: the node reads our batches with gets meanwhile.
            self._no_am[node_id] = time.monotonic() + NO_AM_RETRY
            first = node_id not in self._no_am_warned
            self._no_am_warned.add(node_id)
            log.log(logging.WARNING if first else logging.INFO,
                    "writer %d: %s; that node reads this writer's batches with one-sided gets "
                    "(slower over TCP) for %g s, then the writer tries again",
                    self._keys.writer_id, exc, NO_AM_RETRY)
            return None
        token = secrets.randbits(64) | 1
        try:
            run_bytes = node.get("insert_run_bytes", 0) if self._runs else 0
            _native.am_send(ep, batch.buffer.region, AM_INSERT_ID, token, offsets, lengths,
                            run_bytes)
        except UcxError as exc:
            self._runtime.drop_listener_endpoint(host, port)
            raise ConnectionFailed(f"{name}: sending an insert batch failed: {exc}") from exc
        return token
