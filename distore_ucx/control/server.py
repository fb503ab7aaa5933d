"""The control plane process: `distore control --port P`.

Holds tables, leases and node membership; answers writers, learners and
storage nodes on the control channel. It never touches payload bytes. All
state lives in one asyncio thread, so handlers need no locks.

`ControlPlane` builds the pieces (one module of this package per concept,
see __init__.py) and runs the process: start and stop, housekeeping a few
times a second, checkpoints, and the plane-wide requests (`status`,
`checkpoint`); dispatch.py routes every other request to its module.
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
from ..config import ControlConfig, uvloop_enabled
from ..errors import CheckpointError
from ..roles import write_ready
from ..transport import event_loop
from ..transport.rpc import Peer
from . import checkpoint
from .admission import Admission
from .arenas import Arenas
from .catalog import Catalog
from .checkpoint import IdState, Image
from .dispatch import ControlDispatcher
from .inserts import Inserts
from .leases import Leases
from .membership import Membership
from .nodes import Nodes
from .reclaim import Reclaim
from .restore import Restoring
from .retirements import Retirements
from .room import Room
from .sampling import Sampling
from .tables import Table
from .tiers import Demotions, Tiers
from .writers import Writers

log = logging.getLogger(__name__)


class ControlPlane:
    """Tables, leases and membership, served over the control channel."""

    def __init__(self, config: ControlConfig):
        self.config = config
        # New and restored tables' sampler seeds (None: random).
        seeds = itertools.count(config.seed) if config.seed is not None else None
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
        self.stats = metrics.ControlStats()  # read at scrape time (metrics/families.py)
        self.catalog = Catalog(self.members, self.admission, seeds)
        self.tables: dict[str, Table] = self.catalog.tables
        # Slots freed on their nodes; leases released or expired.
        self.reclaim = Reclaim(self.tables, self.leases, self.members, self.tiers,
                               self.admission)
        # A restore from the checkpoint in progress (nodes re-send their items).
        self.restoring = Restoring(self.tables, self.members, self.reclaim, self.admission)
        self.nodes = Nodes(config, self.ids, self.members, self.tables, self.demotions,
                           self.restoring, self.stats,
                           self.catalog.refit)  # joining, heartbeats, leaving
        self.sampling = Sampling(config, self.catalog, self.leases, self.members, self.tiers,
                                 self.admission, self.reclaim)
        self.inserts = Inserts(self.catalog, self.members, self.admission, self.retirements,
                               self.reclaim)
        # Nodes' requests about their slots: eviction, demotion, staging.
        self.arenas = Arenas(self.catalog, self.members, self.tiers, self.demotions, self.room,
                             self.retirements, self.admission)
        # Operation -> the handler that serves it.
        self.dispatch = ControlDispatcher(self, self.catalog, self.sampling, self.inserts,
                                          self.reclaim, self.nodes, self.arenas,
                                          self.restoring, Writers(config, self.ids))
        self._stop = asyncio.Event()
        self._checkpointing: asyncio.Lock | None = None
        self.last_checkpoint: dict | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        self.port = None

    async def handle(self, peer: Peer, op: str, f: dict):
        """Answer one request, as the server does (dispatch.py)."""
        return await self.dispatch.handle(peer, op, f)

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
        try:
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
        finally:  # also on an error: the metrics server and its registry are ours to close
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
        log.info("control plane listening on %s:%d (event loop %s)", self.config.host, self.port,
                 event_loop.loop_name(loop))
        self.metrics_server = metrics.serve_process(
            self.config.metrics_port, self.config.metrics_host, loop, self,
            lambda plane: metrics.control_snapshot(
                plane, restoring=plane.restoring.current is not None),
            metrics.control_families, "control plane", self.config.metrics_optional)
        return server

    async def _housekeeping(self) -> None:
        """Mark silent nodes unresponsive, drop those silent past the grace,
        end a restore that is over, and expire leases, a few times a second."""
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

    # -- plane-wide requests ---------------------------------------------
    async def op_checkpoint(self, peer: Peer, f: dict) -> dict:
        """Write a checkpoint now (`distore checkpoint`)."""
        return await self.checkpoint("on demand")

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
            **({"warnings": warned} if (warned := self.catalog.warnings()) else {}),
        }


def main(config: ControlConfig, ready_file: str | None = None) -> int:
    """Run the control plane in this process until stopped."""
    return event_loop.run(ControlPlane(config).run(ready_file), uvloop_enabled())
