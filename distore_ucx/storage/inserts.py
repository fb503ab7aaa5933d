"""The storage node's insert server: writers' requests on its listening socket.

A writer sends an insert descriptor; the node allocates slots (making room
if the arena is full, storage/room.py), pulls the batch into them
(storage/puller.py), has the control plane register the items (with the
inserts stored meanwhile, storage/registrations.py) and commits them, then
acknowledges: an acknowledged insert is sampleable. On any
failure the slots are freed before the error reply. `node_info` answers
what `distore status` shows of the node.
"""

from __future__ import annotations

import asyncio
import logging
import select
import time

import numpy as np

from ..errors import ConnectionFailed, DistoreError, InvalidRequest, SpecMismatch, Timeout
from ..metrics import NodeStats
from ..protocol import steps_of
from ..spec import SLOT_HEADER
from .held_frees import HeldFrees
from .puller import Puller
from .registrations import Registered, Registrations, Stored
from .room import RoomForInserts
from .state import NodeState

log = logging.getLogger(__name__)

WRITER_CHECK = 0.05  # s between checks that a writer whose batch is pulled is still there


class InsertServer:
    """Serves writers' inserts and `node_info` (`op_insert`, `op_node_info`,
    routed by the node's Dispatcher, transport/dispatch.py).

    Given the node's shared state (storage/state.py: its name, arena,
    tier, staging area, control connection, node id, `joined` and
    `leaving`), the pull thread (storage/puller.py), room for inserts
    (storage/room.py), the registrations in flight (storage/registrations.py),
    the frees held behind them (storage/held_frees.py; the session applies
    them) and the node's insert counters (metrics.NodeStats).

    >>> inserts = InsertServer(state, puller, room, registrations, session.frees, stats)
    >>> Dispatcher(inserts, server="storage node a", peers="a distore-ucx client")
    """

    def __init__(self, state: NodeState, puller: Puller, room: RoomForInserts,
                 registrations: Registrations, frees: HeldFrees, stats: NodeStats):
        self.state = state
        self.puller = puller
        self.room = room
        self.registrations = registrations
        self.frees = frees
        self.stats = stats
        self.inserted = 0  # items acknowledged (node_info)

    async def op_insert(self, peer, f: dict) -> dict:
        """Store a writer's batch (see _insert)."""
        try:
            return await self._insert(peer, f)
        except BaseException:
            token = f.get("am_token")
            if token and self.puller.am_inbox is not None:
                # The batch's messages, now and when they come, go back.
                self.puller.am_inbox.discard(token, len(f["keys"]))
            raise

    def op_node_info(self, peer, f: dict) -> dict:
        """What `distore status` shows of this node."""
        state = self.state
        return {
            "node_id": state.node_id,
            "name": state.name,
            "arena_size": state.arena.size,
            "used_bytes": state.arena.used_bytes,
            "inserted": self.inserted,
            **({"disk_size": state.tier.size, "disk_used_bytes": state.tier.used_bytes,
                "demoted": state.tier.demoted, "disk_write_errors": state.tier.write_errors,
                "disk_read_errors": state.tier.read_errors, "disk_reads": state.tier.reads,
                "staging_used_bytes": state.staging.used_bytes}
               if state.tier is not None else {}),
        }

    async def _insert(self, peer, f: dict) -> dict:
        """Pull a writer's staged batch into slots, have the control plane
        register it, then acknowledge. On any failure the slots are freed
        before the error reply: the control plane never saw them, and their
        headers stay invalid."""
        state = self.state
        if state.leaving:  # the writer resends to another node on this error
            raise ConnectionFailed(f"storage node {state.name} is shutting down")
        # Registered under the id the writer sent it to, never another: a writer
        # gives up on a node once the control plane dropped it and reuses the
        # staging buffer, so this node, re-joined under a new id, must not
        # register what it pulls from that buffer late (the control plane
        # refuses items of a dropped id).
        node_id = f.get("node_id", state.node_id)
        if node_id != state.node_id:
            raise ConnectionFailed(
                f"insert sent to node {node_id}, but storage node {state.name} is node "
                f"{state.node_id} now (it was dropped and re-joined); resend it"
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
                f"storage node {state.name} does not take inserts as UCX active messages "
                "(it did not offer an insert_port): is the writer of another version?")
        source = self.puller.sources().get(peer, f)
        if not peer.state.get("watched"):
            peer.state["watched"] = True
            asyncio.get_running_loop().create_task(self._forget_writer(peer))
        table = f["table"]
        t0 = time.perf_counter()  # metrics: request to acknowledgement
        offsets = self.room.allocate_now(table, slot_size, k)
        if offsets is None:  # the arena is full: room is made first
            offsets = await self.room.allocate(table, slot_size, k)
        wait = f.get("timeout", 60.0)  # a rate limiter (or a control-plane restart) may hold it
        deadline = time.monotonic() + wait
        registration = self.frees.begin()
        try:
            return await self._store(peer, f, node_id, table, keys, k, item_bytes, lengths,
                                     source, offsets, deadline, t0)
        finally:
            self.frees.end(registration)

    async def _store(self, peer, f: dict, node_id: int, table: str, keys, k: int,
                     item_bytes: int, lengths, source, offsets, deadline: float,
                     t0: float) -> dict:
        """Pull an insert's items into its allocated slots and register them
        with the control plane; the registration commits them when the
        reply comes (see _insert and storage/registrations.py)."""
        state = self.state
        stored = None
        try:
            gens = state.arena.next_generations(k)
            token = f.get("am_token")
            if not self.puller.pulled_here(state.arena, source, offsets, keys, gens,
                                           f["offsets"], lengths, k * item_bytes):
                watch = self._watch_writer(peer, token, k)
                try:
                    await self.puller.pull(state.arena, source, offsets, keys, gens,
                                           f["offsets"], lengths, token)
                finally:
                    if watch is not None:
                        watch.cancel()
            # Steps of episodes: kept with their slots, re-sent to a restored control plane.
            stored = Stored(keys, offsets, gens, f["priorities"], steps_of(f), deadline,
                            nbytes=k * item_bytes)
            registered = await self._register(node_id, table, f.get("epoch"), stored)
        except BaseException as exc:
            done = stored.done if stored is not None else None
            if done is not None and done.done() and not done.cancelled() \
                    and done.exception() is None:
                # Registered and committed, then this task was cancelled (the
                # writer left, or the node stops): the items are stored.
                raise
            if state.arena is not None:  # None: the node stopped while this insert waited
                state.arena.free(table, offsets)
            self.stats.failed_batches += 1
            if state.leaving:
                raise ConnectionFailed(f"storage node {state.name} is shutting down") from None
            if isinstance(exc, DistoreError):  # the writer hears it too; the operator here
                log.warning("node %s: an insert of %d items into %r from %s failed, its slots "
                            "are freed (the writer resends or reports it): %s", state.name, k,
                            table, source.name, exc)
            raise
        # Committed with the other inserts of its registration; the slots of
        # keys the table held already (this batch was resent here after its
        # first node went unresponsive, and both copies arrived) freed.
        self.inserted += k
        self.stats.inserted(k, k * item_bytes, time.perf_counter() - t0)
        return {"n": k, "evicted": registered.evicted, "via": source.via}

    async def _register(self, node_id: int, table: str, epoch: int | None,
                        stored: Stored) -> Registered:
        """Have the control plane register an insert's stored items (and
        the node commit them); if it goes away before acknowledging, the
        node's re-join is waited for (and the items registered with that
        control plane) until the insert's deadline."""
        state = self.state
        while True:
            if not state.joined.is_set():
                await self._until_joined(stored.deadline, len(stored.keys))
            if node_id != state.node_id:  # dropped, then re-joined as another node
                raise ConnectionFailed(
                    f"storage node {state.name} was dropped by the control plane while it "
                    f"stored an insert (it is node {state.node_id} now); resend it"
                )
            control = state.control
            try:
                return await self.registrations.register(control, node_id, table, epoch,
                                                         stored)
            except ConnectionFailed:
                if state.leaving or not control.closed.is_set():
                    raise
                if state.control is control:  # wait for the re-join, not spin
                    state.joined.clear()
                # The control plane went away before acknowledging: the
                # batch goes to the one we re-join (a restored control
                # plane counts it as inserted after its checkpoint).

    async def _until_joined(self, deadline: float, k: int) -> None:
        """Wait until the node is registered with a control plane, or raise Timeout."""
        state = self.state
        if state.joined.is_set():
            return
        try:
            await asyncio.wait_for(state.joined.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise Timeout(
                f"storage node {state.name} has no control plane (lost {state.config.control}); "
                f"the insert of {k} items waited its timeout and was not stored. Restart the "
                "control plane (with --restore to keep the store's contents)"
            ) from None

    def _watch_writer(self, peer, token: int | None, k: int):
        """While batch `token` is pulled: if the writer's connection hangs up
        (it died), discard the batch, so that the pull ends at once instead
        of waiting for bytes that will never come (see native/am_insert.h).
        The insert is answered on the connection's own task, which reads
        nothing meanwhile: the socket is polled for the hang-up instead."""
        state = self.state
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
                            "flight; its slots are freed", state.name, peer.address, k)
                inbox.discard(token, k)

        return asyncio.get_running_loop().create_task(watch())

    async def _forget_writer(self, peer) -> None:
        """Drop a writer's cached endpoint and remote keys when its connection closes."""
        await peer.closed.wait()
        self.puller.sources().drop(peer)


def _lengths(lengths: np.ndarray) -> str:
    values = np.unique(lengths)
    return ", ".join(str(v) for v in values[:4]) + (", ..." if len(values) > 4 else "")
