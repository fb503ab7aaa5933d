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
    NodeGone,
)
from ..roles import write_ready
from ..transport.rpc import Peer
from . import checkpoint
from .admission import Admission
from .catalog import Catalog
from .checkpoint import KEY_BITS, IdState, Image
from .dispatch import Dispatcher
from .leases import Leases
from .membership import GONE, Membership
from .reclaim import Reclaim
from .restore import Restore
from .retirements import Retirements
from .room import Room
from .tables import Freed, Table
from .tiers import COLD, Demotions, Tiers, apply_moves

log = logging.getLogger(__name__)

# A key is writer_id << KEY_BITS | the writer's sequence number. A writer
# whose 2**24 keys are used takes another id (register_writer `previous`),
# so the 2**40 ids last centuries even at 26k registrations a second.
MAX_WRITERS = 1 << (64 - KEY_BITS)
# Rounds of drawing again the items of a sample that lie on unresponsive
# nodes; what is left after them is resampled by the learner.
ROUTE_AROUND_ROUNDS = 32


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
        self._stop = asyncio.Event()
        self._restoring: Restore | None = None  # nodes may re-send their items meanwhile
        self._refused_stores: set[str] = set()  # nodes of another store, refused (logged once)
        self._checkpointing: asyncio.Lock | None = None
        self.last_checkpoint: dict | None = None
        self.stats = metrics.ControlStats()  # read at scrape time (metrics.py)
        self.metrics_server: metrics.MetricsServer | None = None
        self.port = None
        self.dispatch = Dispatcher(self, self.catalog, self.reclaim)  # op -> its handler

    # -- lifecycle -------------------------------------------------------
    async def run(self, ready_file: str | None = None) -> int:
        """Serve until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if self.config.restore:
            self._restoring = Restore(self.config.checkpoint, self.config.restore_grace)
            self.tables.update(self._restoring.load(self.catalog.seeds, self.ids.next_node_id))
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
            if self._restoring is not None and self._restoring.absent is not None:
                nodes.update(self._restoring.absent)
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
        server = await self.dispatch.serve(self.config, self._on_close)
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
            for node in self.members.silent(now):
                self._node_unresponsive(node, now)
            for node in self.members.expired(now):
                self._node_died(node.node_id, f"no heartbeat for {now - node.last_seen:.1f} s, "
                                f"longer than the grace (control.unresponsive_grace = "
                                f"{self.members.grace:g} s)")
            if self._restoring is not None:
                self._restoring.report(self.tables, now)
                self._end_restore(now)
            self.reclaim.expire(now)

    def _end_restore(self, now: float) -> None:
        """End the restore once it is over (every node it waits for is done,
        or its grace has run out)."""
        if self._restoring is not None and self._restoring.over(now):
            self._restoring, restore = None, self._restoring
            restore.end(self.tables)

    def _on_close(self, peer: Peer) -> None:
        # The connection's leases are not released here: reads it posted may
        # still be in flight over UCX. They expire after lease_timeout.
        node_id = peer.state.get("node_id")
        if node_id is not None and self.members.is_alive(node_id):
            self._node_died(node_id, "its control connection closed")

    def _node_unresponsive(self, node, now: float) -> None:
        """A node missed its heartbeats: route around it (no inserts placed
        there, its items left out of sample replies) but keep its items for
        the grace; a heartbeat makes it live again (op_heartbeat)."""
        self.members.unresponsive(node, now)
        self.stats.membership["unresponsive"] += 1
        log.warning("node %d (%s) unresponsive: no heartbeat for %.1f s; clients route around "
                    "it, its items stay for %g s (control.unresponsive_grace)", node.node_id,
                    node.name, now - node.last_seen, self.members.grace)

    def _node_died(self, node_id: int, why: str, left: bool = False) -> int:
        """Take a node out of the store, however it went (silent past the
        grace, connection closed, or `left`: deregistered on shutdown): its
        items leave sampling at once (not counted as deletes), and a gone
        node's connection is closed. Returns how many items left."""
        node = self.members.nodes[node_id]
        node.state = GONE
        if self._restoring is not None:
            self._restoring.gone(node_id)  # housekeeping ends the restore if it was the last
        self.stats.membership["left" if left else "dropped"] += 1
        dropped = sum(t.drop_node(node_id) for t in self.tables.values())
        self.demotions.forget(node_id=node_id)
        if left:
            log.info("node %d (%s) left: %d items removed from sampling", node_id, node.name,
                     dropped)
        else:
            log.warning("node %d (%s) dropped: %s; %d items removed from sampling",
                        node_id, node.name, why, dropped)
            if node.peer is not None:
                node.peer.close()
        return dropped

    # -- requests --------------------------------------------------------
    async def handle(self, peer: Peer, op: str, f: dict):
        """Answer one request, as the server does (dispatch.py)."""
        return await self.dispatch.handle(peer, op, f)

    def op_register_node(self, peer: Peer, f: dict) -> dict:
        """A node joins, or re-joins after losing us with its former id.

        `restore` in the reply tells it whether to re-send the items it holds
        (this control plane is restoring) or to discard them (it starts
        afresh, or dropped the node and forgot them)."""
        fields = dict(f)
        wanted = fields.pop("node_id", None)
        store = fields.pop("store_id", None)
        if store is not None and store != self.ids.store_id and self._restoring is not None:
            why = (f"storage node {f['name']!r} holds items of store {store}, but this control "
                   f"plane restores store {self.ids.store_id} ({self.config.checkpoint}): "
                   "refused, its items kept. Restart the node's own control plane (its "
                   "--checkpoint), or restart the node empty to join this store")
            if why not in self._refused_stores:  # one line per node and store, not per retry
                self._refused_stores.add(why)
                log.error("%s", why)
            raise CheckpointError(why)
        node = self.members.register(peer, fields, wanted)
        self.stats.membership["rejoined" if wanted == node.node_id else "joined"] += 1
        if self._restoring is not None:
            # A node with a former id re-sends its items, then says so (items_resent).
            self._restoring.joined(node.node_id, node.name, resends=wanted is not None)
        return {"node_id": node.node_id, "heartbeat_interval": self.config.heartbeat_interval,
                "restore": self._restoring is not None, "store_id": self.ids.store_id,
                "items_resent": self._restoring is not None}

    def op_items_restored(self, peer: Peer, f: dict) -> dict:
        """Items a re-registered node still holds (sent only while restoring)."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id or not self.members.is_alive(node_id):
            raise InvalidRequest(
                f"items_restored for node {node_id} from a connection that is not it")
        if self._restoring is None:
            raise InvalidRequest("this control plane is not restoring; a node re-sends its items "
                                 "only when register_node's reply asks for them")
        table, freed, counts = self._restoring.items(self.tables, node_id, f)
        self.reclaim.free(f["table"], freed)
        if table is not None:
            self.admission.touch(table)
        return counts

    def op_items_resent(self, peer: Peer, f: dict) -> dict:
        """A re-joined node has re-sent every item it holds: the restore ends
        as soon as every node it waits for has."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(f"items_resent for node {node_id} from a connection that is "
                                 "not it")
        if self._restoring is not None:  # else it ended already (its grace ran out)
            self._restoring.sent(node_id)
            self._end_restore(time.monotonic())
        return {}

    async def op_checkpoint(self, peer: Peer, f: dict) -> dict:
        """Write a checkpoint now (`distore checkpoint`)."""
        return await self.checkpoint("on demand")

    def op_heartbeat(self, peer: Peer, f: dict) -> dict:
        """A node's heartbeat (on a connection of its own: storage/heartbeat.py);
        an unresponsive node that beats again is live again, with its items."""
        node = self.members.heartbeat(f["node_id"], f["used_bytes"])
        if node is not None:
            self.stats.membership["resumed"] += 1
            log.warning("node %d (%s) answers again after %.1f s unresponsive; it resumes with "
                        "its items", node.node_id, node.name, time.monotonic() - node.since)
        node = self.members.nodes.get(f["node_id"])
        return {"state": node.state if node is not None else GONE}

    def op_deregister_node(self, peer: Peer, f: dict) -> dict:
        """A node shutting down: drop its items from sampling now, not at its timeout."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(
                f"deregister_node for node {node_id} from a connection that is not it"
            )
        if self.members.is_alive(node_id):
            self._node_died(node_id, "it left", left=True)
        # Slots of this node that learners hold leases on: reads that may be in flight.
        leased = sum(int(np.count_nonzero((t.store.node == node_id) & (t.store.leases > 0)))
                     for t in self.tables.values())
        return {"leased": leased}

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

    def op_nodes(self, peer: Peer, f: dict) -> dict:
        """LIVE nodes: where writers place inserts and learners read from
        (unresponsive ones are routed around)."""
        return {"nodes": [n.describe() for n in self.members.live()]}

    def op_status(self, peer: Peer, f: dict) -> dict:
        restoring = None if self._restoring is None else self._restoring.until
        return {
            "nodes": [n.describe(with_keys=False) for n in self.members.nodes.values()],
            "tables": [t.info() for t in self.tables.values()],
            "leases": len(self.leases),
            "leases_refused": self.leases.refused,
            "incarnation": self.ids.incarnation,
            "checkpoint": self.last_checkpoint,
            "restoring_s": None if restoring is None else max(0.0, restoring - time.monotonic()),
        }

    async def op_items_added(self, peer: Peer, f: dict) -> dict:
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(f"items_added for node {node_id} from a connection that is not it")
        self.members.heard(node_id)
        self._check_placed(node_id, f)
        table = self.catalog.table(f["table"])
        n = len(f["keys"])
        if (f["priorities"] < 0).any():
            raise InvalidRequest("priorities must be >= 0")
        await self.admission.insert(table, n, f.get("timeout", 60.0))
        self._check_placed(node_id, f)
        if "used_bytes" in f:
            self.members.nodes[node_id].used_bytes = f["used_bytes"]
        keys, offsets = f["keys"], f["offsets"]
        gens, prios = f["generations"], f["priorities"]
        # A writer resends a batch whose node became unresponsive: if both
        # copies reach the table, the second is refused here (its slots are
        # freed by its node), so a key is never stored twice.
        twice = table.core.lookup(np.ascontiguousarray(keys, np.uint64)) >= 0
        if twice.any():
            log.info("table %r: %d keys of a batch from node %d are in the table already (a "
                     "batch resent after its node became unresponsive); not stored twice",
                     table.name, int(twice.sum()), node_id)
            new = ~twice
            keys, offsets, gens, prios = keys[new], offsets[new], gens[new], prios[new]
        freed = table.add(node_id, keys, offsets, gens, prios)
        retired = table.retired_leased
        # Items of this batch evicted at once are freed too: the node holds
        # a free until the registrations in flight when it came are committed.
        self.reclaim.free(table.name, freed)
        self.admission.touch(table)
        # Evicted items a learner sampled ahead: their nodes mark the slots
        # retired before the insert is acknowledged (control/retirements.py).
        await self.retirements.mark(table.name, retired)
        reply = {"evicted": int(len(freed.nodes) + len(retired))}
        if twice.any():
            reply["duplicate_offsets"] = f["offsets"][twice]
        return reply

    def _check_placed(self, node_id: int, f: dict) -> None:
        """Refuse an insert from a node that is not LIVE, or one placed there
        before it was last unresponsive (`epoch`: the writer resent it
        elsewhere). NodeGone is a ConnectionFailed: the writer resends."""
        node = self.members.nodes.get(node_id)
        if node is None or not node.live:
            state = "gone" if node is None else node.state
            raise NodeGone(f"storage node {node_id} is {state} (no heartbeat); its insert "
                           "was not registered and the writer resends the batch")
        if "epoch" in f and f["epoch"] != node.epoch:
            raise NodeGone(f"storage node {node_id} was unresponsive after this insert was "
                           "placed there (the writer may have resent it elsewhere); not "
                           "registered, the writer resends the batch")

    async def op_sample(self, peer: Peer, f: dict) -> dict:
        """Sample n items under a lease owned by this connection.

        With `batch` (n is several batches of that size, sampled ahead by a
        learner) the answer may hold fewer whole batches: as many as
        control.max_sample and the connection's lease limit allow, one for a
        table that has had items on a disk tier. `release` (lease ids of
        earlier batches) is handled first; ids of another connection's
        leases are refused and counted in the reply's `refused`, not failed:
        the sample itself is still answered."""
        refused = self.reclaim.release_owned(peer, f["release"]) if "release" in f else 0
        table = self.catalog.table(f["table"])
        n = f["n"]
        held, limit = self.leases.held(peer), self.config.max_leased_items
        batch = f.get("batch", n)
        if batch < n and n % batch == 0:
            # Sampled ahead (several batches asked at once): answer fewer
            # whole batches rather than refuse. Cold items must fit the
            # nodes' staging areas, sized for a learner holding three
            # batches, so one batch for a table that may hold cold items. A
            # table that never left DRAM samples ahead, disk tiers or not
            # (perf/tier_bandwidth.py --hot measures what that is worth).
            if table.may_hold_cold:
                n = batch
            fit = min(self.config.max_sample, limit - held) // batch * batch
            n = max(batch, min(n, fit))
        if n > self.config.max_sample:
            raise LimitExceeded(
                f"table {table.name!r}: a sample of {n} items is more than one request may ask "
                f"for (control.max_sample = {self.config.max_sample}); sample smaller "
                "batches, or raise --max-sample"
            )
        if held + n > limit:
            raise LimitExceeded(
                f"table {table.name!r}: this connection holds leases on {held} items and asks "
                f"for {n} more, over its limit (control.max_leased_items = {limit}). Release "
                "read batches (a learner releases each batch with its next request; close "
                "idle learners), or raise --max-leased-items"
            )
        await self.admission.sample(table, n, f.get("timeout", 0.0))
        if self.leases.held(peer) + n > limit:
            # Samples of one connection run concurrently (a learner keeps two
            # in flight for cold items): another may have been granted while
            # this one waited. Checked again with no await before the grant,
            # so pipelining can never take more than the limit.
            raise LimitExceeded(
                f"table {table.name!r}: this connection holds leases on "
                f"{self.leases.held(peer)} items and asks for {n} more, over its limit "
                f"(control.max_leased_items = {limit}). Keep fewer samples in flight, "
                "release read batches, or raise --max-leased-items"
            )
        t0 = time.perf_counter()  # metrics: the decision, without the wait
        size = table.size  # the size the probabilities refer to
        min_probability = table.min_probability  # ... and the smallest of them (weights)
        recs, probs, freed = table.sample(n)
        away = self.members.away()
        # Not for tables with max_times_sampled: a draw is a use there, and
        # drawing again would use up items nobody receives.
        if away and not table.max_times_sampled:
            recs, probs, freed = self._route_around(table, recs, probs, freed, away)
        self.reclaim.free(table.name, freed)
        self.admission.touch(table)
        lease = self.leases.grant(table.name, recs, peer)
        items = table.locations(recs)  # protocol.ITEM_LOCATION records
        table.stats.decision.observe(time.perf_counter() - t0)
        staged = int(np.count_nonzero(items["offset"] >= COLD))
        if staged:
            items = await self._stage_cold(table, recs, items, lease)
        return {
            "lease": lease,
            "refused": refused,
            "table_size": size,
            "items": items,
            "probabilities": probs,
            "min_probability": min_probability,
            "staged": staged,  # cold items read from disk for it (learners ask further ahead)
        }

    def _route_around(self, table: Table, recs, probs, freed: Freed, away: list[int]):
        """Draw again the items of a sample that lie on unresponsive nodes (as
        a learner resamples items it cannot read), a few rounds at most:
        their reads would wait for a node that does not answer."""
        nodes = np.asarray(away, np.uint32)
        for _ in range(ROUTE_AROUND_ROUNDS):
            bad = np.flatnonzero(np.isin(table.store.node[recs], nodes))
            if len(bad) == 0:
                break
            freed = freed + table.unlease(recs[bad])
            again, p, more = table.sample(len(bad))
            recs[bad], probs[bad] = again, p
            freed = freed + more
        return recs, probs, freed

    async def _stage_cold(self, table: Table, recs, items, lid: int):
        """Locations of a sample whose cold items their nodes staged
        (control/tiers.py); on failure the sample's lease is released."""
        lease = self.leases.get(lid)
        try:
            items = await self.tiers.stage(table, recs, items, lease)
        except BaseException:
            if self.leases.get(lid) is not None:
                self.reclaim.release(self.leases.take([lid], lease.owner)[0])
            else:
                self.tiers.unstage(lease.staged)
            raise
        if self.leases.get(lid) is None:  # expired while the nodes read
            self.tiers.unstage(lease.staged)
        return items

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
