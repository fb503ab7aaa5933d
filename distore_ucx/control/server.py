"""The control plane process: `distore control --port P`.

Holds tables, leases and node membership; answers writers, learners and
storage nodes on the control channel. It never touches payload bytes. All
state lives in one asyncio thread, so handlers need no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time

import numpy as np

from .. import metrics
from ..config import ControlConfig
from ..errors import (
    CheckpointError,
    ConfigError,
    InvalidRequest,
    LimitExceeded,
)
from ..roles import write_ready
from ..transport.rpc import Peer
from . import checkpoint
from .admission import Admission
from .catalog import Catalog
from .checkpoint import KEY_BITS, IdState, Image
from .dispatch import Dispatcher
from .inserts import Inserts
from .leases import Leases
from .membership import Membership
from .nodes import Nodes
from .reclaim import Reclaim
from .restore import Restore, Restoring
from .retirements import Retirements
from .room import Room
from .sampling import Sampling
from .tables import Table
from .tiers import Demotions, Tiers, apply_moves

log = logging.getLogger(__name__)

# A key is writer_id << KEY_BITS | the writer's sequence number. A writer
# whose 2**24 keys are used takes another id (register_writer `previous`),
# so the 2**40 ids last centuries even at 26k registrations a second.
MAX_WRITERS = 1 << (64 - KEY_BITS)


class ControlPlane:
    """Tables, leases and membership, served over the control channel."""

    def __init__(self, config: ControlConfig):
        self.config = config
        # Writer, node and lease ids never repeat across restarts (keys are
        # built from writer ids); with a checkpoint file they are persisted.
        self.ids = IdState(config.checkpoint + ".ids" if config.checkpoint else None)
        self.members = Membership(config.heartbeat_timeout, self.ids, config.unresponsive_grace)
        # Lease ids are unguessable and owned by the connection that took
        # them (control/leases.py); a new run draws a new id key.
        self.leases = Leases(config.lease_timeout)
        self.tiers = Tiers(self.members)  # nodes' disk tiers: demotion, staging
        self.demotions = Demotions()  # full nodes' demotion candidates, one scan for many
        self.retirements = Retirements(self.members)  # evicted leased slots being marked
        self.room = Room(np.random.default_rng(config.seed))  # full arenas: what to evict
        self.admission = Admission()  # calls a rate limiter holds (control/admission.py)
        # New and restored tables' sampler seeds (None: random).
        seeds = itertools.count(config.seed) if config.seed is not None else None
        self.catalog = Catalog(self.members, self.admission, seeds)
        self.tables: dict[str, Table] = self.catalog.tables
        # Slots freed on their nodes; leases released or expired.
        self.reclaim = Reclaim(self.tables, self.leases, self.members, self.tiers,
                               self.admission)
        self.stats = metrics.ControlStats()  # read at scrape time (metrics.py)
        # A restore from the checkpoint in progress (nodes re-send their items).
        self.restoring = Restoring(self.tables, self.members, self.reclaim, self.admission)
        self.nodes = Nodes(config, self.ids, self.members, self.tables, self.demotions,
                           self.restoring, self.stats)  # joining, heartbeats, leaving
        self._stop = asyncio.Event()
        self._checkpointing: asyncio.Lock | None = None
        self.last_checkpoint: dict | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        self.port = None
        self.sampling = Sampling(config, self.catalog, self.leases, self.members, self.tiers,
                                 self.admission, self.reclaim)
        self.inserts = Inserts(self.catalog, self.members, self.admission, self.retirements,
                               self.reclaim)
        self.dispatch = Dispatcher(self, self.catalog, self.reclaim, self.sampling,
                                   self.inserts, self.nodes, self.restoring)  # op -> its handler

    @property
    def _restoring(self) -> Restore | None:
        """The restore in progress (metrics.control_snapshot reads it)."""
        return self.restoring.current

    # -- lifecycle -------------------------------------------------------
    async def run(self, ready_file: str | None = None) -> int:
        """Serve until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if self.config.restore:
            self.restoring.begin(self.config.checkpoint, self.config.restore_grace,
                                 self.catalog.seeds, self.ids.next_node_id)
        server = await self.start()
        self._create_configured_tables()
        if ready_file:
            write_ready(ready_file, {"address": f"{self.config.host}:{self.port}",
                                     "pid": os.getpid(),
                                     "metrics_port": self.metrics_server.port
                                     if self.metrics_server else None})
        await self._stop.wait()
        code = 0
        if self.config.checkpoint:
            try:
                await self.checkpoint("shutdown")
            except CheckpointError as exc:
                log.error("%s", exc)
                code = 1
        server.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("control plane stopped")
        return code

    # -- checkpoints -----------------------------------------------------
    async def checkpoint(self, why: str) -> dict:
        """Write a checkpoint now; returns where, how many items and how long.

        The snapshot is taken on the event loop (copies of the columns); the
        file is written on a worker thread, so requests go on meanwhile.
        """
        path = self.config.checkpoint
        if not path:
            raise CheckpointError(
                "this control plane has no checkpoint file: start it with --checkpoint PATH "
                "(and --checkpoint-interval SECONDS for periodic ones)"
            )
        if self._checkpointing is None:
            self._checkpointing = asyncio.Lock()
        async with self._checkpointing:
            t0 = time.monotonic()
            # The nodes a restore from it waits for: members, and those a
            # restore in progress still waits for (they may hold its items).
            nodes = {n.node_id: n.name for n in self.members.nodes.values() if n.alive}
            restore = self.restoring.current
            if restore is not None and restore.absent is not None:
                nodes.update(restore.absent)
            image = Image([t.image() for t in self.tables.values()],
                          incarnation=self.ids.incarnation, store_id=self.ids.store_id,
                          nodes=nodes, next_node_id=self.ids.next_node_id)
            snapshot = time.monotonic() - t0
            try:
                nbytes = await asyncio.to_thread(checkpoint.write, path, image)
            except Exception:
                self.stats.checkpoint_failures += 1
                raise
            took = time.monotonic() - t0
        self.stats.checkpoints += 1
        self.last_checkpoint = {
            "path": os.path.abspath(path), "tables": len(image.tables), "items": image.items,
            "bytes": nbytes, "seconds": took, "snapshot_seconds": snapshot,
            "created": image.created, "why": why,
        }
        log.info("checkpoint (%s): %d items of %d tables to %s, %d bytes in %.3f s "
                 "(%.3f s snapshot)", why, image.items, len(image.tables), path, nbytes, took,
                 snapshot)
        return self.last_checkpoint

    async def _checkpoints(self) -> None:
        """A checkpoint every `checkpoint_interval` seconds."""
        while True:
            await asyncio.sleep(self.config.checkpoint_interval)
            try:
                await self.checkpoint("periodic")
            except CheckpointError as exc:
                log.error("%s", exc)

    def _create_configured_tables(self) -> None:
        """Create the tables named in the configuration ([[tables]] in distore.toml)."""
        for definition in self.config.tables:
            self.catalog.create(definition)

    async def start(self):
        """Start serving and the housekeeping task; returns the server."""
        server = await self.dispatch.serve(self.config, self.nodes.on_close)
        self.port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._housekeeping())]
        if self.config.checkpoint and self.config.checkpoint_interval > 0:
            self._tasks.append(loop.create_task(self._checkpoints()))
        log.info("control plane listening on %s:%d", self.config.host, self.port)
        self.metrics_server = metrics.serve_process(
            self.config.metrics_port, self.config.metrics_host, loop, self,
            metrics.control_snapshot,
            metrics.control_families, "control plane", self.config.metrics_optional)
        return server

    async def _housekeeping(self) -> None:
        """Mark silent nodes unresponsive, drop those silent past the grace,
        and expire leases, a few times a second."""
        period = min(self.config.heartbeat_interval, self.config.heartbeat_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            stalled, last = now - last - period, now
            if stalled > period:
                # This loop did not run (a busy host, a long operation, a pause):
                # heartbeats sent meanwhile are still unread in the sockets.
                self.members.credit(stalled)
                (log.warning if stalled > self.config.heartbeat_timeout / 2 else log.info)(
                    "the control plane's event loop stalled for %.2f s; that time is not "
                    "counted against the nodes' heartbeats (a busy host, or a long "
                    "operation such as a checkpoint of a large table)", stalled)
            self.nodes.check(now)
            self.restoring.tick(now)
            self.reclaim.expire(now)

    # -- requests --------------------------------------------------------
    async def handle(self, peer: Peer, op: str, f: dict):
        """Answer one request, as the server does (dispatch.py)."""
        return await self.dispatch.handle(peer, op, f)

    async def op_checkpoint(self, peer: Peer, f: dict) -> dict:
        """Write a checkpoint now (`distore checkpoint`)."""
        return await self.checkpoint("on demand")

    def op_register_writer(self, peer: Peer, f: dict) -> dict:
        """A writer id never handed out before; at most control.max_writer_ids
        writers per connection. Ids are not reused (keys `writer_id << 24 |
        seq` of a closed writer may still be in tables, in nodes' slots and in
        checkpoints) but cannot run out: there are 2**40, and a writer whose
        2**24 keys are used asks for the next with `previous`, which this
        connection's count does not see again."""
        limit = self.config.max_writer_ids
        mine = peer.state.setdefault("writer_ids", set()) if peer is not None else set()
        previous = f.get("previous")
        if previous not in mine:  # a new writer (or one whose connection was made again)
            previous = None
        if previous is None and len(mine) >= limit:
            raise LimitExceeded(
                f"this connection registered {len(mine)} writers, the most one connection may "
                f"(control.max_writer_ids = {limit}): reuse a writer instead of making one per "
                "batch, connect again (ds.connect) for more, or raise --max-writer-ids"
            )
        wid = self.ids.writer_id()
        if wid >= MAX_WRITERS:  # 2**40 ids: not in this universe's lifetime
            raise ConfigError(f"this control plane handed out all {MAX_WRITERS} writer ids; "
                              "start a new store (a new --checkpoint path)")
        mine.discard(previous)
        mine.add(wid)
        return {"writer_id": wid, "key_bits": KEY_BITS}

    def op_status(self, peer: Peer, f: dict) -> dict:
        """The whole store's state, for `distore status`."""
        restore = self.restoring.current
        restoring = None if restore is None else restore.until
        return {
            "nodes": [n.describe(with_keys=False) for n in self.members.nodes.values()],
            "tables": [t.info() for t in self.tables.values()],
            "leases": len(self.leases),
            "leases_refused": self.leases.refused,
            "incarnation": self.ids.incarnation,
            "checkpoint": self.last_checkpoint,
            "restoring_s": None if restoring is None else max(0.0, restoring - time.monotonic()),
        }

    # -- the disk tier (control/tiers.py) ----------------------------------
    def _node_of(self, peer: Peer, f: dict, op: str) -> int:
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id or not self.members.is_alive(node_id):
            raise InvalidRequest(f"{op} for node {node_id} from a connection that is not it")
        return node_id

    def op_demote(self, peer: Peer, f: dict) -> dict:
        """A node whose arena is full: which of its items of a table to move to disk."""
        node_id = self._node_of(peer, f, "demote")
        keys, offsets, gens = self.demotions.pick(self.catalog.table(f["table"]), node_id, f["n"])
        return {"keys": keys, "offsets": offsets, "generations": gens}

    def op_items_moved(self, peer: Peer, f: dict) -> dict:
        """A node copied items to another tier: move the records still there."""
        node_id = self._node_of(peer, f, "items_moved")
        taken = apply_moves(self.catalog.table(f["table"]), node_id, f["keys"], f["offsets"],
                            f["generations"], f["new_offsets"], f["new_generations"])
        return {"taken": taken.astype(np.uint8)}

    def op_staged(self, peer: Peer, f: dict) -> None:
        """A node staged (or could not stage) a sample's cold items."""
        self.tiers.staged(self._node_of(peer, f, "staged"), f)

    def op_evict(self, peer: Peer, f: dict) -> dict:
        """A node whose arena has no room for an insert into a table: evict
        up to n of that table's items stored there, by its remover
        (control/room.py); the node frees the slots it is told."""
        node_id = self._node_of(peer, f, "evict")
        table = self.catalog.table(f["table"])
        recs = self.room.pick(table, node_id, f["n"])
        freed = table.evict(recs)  # unleased: every slot is freed
        if len(recs):
            self.admission.touch(table)
            log.debug("table %r: %d items evicted to make room on node %d", table.name,
                      len(recs), node_id)
        s = table.store
        leased = int(np.count_nonzero((s.node == node_id) & (s.leases > 0)))
        return {"offsets": freed.offsets, "leased": leased}

    def op_retired(self, peer: Peer, f: dict) -> None:
        """A node marked the slots of a `retire` push."""
        self.retirements.retired(self._node_of(peer, f, "retired"), f["request"])



def main(config: ControlConfig, ready_file: str | None = None) -> int:
    """Run the control plane in this process until stopped."""
    return asyncio.run(ControlPlane(config).run(ready_file))
