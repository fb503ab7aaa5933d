"""The storage node process: `distore node --control HOST:PORT --arena 4GiB`.

Owns one arena registered with UCX for remote READ. Writers send insert
descriptors over the control channel; the node pulls each batch one-sided
from the writer's staging buffer straight into slots, or receives it as UCX
active messages into them (storage/pulls.py, storage/puller.py: on a pull
thread, off the event loop), reports them to the control plane in one
message per batch and acknowledges the writer only once the control plane
has them (an acknowledged insert is sampleable). A batch that cannot be
read or registered frees its slots before the error reply.
Learners read slots one-sided; the node does nothing for a read, except over
TCP where UCX emulates RMA and the worker's event-driven progress thread
answers. The control plane tells the node which slots to free.

Losing the control plane does not end a node: it keeps its arena and
serves reads, holds inserts, and tries to re-join for `reconnect_timeout`
seconds. A control plane restored from a checkpoint asks it to re-send the
items it holds; one that starts afresh (or had dropped the node) asks it
to discard them. Only when no control plane comes back does it exit (3).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import metrics, protocol
from .._native_loader import _native
from ..config import NodeConfig, read_token, rendezvous_config, ucx_tls
from ..errors import (
    AuthenticationFailed,
    CheckpointError,
    ConnectionFailed,
    InvalidRequest,
    SpecMismatch,
    StagingFull,
    StorageFull,
    Timeout,
)
from ..progress import Progress
from ..roles import write_ready
from ..slot_format import COLD, is_cold, stride_of
from ..spec import SLOT_HEADER
from ..transport import UcxRuntime
from ..transport.local_map import LocalMapServer
from ..transport.rpc import AsyncClient, parse_address, serve
from ..transport.runtime import host_id
from .arena import Arena, granted_page_kind, page_advice, page_size_label
from .guard import guard_remote_access, watch_guard
from .heartbeat import Heartbeat
from .held_frees import HeldFrees
from .puller import Puller
from .slots import ALLOCATED
from .tier import DiskTier, StagingArea, bounce_reads

log = logging.getLogger(__name__)

RESEND_BATCH = 1 << 16  # items per items_restored message after a re-join
WRITER_CHECK = 0.05  # s between checks that a writer whose batch is pulled is still there
DEMOTE_BATCH = 64  # items demoted at least at once when the arena is full
STAGE_WAIT = 5.0  # s a sample's cold items may wait for room in the staging area
# s without an event-loop tick after which the heartbeat thread stops beating
LOOP_WEDGED = 10.0


def route_address(control_host: str) -> str:
    """The local address that routes to the control plane (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((control_host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class StorageNode:
    """One storage node: arena, insert server, control-plane session."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.name = config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.node_id: int | None = None
        self.store_id: str | None = None  # the store this node's items belong to
        self.runtime: UcxRuntime | None = None
        self.arena: Arena | None = None
        self.control: AsyncClient | None = None
        self.local_map: LocalMapServer | None = None  # same-host learners map the arena
        self.tier: DiskTier | None = None  # the disk tier (--disk), storage/tier.py
        self.staging: StagingArea | None = None  # where sampled cold items are read to
        self.puller: Puller | None = None  # reads writers' batches (storage/puller.py)
        self._disk_thread: ThreadPoolExecutor | None = None  # disk batches, made on first use
        self._slot_sizes: dict[str, int] = {}  # table -> slot size, as inserts said
        self.inserted = 0
        self.stats = metrics.NodeStats()  # read at scrape time (metrics.py)
        self._stop = asyncio.Event()
        self._now = asyncio.Event()  # a second SIGTERM: skip the drain
        self._leaving = False
        # Registrations in flight, and frees from the control plane held
        # until those in flight when they came are done (_on_push).
        self._frees = HeldFrees(self._apply_free)
        self._joined = asyncio.Event()  # registered with a live control plane
        self._staged = asyncio.Event()  # set when staged extents come back
        self._demoting = asyncio.Lock()  # one demotion at a time
        self._token: bytes | None = None
        self._where: tuple[str, int] = ("", 0)  # host, port writers reach us at
        self._interval = 0.5  # heartbeat interval the control plane asked for
        self._loop_seen = time.monotonic()  # the event loop's last tick (heartbeat thread reads)
        self._loop_wedged = False

    async def run(self, ready_file: str | None = None) -> int:
        """Serve until SIGTERM/SIGINT, or until no control plane can be re-joined
        (exit code 3); returns the exit code."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        control_host, _ = parse_address(cfg.control)
        host = cfg.host or route_address(control_host)
        guarded = guard_remote_access()  # before the worker exists
        # Start-up steps: a bar when run on a terminal, log lines otherwise.
        steps = Progress(f"node {self.name} starting", total=3, unit="steps", logger=log,
                         every=0)
        with UcxRuntime(config={**rendezvous_config(), **guarded}, env_tls=ucx_tls()) as runtime:
            self.runtime = runtime
            steps.write(f"mapping and registering a {cfg.arena_bytes / 2**30:.1f} GiB arena")
            self.arena = Arena(runtime, cfg.arena_bytes, cfg.hugepages, self.name,
                               write_protect=cfg.write_protect, reserve=cfg.staging_bytes)
            self.puller = Puller(runtime, self.name)
            if cfg.disk:
                self.tier = DiskTier(cfg.disk, cfg.disk_bytes, self.name, self.arena.arena_id)
                self.staging = StagingArea(cfg.staging_bytes)
                # Straight into the staging area only on reserved hugepages:
                # into shared-memory transparent hugepages the disk read
                # slower than through the hugepage buffers (docs/performance.md,
                # perf/tier_bandwidth.py).
                self.tier.bounce = self.tier.direct and bounce_reads(
                    self.arena.page_kind == "hugetlb")
                log.info("node %s: disk tier %s, %d bytes%s; %d arena bytes for staging cold "
                         "items%s", self.name, cfg.disk, self.tier.size,
                         "" if self.tier.direct else " (no O_DIRECT there)",
                         self.staging.size, f", read through hugepage buffers (arena pages: "
                         f"{self.arena.page_kind})" if self.tier.bounce else "")
            _native.allow_remote_reads(self.arena.base, self.arena.size)
            guard_watch = loop.create_task(watch_guard(self.name))
            self.puller.start_am_inbox()
            steps.update(1, note="arena mapped")
            self._token = read_token(cfg.token_file)
            self._start_local_map()
            server = await serve(host, cfg.port, self._handle, token=self._token,
                                 role="storage node")
            port = server.sockets[0].getsockname()[1]
            self._where = (host, port)
            steps.update(1, note=f"listening on {host}:{port}")
            metrics_server = metrics.serve_process(
                cfg.metrics_port, cfg.metrics_host, loop, self, metrics.node_snapshot,
                metrics.node_families, f"storage node {self.name}", cfg.metrics_optional)
            beat = None
            try:
                if not await self._first_join():
                    return 0 if self._stop.is_set() else 3
                beat = Heartbeat(cfg.control, self._token, lambda: self._interval,
                                 self._beat, f"node {self.name}").start()
                steps.update(1, note=f"joined as node {self.node_id}")
                steps.close()
                log.info(
                    "node %s (id %d) serving %d-byte arena on %s pages at %s:%d over UCX %s; "
                    "same-host learners %s",
                    self.name, self.node_id, self.arena.size,
                    page_size_label(self.arena.page_kind), host, port, runtime.transports,
                    "map it read-only" if self.local_map else "read it over UCX",
                )
                advice = page_advice(self.arena.page_kind)
                if advice:
                    log.info("node %s: %s", self.name, advice)
                if ready_file:
                    write_ready(ready_file, {"node_id": self.node_id,
                                              "address": f"{host}:{port}",
                                              "metrics_port": metrics_server and
                                              metrics_server.port})
                code = await self._serve()
            finally:
                # Closed in reverse order of creation, all before the runtime.
                self._leaving = True  # inserts still in flight fail as "shutting down"
                guard_watch.cancel()
                if beat is not None:
                    beat.close()
                server.close()
                if metrics_server is not None:
                    metrics_server.close()
                if self.local_map is not None:
                    self.local_map.close()
                if self.control is not None:
                    await self.control.close()
                if self.tier is not None:
                    if self._disk_thread is not None:
                        self._disk_thread.shutdown(wait=True)
                    self.tier.close()
                await self.puller.close()  # its threads read through the runtime
                del self.arena  # unmap before the runtime closes
                self.arena = None
        log.info("node %s stopped", self.name)
        return code

    async def _serve(self) -> int:
        """Heartbeat the control plane until told to stop; re-join it whenever
        it is lost. Returns the exit code."""
        while True:
            beat = asyncio.create_task(self._reader_ticks(self._interval))
            lost = asyncio.create_task(self.control.closed.wait())
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
            for t in (beat, lost, stop):
                t.cancel()
            if self._stop.is_set():
                if not self.control.closed.is_set():
                    await self._leave()
                return 0
            self._joined.clear()
            held = sum(len(t.live()[0]) for t in self.arena.tables().values())
            log.warning("lost the control plane at %s; node %s keeps its %d items, holds "
                        "inserts and tries to re-join for %g s", self.config.control, self.name,
                        held, self.config.reconnect_timeout)
            if not await self._rejoin():
                if self._stop.is_set():
                    return 0
                log.error("no control plane at %s within %g s; node %s exits",
                          self.config.control, self.config.reconnect_timeout, self.name)
                return 3

    async def _first_join(self) -> bool:
        """Join at start; a control plane not up yet (started after its nodes,
        or restarting) is waited for as after losing it, for
        `reconnect_timeout` s. False: none came, or we were stopped."""
        try:
            await self._join()
            return True
        except AuthenticationFailed:
            raise  # a control plane answered and refused us: waiting will not help
        except (ConnectionFailed, Timeout) as exc:
            log.warning("no control plane at %s yet (%s); node %s tries to join for %g s "
                        "(--reconnect-timeout)", self.config.control, exc, self.name,
                        self.config.reconnect_timeout)
        if await self._rejoin():
            return True
        if not self._stop.is_set():
            log.error("no control plane at %s within %g s; node %s exits",
                      self.config.control, self.config.reconnect_timeout, self.name)
        return False

    async def _rejoin(self) -> bool:
        """Try to re-join until `reconnect_timeout` passes or we are stopped."""
        deadline = time.monotonic() + self.config.reconnect_timeout
        delay, last_error = 0.05, ""
        while not self._stop.is_set():
            old = self.control
            try:
                await self._join()
                if old is not None:  # None: joining for the first time
                    await old.close()
                return True
            except Exception as exc:  # whatever went wrong, try again until the deadline
                if str(exc) != last_error:
                    log.info("re-joining the control plane: %s", exc,
                             exc_info=not isinstance(exc, (ConnectionFailed, Timeout,
                                                           CheckpointError)))
                    last_error = str(exc)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._stop.wait(), min(delay, left))
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 1.0)
        return False

    async def _join(self) -> None:
        """Connect and register (with our former id after a loss); then re-send
        or discard the items we hold, as the control plane asks."""
        cfg = self.config
        control = await AsyncClient.connect(
            cfg.control, "control plane", on_push=self._on_push, token=self._token
        )
        try:
            former = self.node_id
            host, port = self._where
            reply = await control.call(
                "register_node",
                name=self.name,
                host=host,
                port=port,
                worker_address=self.runtime.address,
                rkey=self.arena.region.pack_rkey(),
                arena_base=self.arena.base,
                arena_size=self.arena.size,
                pid=os.getpid(),
                host_id=host_id(),
                arena_id=self.arena.arena_id,
                page_kind=granted_page_kind(self.arena.page_kind),
                **({"local_socket": self.local_map.name} if self.local_map else {}),
                **({"node_id": former} if former is not None else {}),
                **({"store_id": self.store_id} if former is not None and self.store_id
                   else {}),
                **({"disk_size": self.tier.size} if self.tier is not None else {}),
                **({"insert_address": bytes(self.runtime.reader_worker.address)}
                   if self.puller.am_inbox is not None else {}),
            )
            self.node_id = reply["node_id"]
            self.store_id = reply.get("store_id")
            self._interval = reply["heartbeat_interval"]
            self.control = control
            if former is not None:
                if reply.get("restore"):
                    await self._resend_items()
                    if reply.get("items_resent"):  # lets the restore end without its grace
                        await control.call("items_resent", node_id=self.node_id)
                else:
                    self._discard_items()
                log.info("node %s re-joined the control plane as node %d", self.name,
                         self.node_id)
        except BaseException:
            await control.close()
            raise
        self._joined.set()

    def _held_items(self) -> dict:
        """LIVE items by table, both tiers: (keys, offsets, generations,
        priorities, slot size); disk items have COLD offsets."""
        held = {t: (*slots.live(), slots.slot_size) for t, slots in self.arena.tables().items()}
        if self.tier is not None:
            for table in self.tier.tables():
                cold = self.tier.live(table)
                if table in held:
                    hot = held[table]
                    held[table] = (*(np.concatenate([a, b]) for a, b in zip(hot[:4], cold)),
                                   hot[4])
                elif len(cold[0]):
                    # the arena has no slots of it: its slot size is the spec's
                    held[table] = (*cold, self._slot_sizes.get(table, 0))
        return held

    def _free(self, table: str, offsets, live_only: bool = False) -> None:
        """Free slots of either tier (COLD offsets are disk slots)."""
        offsets = np.asarray(offsets, np.uint64)
        cold = is_cold(offsets)
        if cold.any() and self.tier is not None:
            self.tier.free(table, offsets[cold], live_only)
            offsets = offsets[~cold]
        self.arena.free(table, offsets, live_only)

    def _start_local_map(self) -> None:
        """Offer the sealed arena to same-host learners (a Unix socket, after
        the store's HMAC handshake); say why not when it cannot be offered."""
        if self.arena.share_fd < 0:
            why = ("--no-write-protect leaves the arena unsealed" if not
                   self.config.write_protect else "this kernel cannot seal it (Linux >= 5.1 "
                   "has F_SEAL_FUTURE_WRITE)")
            log.info("node %s: same-host learners read over UCX: %s", self.name, why)
            return
        try:
            self.local_map = LocalMapServer(
                self.arena.share_fd, self.arena.size, self.arena.arena_id,
                self.arena.page_kind, self._token, self.name,
                high_water=lambda: self.arena.high_water if self.arena else 0,
                on_staging=self.puller.sources().offer).start()
        except OSError as exc:
            log.warning("node %s: cannot offer its arena to same-host learners (%s); they "
                        "read over UCX", self.name, exc)
            self.local_map = None

    async def _resend_items(self) -> None:
        """Send the restoring control plane every item we hold, in bounded batches."""
        for table, (keys, offsets, gens, prios, slot_size) in self._held_items().items():
            totals = {"restored": 0, "adopted": 0, "discarded": 0}
            progress = Progress(f"re-sending table {table!r}", total=len(keys), unit="items",
                                logger=log, every=5.0)
            for i in range(0, len(keys), RESEND_BATCH):
                part = slice(i, i + RESEND_BATCH)
                reply = await self.control.call(
                    "items_restored", reply_timeout=60.0, node_id=self.node_id, table=table,
                    slot_size=slot_size, keys=keys[part], offsets=offsets[part],
                    generations=gens[part], priorities=prios[part],
                )
                for k in totals:
                    totals[k] += reply[k]
                progress.update(len(keys[part]))
            progress.close()
            if len(keys):
                log.info("re-sent %d items of table %r: %d restored from the checkpoint, %d "
                         "newer adopted, %d discarded", len(keys), table, totals["restored"],
                         totals["adopted"], totals["discarded"])

    def _discard_items(self) -> None:
        """The control plane does not know our items (it started afresh, or had
        dropped us): free them, loudly."""
        for table, (_, offsets, _, _, _) in self._held_items().items():
            if len(offsets):
                self._free(table, offsets)
                log.warning("the control plane does not restore items (it started without "
                            "--restore, or had dropped this node): %d items of table %r on "
                            "node %s are discarded", len(offsets), table, self.name)

    def _on_signal(self) -> None:
        if self._stop.is_set():
            self._now.set()
        self._stop.set()

    async def _leave(self) -> None:
        """Graceful exit: refuse new inserts, deregister (the control plane takes
        this node's items out of sampling at once), then give reads that learners
        may still have in flight up to `drain_timeout` s, until their leases are
        released, before the arena goes away."""
        loop_time = asyncio.get_running_loop().time
        self._leaving = True
        try:
            reply = await self.control.call("deregister_node", reply_timeout=5.0,
                                            node_id=self.node_id)
        except (ConnectionFailed, Timeout) as exc:
            log.warning("could not deregister from the control plane (%s); exiting anyway", exc)
            return
        leased = reply.get("leased", 0)
        log.info("node %s deregistered; %d of its slots under lease", self.name, leased)
        deadline = loop_time() + self.config.drain_timeout
        while leased and loop_time() < deadline and not self._now.is_set():
            # Learners release leases with their next request; asking again
            # (deregistering is idempotent) tells when the last one went.
            try:
                await asyncio.wait_for(self._now.wait(), min(0.1, deadline - loop_time()))
            except asyncio.TimeoutError:
                pass
            try:
                reply = await self.control.call("deregister_node", reply_timeout=2.0,
                                                node_id=self.node_id)
            except (ConnectionFailed, Timeout):
                return
            leased = reply.get("leased", 0)
        if leased:
            log.warning("node %s exits with %d slots still leased; those reads fail and "
                        "learners resample", self.name, leased)

    async def _reader_ticks(self, interval: float) -> None:
        # Heartbeats are not sent from here (storage/heartbeat.py says why),
        # but the heartbeat thread stops when these ticks stop (_beat).
        while True:
            self._loop_seen = time.monotonic()
            self.puller.progress_between_pulls()
            await asyncio.sleep(interval)

    def _beat(self) -> dict | None:
        """The heartbeat's fields (read on the heartbeat thread); None while
        not registered with a control plane."""
        arena, node_id = self.arena, self.node_id
        if arena is None or node_id is None or not self._joined.is_set():
            return None
        # A busy loop is late by seconds (measured up to 5 s beside 128
        # actors); one that has not run for LOOP_WEDGED s serves nothing:
        # the node must not look live then.
        late = time.monotonic() - self._loop_seen
        if late > LOOP_WEDGED:
            if not self._loop_wedged:
                self._loop_wedged = True
                log.error("node %s: its event loop has not run for %.0f s; heartbeats stop "
                          "until it does (the control plane routes around this node)",
                          self.name, late)
            return None
        self._loop_wedged = False
        return {"node_id": node_id, "used_bytes": arena.used_bytes}

    def _watch_writer(self, peer, token: int | None, k: int):
        """While batch `token` is pulled: if the writer's connection hangs up
        (it died), discard the batch, so that the pull ends at once instead
        of waiting for bytes that will never come (see native/am_insert.h).
        The insert is answered on the connection's own task, which reads
        nothing meanwhile: the socket is polled for the hang-up instead."""
        if not token:
            return None
        sock = peer.writer.get_extra_info("socket")
        if sock is None:
            return None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)

        async def watch():
            while not poller.poll(0):
                await asyncio.sleep(WRITER_CHECK)
            inbox = self.puller.am_inbox
            if inbox is not None:
                log.warning("node %s: the writer at %s left with an insert of %d items in "
                            "flight; its slots are freed", self.name, peer.address, k)
                inbox.discard(token, k)

        return asyncio.get_running_loop().create_task(watch())

    def _apply_free(self, fields: dict) -> None:
        try:
            self._free(fields["table"], fields["offsets"], live_only=True)
        except ValueError as exc:  # a confused control plane must not stop the node
            log.error("ignoring a free from the control plane: %s", exc)

    async def _on_push(self, op: str, fields: dict) -> None:
        if op == "free":
            # A free may name items of a registration whose reply came in but
            # whose insert has not committed its slots yet: it waits for the
            # registrations in flight now (storage/held_frees.py).
            self._frees.free(fields)
        elif op == "retire":
            # Evicted items a learner holds a lease on: their reads must fail
            # the header check from now on (control/retirements.py).
            self.arena.mark_retired(fields["offsets"], fields["generations"])
            self.control.push("retired", node_id=self.node_id, request=fields["request"])
        elif op == "stage" and self.tier is not None:
            asyncio.get_running_loop().create_task(self._stage(fields))
        elif op == "unstage" and self.staging is not None:
            for start in fields["extents"]:
                self.staging.give(int(start))
            self._staged.set()
        else:
            log.warning("ignoring unexpected push %r from the control plane", op)

    async def _handle(self, peer, op: str, f: dict):
        if op == "insert":
            try:
                return await self._insert(peer, f)
            except BaseException:
                token = f.get("am_token")
                if token and self.puller.am_inbox is not None:
                    # The batch's messages, now and when they come, go back.
                    self.puller.am_inbox.discard(token, len(f["keys"]))
                raise
        if op == "node_info":
            return {
                "node_id": self.node_id,
                "name": self.name,
                "arena_size": self.arena.size,
                "used_bytes": self.arena.used_bytes,
                "inserted": self.inserted,
                **({"disk_size": self.tier.size, "disk_used_bytes": self.tier.used_bytes,
                    "demoted": self.tier.demoted, "disk_write_errors": self.tier.write_errors,
                    "disk_read_errors": self.tier.read_errors,
                    "staging_used_bytes": self.staging.used_bytes}
                   if self.tier is not None else {}),
            }
        raise InvalidRequest(f"storage node {self.name} does not serve {op!r}: is the peer "
                             "a distore-ucx client of the same version?")

    async def _insert(self, peer, f: dict) -> dict:
        """Pull a writer's staged batch into slots, have the control plane
        register it, then acknowledge. On any failure the slots are freed
        before the error reply: the control plane never saw them, and their
        headers stay invalid."""
        if self._leaving:  # the writer resends to another node on this error
            raise ConnectionFailed(f"storage node {self.name} is shutting down")
        # Registered under the id the writer sent it to, never another: a writer
        # gives up on a node once the control plane dropped it and reuses the
        # staging buffer, so this node, re-joined under a new id, must not
        # register what it pulls from that buffer late (the control plane
        # refuses items of a dropped id).
        node_id = f.get("node_id", self.node_id)
        if node_id != self.node_id:
            raise ConnectionFailed(
                f"insert sent to node {node_id}, but storage node {self.name} is node "
                f"{self.node_id} now (it was dropped and re-joined); resend it"
            )
        keys = f["keys"]
        k = len(keys)
        item_bytes, slot_size = f["item_bytes"], f["slot_size"]
        lengths = f["lengths"]
        if k == 0 or slot_size < SLOT_HEADER + item_bytes or (lengths != item_bytes).any():
            raise SpecMismatch(
                f"insert into {f['table']!r}: {k} items of lengths {_lengths(lengths)} for "
                f"items of {item_bytes} bytes in {slot_size}-byte slots"
            )
        if f.get("am_token") and self.puller.am_inbox is None:
            raise InvalidRequest(
                f"storage node {self.name} does not take inserts as UCX active messages "
                "(it did not offer an insert_address): is the writer of another version?")
        source = self.puller.sources().get(peer, f)
        if not peer.state.get("watched"):
            peer.state["watched"] = True
            asyncio.get_running_loop().create_task(self._forget_writer(peer))
        table = f["table"]
        t0 = time.perf_counter()  # metrics: request to acknowledgement
        offsets = await self._allocate(table, slot_size, k)
        wait = f.get("timeout", 60.0)  # a rate limiter (or a control-plane restart) may hold it
        deadline = time.monotonic() + wait
        registration = self._frees.begin()
        try:
            return await self._store(peer, f, node_id, table, keys, k, item_bytes, lengths,
                                     source, offsets, deadline, t0)
        finally:
            self._frees.end(registration)

    async def _store(self, peer, f: dict, node_id: int, table: str, keys, k: int,
                     item_bytes: int, lengths, source, offsets, deadline: float,
                     t0: float) -> dict:
        """Pull an insert's items into its allocated slots, register them
        with the control plane and commit them (see _insert)."""
        try:
            gens = self.arena.next_generations(k)
            watch = self._watch_writer(peer, f.get("am_token"), k)
            try:
                await self.puller.pull(self.arena, source, offsets, keys, gens, f["offsets"],
                                       lengths, f.get("am_token"))
            finally:
                if watch is not None:
                    watch.cancel()
            while True:
                await self._until_joined(deadline, k)
                if node_id != self.node_id:  # dropped, then re-joined as another node
                    raise ConnectionFailed(
                        f"storage node {self.name} was dropped by the control plane while it "
                        f"stored an insert (it is node {self.node_id} now); resend it"
                    )
                left = max(0.0, deadline - time.monotonic())
                control = self.control
                try:
                    reply = await control.call(
                        "items_added",
                        reply_timeout=left + 10.0,
                        timeout=left,
                        node_id=node_id,
                        table=table,
                        keys=keys,
                        offsets=offsets,
                        generations=gens,
                        priorities=f["priorities"],
                        used_bytes=self.arena.used_bytes,
                        **({"epoch": f["epoch"]} if "epoch" in f else {}),
                    )
                    break
                except ConnectionFailed:
                    if self._leaving or not control.closed.is_set():
                        raise
                    if self.control is control:  # wait for the re-join, not spin
                        self._joined.clear()
                    # The control plane went away before acknowledging: the
                    # batch goes to the one we re-join (a restored control
                    # plane counts it as inserted after its checkpoint).
        except BaseException:
            if self.arena is not None:  # None: the node stopped while this insert waited
                self.arena.free(table, offsets)
            self.stats.failed_batches += 1
            if self._leaving:
                raise ConnectionFailed(f"storage node {self.name} is shutting down") from None
            raise
        twice = np.frombuffer(reply.get("duplicate_offsets", b""), np.uint64)
        if len(twice):
            # Keys the table holds already (this batch was resent here after
            # its first node went unresponsive, and both copies arrived).
            keep = ~np.isin(offsets, twice)
            self.arena.free(table, offsets[~keep])
            offsets, keys, gens = offsets[keep], keys[keep], gens[keep]
            prios = f["priorities"][keep]
        else:
            prios = f["priorities"]
        self.arena.commit(table, offsets, keys, gens, prios)
        self.inserted += k
        self.stats.inserted(k, k * item_bytes, time.perf_counter() - t0)
        return {"n": k, "evicted": reply.get("evicted", 0), "via": source.via}

    # -- the disk tier (storage/tier.py, control/tiers.py) -------------------
    async def _allocate(self, table: str, slot_size: int, k: int) -> np.ndarray:
        """Arena slots for an insert; with a disk tier, a full arena first
        demotes items of the table to disk (StorageFull when both are full);
        without one, the table evicts its own items here, by its remover
        (control/room.py; StorageFull when none can be)."""
        self._slot_sizes[table] = slot_size
        delay = 0.01
        for _ in range(20):  # other inserts may take the room we made: try again
            try:
                return self.arena.allocate(table, slot_size, k)
            except StorageFull as exc:
                if self.control is None or not self._joined.is_set():
                    raise
                if self.tier is None:
                    if not await self._make_room(table, slot_size, k, exc):
                        await asyncio.sleep(delay)  # inserts in flight hold the space
                        delay = min(2 * delay, 0.5)
                    continue
            if await self._demote(table, slot_size, k) == 0:
                # Nothing to demote now: the table's items here are leased, or
                # inserts in flight have not reached the control plane yet.
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)
        return self.arena.allocate(table, slot_size, k)  # raises StorageFull as it is

    async def _make_room(self, table: str, slot_size: int, k: int, full: StorageFull) -> bool:
        """Have the control plane evict items of `table` stored here (by the
        table's remover) and free their slots. False when none could be
        evicted yet because inserts in flight hold the table's space here
        (their items become evictable once registered); StorageFull, saying
        why, when none can be."""
        need = self.arena.shortfall(table, slot_size, k)
        if need == 0:
            return True  # another insert's eviction made the room meanwhile
        reply = await self.control.call("evict", node_id=self.node_id, table=table, n=need)
        offsets = np.frombuffer(reply["offsets"], np.uint64)
        if len(offsets):
            self.arena.free(table, offsets, live_only=True)
            return True
        slots = self.arena.tables().get(table)
        if slots is not None and (slots.cols["state"][:slots.n] == ALLOCATED).any():
            return False
        leased = reply.get("leased", 0)
        raise StorageFull(
            f"{full} [table {table!r} has no item on node {self.name} that could be evicted "
            "to make room"
            + (f": its {leased} items here are under lease (learners reading them; they are "
               "freed when released)" if leased else
               ": the space is held by other tables, which keep it (tables share arenas "
               "first come, first served)")
            + "]")

    async def _demote(self, table: str, slot_size: int, k: int) -> int:
        """Move at least k items of `table` (as the control plane picks them)
        from the arena to disk; how many moved."""
        async with self._demoting:
            slots = self.arena.tables().get(table)
            if slots is not None and slots.free_slots >= k:
                return k  # another insert's demotion made the room meanwhile
            want = min(max(k, DEMOTE_BATCH), self.tier.room(table, slot_size))
            if want == 0:
                self.tier.allocate(table, slot_size, k)  # raises StorageFull: both tiers full
            reply = await self.control.call("demote", node_id=self.node_id, table=table,
                                            n=want)
            keys = np.frombuffer(reply["keys"], np.uint64)
            if len(keys) == 0:
                return 0
            offsets = np.frombuffer(reply["offsets"], np.uint64)
            gens = np.frombuffer(reply["generations"], np.uint64)
            disk = self.tier.allocate(table, slot_size, len(keys))
            new_gens = self.arena.next_generations(len(keys))
            loop = asyncio.get_running_loop()
            statuses = await loop.run_in_executor(
                self._disk(), self.tier.write, self.arena.region, offsets, slot_size, disk,
                keys, new_gens)
            ok = statuses == 0
            if not ok.all():
                bad = int(np.count_nonzero(~ok))
                self.tier.write_errors += bad
                self.tier.free(table, disk[~ok])
                log.error("node %s: could not write %d of %d items of table %r to the disk tier "
                          "%s (%s); they stay in the arena", self.name, bad, len(keys), table,
                          self.config.disk, os.strerror(int(statuses[~ok][0]))
                          if statuses[~ok][0] > 0 else "bad slot")
                if not ok.any():
                    raise StorageFull(
                        f"node {self.name}: arena full and the disk tier {self.config.disk} "
                        f"failed to write ({os.strerror(int(statuses[0]))}); the insert into "
                        f"table {table!r} was not stored and nothing in the arena was lost. "
                        "Check the disk (see the node's log)")
                keys, offsets, gens, disk, new_gens = (a[ok] for a in
                                                       (keys, offsets, gens, disk, new_gens))
            reply = await self.control.call(
                "items_moved", node_id=self.node_id, table=table, keys=keys, offsets=offsets,
                generations=gens, new_offsets=disk | COLD, new_generations=new_gens)
            taken = np.frombuffer(reply["taken"], np.uint8).astype(bool)
            self.tier.free(table, disk[~taken])  # evicted or sampled meanwhile: stay hot
            if taken.any():  # then the table still has these arena slots
                hot = self.arena.tables()[table]
                prios = hot.cols["priority"][hot.index(offsets[taken])]
                self.tier.commit(table, disk[taken], keys[taken], new_gens[taken], prios)
                self.arena.free(table, offsets[taken], live_only=True)
            self.tier.demoted += int(taken.sum())
            return int(taken.sum())

    async def _stage(self, f: dict) -> None:
        """Read a sample's cold items into the staging area and tell the
        control plane where they are (a `staged` push)."""
        req, keys, slot_size = f["request"], f["keys"], f["slot_size"]
        stride = stride_of(slot_size)
        need = len(keys) * stride
        try:
            if need > self.staging.size:
                raise StagingFull(
                    f"node {self.name}: a sample needs {len(keys)} cold items of table "
                    f"{f['table']!r} staged ({need} bytes) but the staging area holds "
                    f"{self.staging.size}: raise --disk-staging or sample smaller batches")
            deadline = time.monotonic() + STAGE_WAIT
            while (room := self.staging.take(len(keys), stride)) is None:
                # Staged extents come back when learners release their leases.
                self._staged.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingFull(
                        f"node {self.name}: staging area full ({self.staging.used_bytes} of "
                        f"{self.staging.size} bytes leased) for {STAGE_WAIT:g} s, {need} bytes "
                        f"of cold items of table {f['table']!r} wanted. Each learner holds "
                        "the cold items of 3 batches (the one it reads and two asked ahead) "
                        "until it releases them: raise --disk-staging, or sample smaller "
                        "batches")
                try:
                    await asyncio.wait_for(self._staged.wait(), left)
                except asyncio.TimeoutError:
                    pass
            dest, extents = room
            t0 = time.perf_counter()  # the debug log's time includes the wait for the disk
            try:
                # Samples' batches queue in the tier's native reader, first
                # in, first out (storage/tier.py).
                statuses = await asyncio.get_running_loop().run_in_executor(
                    self._disk(), self.tier.read, f["offsets"], slot_size,
                    self.arena.region, dest, keys, f["generations"])
            except BaseException:
                for start in extents:
                    self.staging.give(start)
                self._staged.set()
                raise
            bad = statuses != 0
            if bad.any():
                self.tier.read_errors += int(bad.sum())
                first = int(statuses[bad][0])
                why = os.strerror(first) if first > 0 else _native.status_name(first)
                log.error("node %s: %d of %d cold items of table %r could not be read back from "
                          "%s (%s: an I/O error, a slot failing its checksum, or another "
                          "item's); reported lost", self.name, int(bad.sum()), len(keys),
                          f["table"], self.config.disk, why)
            self.control.push("staged", node_id=self.node_id, request=req, extents=extents,
                              offsets=dest, statuses=statuses.view(np.uint32))
            log.debug("staged %d cold items of table %r (%d bytes) in %.1f ms", len(keys),
                      f["table"], need, 1e3 * (time.perf_counter() - t0))
        except Exception as exc:  # the sample waiting on this must hear why
            log.error("%s", exc)
            if self.control is not None:
                self.control.push("staged", node_id=self.node_id, request=req,
                                  error=str(exc)[:4000], code=protocol.error_code(exc))

    def _disk(self) -> ThreadPoolExecutor:
        # Disk batches, off the loop; the native call fans each out to its own threads.
        if self._disk_thread is None:
            self._disk_thread = ThreadPoolExecutor(2, thread_name_prefix="disk")
        return self._disk_thread

    async def _forget_writer(self, peer) -> None:
        """Drop a writer's cached endpoint and remote keys when its connection closes."""
        await peer.closed.wait()
        self.puller.sources().drop(peer)

    async def _until_joined(self, deadline: float, k: int) -> None:
        """Wait until we are registered with a control plane, or raise Timeout."""
        if self._joined.is_set():
            return
        try:
            await asyncio.wait_for(self._joined.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise Timeout(
                f"storage node {self.name} has no control plane (lost {self.config.control}); "
                f"the insert of {k} items waited its timeout and was not stored. Restart the "
                "control plane (with --restore to keep the store's contents)"
            ) from None


def _lengths(lengths: np.ndarray) -> str:
    values = np.unique(lengths)
    return ", ".join(str(v) for v in values[:4]) + (", ..." if len(values) > 4 else "")


def main(config: NodeConfig, ready_file: str | None = None) -> int:
    """Run a storage node in this process until stopped."""
    return asyncio.run(StorageNode(config).run(ready_file))
