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

from ..errors import ConnectionFailed, DistoreError, InvalidRequest, SpecMismatch
from ..protocol import steps_of
from ..spec import SLOT_HEADER
from .registrations import Stored

log = logging.getLogger(__name__)

WRITER_CHECK = 0.05  # s between checks that a writer whose batch is pulled is still there


class InsertServer:
    """Serves writers' inserts and `node_info`.

    Mixed into StorageNode (storage/node.py): uses its arena, tier, staging
    area, control connection, node id, stats, `puller`, `registrations`, `_frees`, `_joined`,
    `_leaving`, `_allocate` (storage/room.py) and `_until_joined`
    (storage/session.py).
    """

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
                    "disk_read_errors": self.tier.read_errors, "disk_reads": self.tier.reads,
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
                "(it did not offer an insert_port): is the writer of another version?")
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
                control = self.control
                try:
                    registered = await self.registrations.register(
                        control, node_id, table, f.get("epoch"),
                        # steps of episodes: passed on as the writer gave them
                        Stored(keys, offsets, gens, f["priorities"], steps_of(f), deadline))
                    break
                except ConnectionFailed:
                    if self._leaving or not control.closed.is_set():
                        raise
                    if self.control is control:  # wait for the re-join, not spin
                        self._joined.clear()
                    # The control plane went away before acknowledging: the
                    # batch goes to the one we re-join (a restored control
                    # plane counts it as inserted after its checkpoint).
        except BaseException as exc:
            if self.arena is not None:  # None: the node stopped while this insert waited
                self.arena.free(table, offsets)
            self.stats.failed_batches += 1
            if self._leaving:
                raise ConnectionFailed(f"storage node {self.name} is shutting down") from None
            if isinstance(exc, DistoreError):  # the writer hears it too; the operator here
                log.warning("node %s: an insert of %d items into %r from %s failed, its slots "
                            "are freed (the writer resends or reports it): %s", self.name, k,
                            table, source.name, exc)
            raise
        twice = registered.duplicate_offsets
        if len(twice):
            # Keys the table holds already (this batch was resent here after
            # its first node went unresponsive, and both copies arrived).
            keep = ~np.isin(offsets, twice)
            self.arena.free(table, offsets[~keep])
            offsets, keys, gens = offsets[keep], keys[keep], gens[keep]
            prios = f["priorities"][keep]
        else:
            keep = slice(None)
            prios = f["priorities"]
        # Steps of episodes: kept with their slots, re-sent to a restored control plane.
        steps = steps_of(f)
        if steps is not None:
            steps = tuple(a[keep] for a in steps)
        self.arena.commit(table, offsets, keys, gens, prios, steps)
        self.inserted += k
        self.stats.inserted(k, k * item_bytes, time.perf_counter() - t0)
        return {"n": k, "evicted": registered.evicted, "via": source.via}

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

    async def _forget_writer(self, peer) -> None:
        """Drop a writer's cached endpoint and remote keys when its connection closes."""
        await peer.closed.wait()
        self.puller.sources().drop(peer)


def _lengths(lengths: np.ndarray) -> str:
    values = np.unique(lengths)
    return ", ".join(str(v) for v in values[:4]) + (", ..." if len(values) > 4 else "")
