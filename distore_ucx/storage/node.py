"""The storage node process: `distore node --control HOST:PORT --arena 4GiB`.

Owns one arena registered with UCX for remote READ. Writers send insert
descriptors over the control channel; the node pulls each batch one-sided
from the writer's staging buffer straight into slots, or receives it as UCX
active messages into them (storage/pulls.py, storage/puller.py: on a pull
thread, off the event loop), reports them to the control plane (the
batches stored while its last report was answered in one message,
storage/registrations.py) and acknowledges the writer only once the control plane
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
import secrets
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

from .. import metrics
from .._native_loader import _native
from ..config import (
    NodeConfig,
    am_samples_enabled,
    read_token,
    register_delay,
    runtime_config,
    ucx_tls,
    uvloop_enabled,
)
from ..errors import ConfigError, ConnectionFailed, Timeout
from ..progress import Progress
from ..protocol import parse_reply
from ..roles import write_ready
from ..status import format_size
from ..transport import UcxRuntime, event_loop
from ..transport.dispatch import Dispatcher
from ..transport.local_map import LocalMapServer
from ..transport.rpc import parse_address, serve
from ..transport.runtime import host_id
from .arena import Arena, granted_page_kind, memory_available, page_advice, page_size_label
from .guard import guard_remote_access, watch_guard
from .heartbeat import Heartbeat
from .inserts import InsertServer
from .puller import Puller
from .registrations import Registrations
from .room import RoomForInserts
from .sample_server import SampleServer
from .session import ControlSession
from .staging import ColdStaging
from .state import NodeState
from .tier import DiskTier, StagingArea, bounce_reads

__all__ = ["StorageNode", "main", "route_address"]

log = logging.getLogger(__name__)

# The arena is populated (node.prefault) this many bytes a call (each call
# off the event loop), with progress logged for arenas of at least
# POPULATE_PROGRESS_BYTES.
POPULATE_CHUNK = 1 << 30
POPULATE_PROGRESS_BYTES = 8 << 30
UNBACKED_HINT = ("give a smaller --arena, free memory (or reserve more hugepages), or start "
                 "with --no-prefault to take pages as items arrive (the node is then killed "
                 "if memory runs out once its arena fills)")


def route_address(control_host: str) -> str:
    """The local address that routes to the control plane (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((control_host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class StorageNode:
    """One storage node: arena, insert server, control-plane session.

    Its process lifecycle is here: start-up, serving until stopped, the
    graceful exit and the teardown. It makes the node's resources (the
    arena, the pull thread, the disk tier, the sample server, the map for
    same-host learners) and its parts, each given what it uses, with the
    state they share in one object (storage/state.py): the control-plane
    session (storage/session.py), the insert server (storage/inserts.py)
    with room for inserts in a full arena (storage/room.py), and staging
    cold items (storage/staging.py). Writers' requests reach the insert
    server through a Dispatcher (transport/dispatch.py), as the control
    plane's reach its handlers.
    """

    def __init__(self, config: NodeConfig):
        self.config = config
        self.name = config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.state = NodeState(config, self.name)
        self.runtime: UcxRuntime | None = None
        self.local_map: LocalMapServer | None = None  # same-host learners map the arena
        self.puller: Puller | None = None  # reads writers' batches (storage/puller.py)
        # serves samples by active message where UCX emulates RMA (storage/sample_server.py)
        self.sample_server: SampleServer | None = None
        # The parts, made at start-up once what they use exists (_make_parts).
        self.session: ControlSession | None = None
        self.inserts: InsertServer | None = None
        self._disk_thread: ThreadPoolExecutor | None = None  # disk batches, with a disk tier
        self.stats = metrics.NodeStats()  # read at scrape time (metrics/families.py)
        self._stop = asyncio.Event()
        self._now = asyncio.Event()  # a second SIGTERM: skip the drain
        # items_added requests: the inserts stored while one is answered go
        # together (small ones waiting up to DISTORE_REGISTER_DELAY for more)
        self.registrations = Registrations(self.state.used_bytes, self.state.commit_registered,
                                           register_delay())
        self._token: bytes | None = None
        self._where: tuple[str, int] = ("", 0)  # host, port writers reach us at
        self._am_samples = am_samples_enabled()
        # The key of this node's active-message listeners (native/am_grant.h),
        # for the control plane only.
        self.am_key = secrets.token_bytes(16)

    @property
    def arena(self) -> Arena | None:
        """The arena (None before start-up and after the teardown)."""
        return self.state.arena

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
        with UcxRuntime(config={**runtime_config(), **guarded}, env_tls=ucx_tls()) as runtime:
            self.runtime = runtime
            steps.write(f"mapping and registering a {cfg.arena_bytes / 2**30:.1f} GiB arena"
                        + (" (and making its pages: --no-prefault not to)" if cfg.prefault
                           else ""))
            guard_watch = self._open_arena(runtime, host)
            if cfg.prefault:
                await self._populate_arena()
            steps.update(1, note="arena mapped" + (" and populated" if cfg.prefault else ""))
            self._token = read_token(cfg.token_file)
            self._start_local_map()
            dispatch = self._make_parts()  # writers' requests -> the insert server
            server = await serve(host, cfg.port, dispatch.handle, token=self._token,
                                 role="storage node")
            port = server.sockets[0].getsockname()[1]
            self._where = (host, port)
            steps.update(1, note=f"listening on {host}:{port}")
            metrics_server = metrics.serve_process(
                cfg.metrics_port, cfg.metrics_host, loop, self,
                lambda node: metrics.node_snapshot(node, joined=node.state.joined.is_set()),
                metrics.node_families, f"storage node {self.name}", cfg.metrics_optional)
            beat = None
            try:
                if not await self.session.first_join():
                    return 0 if self._stop.is_set() else 3
                beat = Heartbeat(cfg.control, self._token, lambda: self.session.interval,
                                 self.session.beat, f"node {self.name}").start()
                steps.update(1, note=f"joined as node {self.state.node_id}")
                steps.close()
                self._log_serving()
                if ready_file:
                    write_ready(ready_file, {"node_id": self.state.node_id,
                                              "address": f"{host}:{port}",
                                              "metrics_port": metrics_server and
                                              metrics_server.port})
                code = await self._serve()
            finally:
                await self._close(guard_watch, beat, server, metrics_server)
        log.info("node %s stopped", self.name)
        return code

    def _open_arena(self, runtime: UcxRuntime, host: str) -> asyncio.Task:
        """Map the arena and start what reads into it and from it: the pull
        thread, the disk tier (--disk), the sample server and writers' insert
        inbox; returns the task that watches the guard (storage/guard.py)."""
        cfg, state = self.config, self.state
        state.arena = Arena(runtime, cfg.arena_bytes, cfg.hugepages, self.name,
                            write_protect=cfg.write_protect, reserve=cfg.staging_bytes)
        self.puller = Puller(runtime, self.name)
        if cfg.disk:
            self._start_tier()
        _native.allow_remote_reads(state.arena.base, state.arena.size)
        self.sample_server = SampleServer.start(runtime, state.arena, self.name, host,
                                                self._am_samples, self.am_key)
        self.puller.start_am_inbox(host, self.am_key)  # where writers reach us
        # The insert listener's connections that did not authenticate
        # are closed by the pull thread's tick, here when nothing else moves.
        checks = [self.puller.progress_between_pulls]
        if self.sample_server is not None:
            checks.append(self.sample_server.check)
        return asyncio.get_running_loop().create_task(watch_guard(self.name, checks))

    async def _populate_arena(self) -> None:
        """Make every page of the arena now (the setting node.prefault), off
        the event loop, a chunk at a time: inserts then take no first-touch
        fault (the kernel zeroing a page as an item first lands on it, a
        quarter of a node's CPU while its arena fills), and a host that cannot
        back the arena says so at start rather than killing the node once
        the arena fills. Progress is logged on long work; a stop (SIGTERM)
        ends it early (the start-up then winds down). Raises ConfigError
        when the pages cannot be had."""
        arena, size = self.state.arena, self.state.arena.size
        if arena.page_kind != "hugetlb":  # reserved hugepages were had at mapping
            available, bound = memory_available()
            if size > available:
                raise ConfigError(
                    f"storage node {self.name}: the host cannot back a {format_size(size)} "
                    f"arena: {format_size(available)} can be made resident ({bound}): "
                    + UNBACKED_HINT)
        loop = asyncio.get_running_loop()
        progress = (Progress(f"node {self.name}: populating the arena", total=size / 2**30,
                             unit="GiB", logger=log, every=5.0)
                    if size >= POPULATE_PROGRESS_BYTES else None)
        done = 0
        try:
            while done < size:
                if self._stop.is_set():
                    return
                chunk = min(POPULATE_CHUNK, size - done)
                err = await loop.run_in_executor(None, arena.region.populate, done, chunk)
                if err:
                    raise ConfigError(
                        f"storage node {self.name}: the host cannot back a "
                        f"{format_size(size)} arena ({os.strerror(err)} after "
                        f"{format_size(done)} of {arena.page_kind} pages): "
                        + UNBACKED_HINT)
                done += chunk
                if progress is not None:
                    progress.update(chunk / 2**30)
        finally:
            if progress is not None:
                progress.close()

    def _make_parts(self) -> Dispatcher:
        """The node's parts, each given what it uses (see the class); returns
        the dispatcher of writers' requests."""
        state, disk = self.state, self._disk_thread
        # Cold items are staged only with a disk tier: a node without one
        # ignores `stage` pushes, as any push it does not serve.
        staging = () if disk is None else (ColdStaging(state, disk),)
        self.session = ControlSession(state, self._token, self._offer, self._tick, self._stop,
                                      *staging)
        self.inserts = InsertServer(state, self.puller, RoomForInserts(state, disk),
                                    self.registrations, self.session.frees, self.stats)
        return Dispatcher(self.inserts, server=f"storage node {self.name}",
                          peers="a distore-ucx client")

    def _offer(self) -> dict:
        """register_node's fields that say what this node serves and where
        (the session adds its former id and its heartbeats' secret)."""
        arena, puller, sample_server = self.state.arena, self.puller, self.sample_server
        host, port = self._where
        return dict(
            name=self.name,
            host=host,
            port=port,
            worker_address=self.runtime.address,
            rkey=arena.region.pack_rkey(),
            arena_base=arena.base,
            arena_size=arena.size,
            pid=os.getpid(),
            host_id=host_id(),
            arena_id=arena.arena_id,
            page_kind=granted_page_kind(arena.page_kind),
            **({"local_socket": self.local_map.name} if self.local_map else {}),
            **({"disk_size": self.state.tier.size} if self.state.tier is not None else {}),
            **({"insert_port": puller.insert_port} if puller.insert_port else {}),
            **({"insert_run_bytes": puller.insert_run_bytes}
               if puller.insert_port and puller.insert_run_bytes else {}),
            **({"am_sample": True, "sample_port": sample_server.port}
               if sample_server is not None else {}),
            **({"am_key": self.am_key}
               if sample_server is not None or puller.insert_port else {}),
        )

    def _log_serving(self) -> None:
        arena, (host, port) = self.state.arena, self._where
        log.info(
            "node %s (id %d) serving %d-byte arena on %s pages at %s:%d over UCX %s; "
            "same-host learners %s; event loop %s",
            self.name, self.state.node_id, arena.size,
            page_size_label(arena.page_kind), host, port, self.runtime.transports,
            "map it read-only" if self.local_map else "read it over UCX", event_loop.loop_name(),
        )
        advice = page_advice(arena.page_kind)
        if advice:
            log.info("node %s: %s", self.name, advice)

    async def _close(self, guard_watch: asyncio.Task, beat: Heartbeat | None, server,
                     metrics_server) -> None:
        """Close what run() made, in reverse order of creation, all before the runtime."""
        state = self.state
        state.leaving = True  # inserts still in flight fail as "shutting down"
        guard_watch.cancel()
        if beat is not None:
            beat.close()
        server.close()
        if metrics_server is not None:
            metrics_server.close()
        if self.local_map is not None:
            self.local_map.close()
        if state.control is not None:
            await state.control.close()
        if state.tier is not None:
            if self._disk_thread is not None:
                self._disk_thread.shutdown(wait=True)
            state.tier.close()
        await self.puller.close()  # its threads read through the runtime
        if self.sample_server is not None:  # it sends from the arena
            await self.sample_server.close()
        state.arena = None  # unmap before the runtime closes (the parts reach it through state)

    def _start_tier(self) -> None:
        """Open the disk tier (--disk), the arena's staging area for its cold
        items and the threads its batches run on."""
        cfg, state = self.config, self.state
        tier = state.tier = DiskTier(cfg.disk, cfg.disk_bytes, self.name, state.arena.arena_id)
        state.staging = StagingArea(cfg.staging_bytes)
        # Disk batches, off the loop; the native call fans each out to its
        # own threads. The executor starts its threads on first use.
        self._disk_thread = ThreadPoolExecutor(2, thread_name_prefix="disk")
        # Straight into the staging area only on reserved hugepages:
        # into shared-memory transparent hugepages the disk read
        # slower than through the hugepage buffers (docs/performance.md,
        # perf/tier_bandwidth.py).
        tier.bounce = tier.direct and bounce_reads(state.arena.page_kind == "hugetlb")
        log.info("node %s: disk tier %s, %d bytes%s; %d arena bytes for staging cold "
                 "items%s", self.name, cfg.disk, tier.size,
                 "" if tier.direct else " (no O_DIRECT there)",
                 state.staging.size, f", read through hugepage buffers (arena pages: "
                 f"{state.arena.page_kind})" if tier.bounce else "")

    async def _serve(self) -> int:
        """Heartbeat the control plane until told to stop; re-join it whenever
        it is lost. Returns the exit code."""
        state, session = self.state, self.session
        while True:
            beat = asyncio.create_task(session.ticks(session.interval))
            lost = asyncio.create_task(state.control.closed.wait())
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
            for t in (beat, lost, stop):
                t.cancel()
            if self._stop.is_set():
                if not state.control.closed.is_set():
                    await self._leave()
                return 0
            state.joined.clear()
            held = sum(len(t.live()[0]) for t in state.arena.tables().values())
            log.warning("lost the control plane at %s; node %s keeps its %d items, holds "
                        "inserts and tries to re-join for %g s", self.config.control, self.name,
                        held, self.config.reconnect_timeout)
            if not await session.rejoin():
                if self._stop.is_set():
                    return 0
                log.error("no control plane at %s within %g s; node %s exits",
                          self.config.control, self.config.reconnect_timeout, self.name)
                return 3

    def _tick(self) -> None:
        """The event loop's periodic tick (storage/session.py): the pull
        thread's reader progress between pulls, and handed-over staging
        buffers of writers that exited without claiming them unmapped."""
        self.puller.progress_between_pulls()
        self.puller.sources().forget_departed()

    def _start_local_map(self) -> None:
        """Offer the sealed arena to same-host learners (a Unix socket, after
        the store's HMAC handshake); say why not when it cannot be offered."""
        state = self.state
        arena = state.arena
        if arena.share_fd < 0:
            why = ("--no-write-protect leaves the arena unsealed" if not
                   self.config.write_protect else "this kernel cannot seal it (Linux >= 5.1 "
                   "has F_SEAL_FUTURE_WRITE)")
            log.info("node %s: same-host learners read over UCX: %s", self.name, why)
            return
        try:
            self.local_map = LocalMapServer(
                arena.share_fd, arena.size, arena.arena_id, arena.page_kind, self._token,
                self.name, high_water=lambda: state.arena.high_water if state.arena else 0,
                on_staging=self.puller.sources().offer).start()
        except OSError as exc:
            log.warning("node %s: cannot offer its arena to same-host learners (%s); they "
                        "read over UCX", self.name, exc)
            self.local_map = None

    def _on_signal(self) -> None:
        if self._stop.is_set():
            self._now.set()
        self._stop.set()

    async def _leave(self) -> None:
        """Graceful exit: refuse new inserts, deregister (the control plane takes
        this node's items out of sampling at once), then give reads that learners
        may still have in flight up to `drain_timeout` s, until their leases are
        released, before the arena goes away."""
        state = self.state
        loop_time = asyncio.get_running_loop().time
        state.leaving = True
        try:
            reply = await state.control.call("deregister_node", reply_timeout=5.0,
                                             node_id=state.node_id)
        except (ConnectionFailed, Timeout) as exc:
            log.warning("could not deregister from the control plane (%s); exiting anyway", exc)
            return
        leased = parse_reply("deregister_node", reply, state.control.name).leased
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
                reply = await state.control.call("deregister_node", reply_timeout=2.0,
                                                 node_id=state.node_id)
            except (ConnectionFailed, Timeout):
                return
            leased = parse_reply("deregister_node", reply, state.control.name).leased
        if leased:
            log.warning("node %s exits with %d slots still leased; those reads fail and "
                        "learners resample", self.name, leased)


def main(config: NodeConfig, ready_file: str | None = None) -> int:
    """Run a storage node in this process until stopped."""
    return event_loop.run(StorageNode(config).run(ready_file), uvloop_enabled())
