"""The storage node process: `distore node --control HOST:PORT --arena 4GiB`.

Owns one arena registered with UCX for remote READ. Writers send inserts
over the control channel; the node writes them into slots, reports them to
the control plane in one message per batch and acknowledges the writer only
once the control plane has them (an acknowledged insert is sampleable).
Learners read slots one-sided; the node does nothing for a read, except over
TCP where UCX emulates RMA and the worker's event-driven progress thread
answers. The control plane tells the node which slots to free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket

import numpy as np

from ..config import NodeConfig, read_token
from ..errors import ConnectionFailed, SpecMismatch, Timeout
from ..spec import SLOT_HEADER
from ..transport import UcxRuntime
from ..transport.runtime import host_id
from ..transport.rpc import AsyncClient, parse_address, serve
from .arena import Arena

log = logging.getLogger(__name__)


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
        self.runtime: UcxRuntime | None = None
        self.arena: Arena | None = None
        self.control: AsyncClient | None = None
        self.inserted = 0
        self._stop = asyncio.Event()
        self._now = asyncio.Event()  # a second SIGTERM: skip the drain
        self._leaving = False

    async def run(self, ready_file: str | None = None) -> int:
        """Serve until SIGTERM/SIGINT or loss of the control plane; exit code."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        control_host, _ = parse_address(cfg.control)
        host = cfg.host or route_address(control_host)
        with UcxRuntime() as runtime:
            self.runtime = runtime
            self.arena = Arena(runtime, cfg.arena_bytes, cfg.hugepages, self.name,
                               write_protect=cfg.write_protect)
            token = read_token(cfg.token_file)
            server = await serve(host, cfg.port, self._handle, token=token)
            port = server.sockets[0].getsockname()[1]
            self.control = await AsyncClient.connect(
                cfg.control, "control plane", on_push=self._on_push, token=token
            )
            reply = await self.control.call(
                "register_node",
                name=self.name,
                host=host,
                port=port,
                worker_address=runtime.address,
                rkey=self.arena.region.pack_rkey(),
                arena_base=self.arena.base,
                arena_size=self.arena.size,
                pid=os.getpid(),
                host_id=host_id(),
            )
            self.node_id = reply["node_id"]
            interval = reply["heartbeat_interval"]
            log.info(
                "node %s (id %d) serving %d-byte arena%s at %s:%d over UCX %s",
                self.name,
                self.node_id,
                self.arena.size,
                " on hugepages" if self.arena.region.hugepages else "",
                host,
                port,
                runtime.transports,
            )
            if ready_file:
                _write_ready(ready_file, {"node_id": self.node_id, "address": f"{host}:{port}"})
            beat = loop.create_task(self._heartbeat(interval))
            lost = loop.create_task(self.control.closed.wait())
            stop = loop.create_task(self._stop.wait())
            await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
            code = 0
            if lost.done() and not self._stop.is_set():
                log.error("lost the control plane at %s; node %s exits", cfg.control, self.name)
                code = 3
            for t in (beat, lost, stop):
                t.cancel()
            if code == 0 and not self.control.closed.is_set():
                await self._leave()
            server.close()
            await self.control.close()
            del self.arena  # unmap before the runtime closes
            self.arena = None
        log.info("node %s stopped", self.name)
        return code

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

    async def _heartbeat(self, interval: float) -> None:
        while True:
            self.control.push("heartbeat", node_id=self.node_id, used_bytes=self.arena.used_bytes)
            await asyncio.sleep(interval)

    async def _on_push(self, op: str, fields: dict) -> None:
        if op == "free":
            self.arena.free(fields["table"], fields["offsets"])
        else:
            log.warning("ignoring unexpected push %r from the control plane", op)

    async def _handle(self, peer, op: str, f: dict):
        if op == "insert":
            return await self._insert(f)
        if op == "node_info":
            return {
                "node_id": self.node_id,
                "name": self.name,
                "arena_size": self.arena.size,
                "used_bytes": self.arena.used_bytes,
                "inserted": self.inserted,
            }
        raise ConnectionFailed(f"storage node does not serve {op!r}")

    async def _insert(self, f: dict) -> dict:
        if self._leaving:  # the writer resends to another node on this error
            raise ConnectionFailed(f"storage node {self.name} is shutting down")
        keys = f["keys"]
        k = len(keys)
        item_bytes, slot_size = f["item_bytes"], f["slot_size"]
        payload = f["payload"]
        if k == 0 or len(payload) != k * item_bytes or slot_size < SLOT_HEADER + item_bytes:
            raise SpecMismatch(
                f"insert into {f['table']!r}: {len(payload)} payload bytes for {k} items of "
                f"{item_bytes} bytes in {slot_size}-byte slots"
            )
        rows = np.frombuffer(payload, dtype=np.uint8).reshape(k, item_bytes)
        offsets = self.arena.allocate(f["table"], slot_size, k)
        try:
            gens = self.arena.write(offsets, keys, rows)
            wait = f.get("timeout", 60.0)  # a rate limiter may hold the insert
            reply = await self.control.call(
                "items_added",
                reply_timeout=wait + 10.0,
                timeout=wait,
                node_id=self.node_id,
                table=f["table"],
                keys=keys,
                offsets=offsets,
                generations=gens,
                priorities=f["priorities"],
                used_bytes=self.arena.used_bytes,
            )
        except BaseException:
            self.arena.free(f["table"], offsets)
            if self._leaving:
                raise ConnectionFailed(f"storage node {self.name} is shutting down") from None
            raise
        self.inserted += k
        return {"n": k, "evicted": reply.get("evicted", 0)}


def _write_ready(path: str, info: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, path)


def main(config: NodeConfig, ready_file: str | None = None) -> int:
    """Run a storage node in this process until stopped."""
    return asyncio.run(StorageNode(config).run(ready_file))
