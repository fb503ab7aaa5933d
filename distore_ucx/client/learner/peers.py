"""The learner's directory of storage nodes: how each one is read, and its liveness.

Each node a learner reads from is a peer (a `NodeReader`) of one of four kinds:

- "mapped": the node runs on this host (same `host_id()`) and handed us its
  sealed arena (transport/local_map.py); its items are copied out of a
  read-only mapping with plain loads (`_native.mapped_gather_located`).
- "ucx:<transports>": a remote key on a UCX endpoint; items are read with
  one-sided gets (`_native.gather`). Same-host nodes take this path too
  when mapping is off (`local_map=False`, `DISTORE_LOCAL_MAP=0`), when the
  node cannot share its arena, or when the learner's ring is device memory
  (gpu-direct: plain loads cannot write it).
- "ucx-am:<transports>": a node over UCX whose UCX emulates RMA (TCP) and
  that serves samples by active message (its descriptor's `am_sample` and
  `sample_port`, storage/sample_server.py): the learner sends it one
  request per batch and the node sends each item's fields straight into
  the learner's ring (`_native.AmSampleClient.fetch`, one call per batch
  for every such node). Its endpoint is made through the node's sample
  listener (`runtime.listener_endpoint`): it has peer-failure handling and
  keeps zero-copy rendezvous over TCP (native/am_connections.h). Its remote
  key, for the items a busy node refuses, is on the same endpoint (UCX
  refuses two endpoints between the same two workers whose error handling
  differs). Not for a device ring (gpu-direct), nor for a same-host node
  that UCX reaches through shared memory, nor with `DISTORE_AM_SAMPLES=0`,
  nor for a node without a sample listener (an older one) or whose
  listener cannot be reached: those are read by gets.
- "cma": a same-host node that is not mapped, when UCX may use shared
  memory: the same gather reads it with process_vm_readv, the call UCX's
  CMA transport makes. UCX cannot detect peer failures on shared memory
  (UCP_ERR_HANDLING_MODE_PEER needs an active-message transport that can,
  and sm has none) and aborts the process when a read finds the peer gone;
  our own read turns that into an error status, and the item is resampled.

A read that hangs (a stopped node over TCP) is ended by the gather, which
force-closes the endpoint after 2 s without progress (the `stall` of
`_native.gather_dense`; a fetch by active message does the same with its
own); the node is then left alone for `COOLDOWN`
s (its items read as unreachable and are resampled) while the control
plane drops it.

The directory keeps per-node lookup tables (node id -> index into the
remote keys, into the mappings, into the active-message endpoints, and the
arena base), so that one batch is split by how its items' nodes are read
with array indexing, never a loop per item.
Peers are made for every live node when the learner starts (the first
sample then costs what a warm one does) and whenever a new node id shows up.
Thread safety: one thread (the learner's sampling thread) uses a directory.
"""

from __future__ import annotations

import logging
import os
import select
import time

import numpy as np

from ..._native_loader import _native
from ...errors import ConnectionFailed, DistoreError, UcxError
from ...protocol import AM_SAMPLE_AUTH_ID
from ...transport.local_map import receive_arena
from ...transport.same_host import ProcessWatch, host_id

log = logging.getLogger(__name__)

MAPPED = "mapped"
CMA = "cma"
UCX_AM = "ucx-am"
# A node whose reads failed is not looked up again for this long: a hung node
# is dropped by the control plane within its heartbeat timeout (about 2.3 s),
# and meanwhile its items are resampled instead of waited for.
COOLDOWN = 3.0


class NodeReader:
    """A storage node as the learner reads it: mapped, or a remote key."""

    def __init__(self, runtime, desc: dict, token: bytes | None, local_map: bool,
                 host_memory: bool = True, am_samples: bool = True):
        self.node_id = desc["node_id"]
        self.name = f"node {desc['node_id']} ({desc['name']})"
        self.worker_address = desc["worker_address"]
        self.base = np.uint64(desc["arena_base"])
        self.arena_id = desc.get("arena_id", 0)
        self.mapping = None
        self.rkey = None
        self.am_endpoint = None  # samples by active message (the "ucx-am" path)
        self.listener: tuple[str, int] | None = None  # (host, port) of am_endpoint's listener
        self.why_not_am = ""  # why a node that serves samples by message is read by gets
        same_host = bool(desc.get("host_id")) and desc["host_id"] == host_id()
        # A same-host node's pid tells us at once when it dies (a dead node's
        # items are resampled; under UCX shared memory a read from a dead
        # peer would abort us, so it is checked before every batch).
        self.watch = ProcessWatch(desc["pid"]) if same_host and desc.get("pid") else None
        self.why_not_mapped = ""
        if same_host and local_map and desc.get("local_socket"):
            try:
                fd, size, _, high = receive_arena(desc["local_socket"], self.arena_id, token,
                                                  self.name)
                try:
                    self.mapping = _native.MappedArena(fd, size, self.name, high)
                finally:
                    os.close(fd)
            except (DistoreError, OSError) as exc:
                self.why_not_mapped = str(exc)
                log.warning("%s: cannot map its arena (%s); reading it over UCX", self.name, exc)
        elif same_host and not local_map:
            self.why_not_mapped = "local mapping is off"
        elif same_host:
            self.why_not_mapped = "the node does not share its arena (--no-write-protect?)"
        self.path = MAPPED
        if (self.mapping is None and same_host and host_memory and runtime.shared_memory
                and desc.get("pid")):
            self.rkey = _cma_key(runtime, desc, self.name)
            self.path = CMA
        if self.mapping is None and self.rkey is None:
            # Without shared-memory transports nothing is gained by giving up
            # peer-failure handling: keep it (a dead peer then fails reads).
            shm = same_host and runtime.shared_memory
            ep = None
            if (am_samples and host_memory and not shm and desc.get("am_sample")
                    and desc.get("sample_port")):
                ep = self._listener_endpoint(runtime, desc)
            if ep is None:
                # On the reader worker: learners' gathers progress it
                # themselves (over TCP, sharing the worker whose progress
                # thread wakes on the same sockets costs bandwidth;
                # docs/performance.md).
                ep = runtime.endpoint(self.worker_address, self.name, detect_failures=not shm,
                                      reader=True)
            self.rkey = _native.RemoteKey(
                ep, desc["rkey"], desc["arena_base"], desc["arena_size"], self.name
            )
            self.path = f"ucx:{runtime.transports}"
            if self.listener is not None:
                self.am_endpoint = ep
                self.path = f"{UCX_AM}:{runtime.transports}"

    def _listener_endpoint(self, runtime, desc: dict):
        """The endpoint to the node's sample listener (on the reader worker,
        which fetches progress), or None where it cannot be reached (the node
        is then read by gets; why_not_am says why)."""
        host = desc["address"].rpartition(":")[0].strip("[]")
        port = int(desc["sample_port"])
        try:
            ep = runtime.listener_endpoint(host, port, self.name, reader=True,
                                           cap=desc.get("am_cap"), auth_id=AM_SAMPLE_AUTH_ID)
        except ConnectionFailed as exc:
            self.why_not_am = str(exc)
            return None
        self.listener = (host, port)
        return ep

    def release(self, runtime) -> None:
        """Unmap the arena, or drop the remote key and then its endpoint."""
        self.mapping = None
        self.am_endpoint = None
        if self.rkey is not None and self.path == CMA:
            self.rkey = None
        elif self.rkey is not None:
            self.rkey = None  # the remote key goes before its endpoint
            if self.listener is not None:
                runtime.drop_listener_endpoint(*self.listener)
            else:
                runtime.drop_endpoint(self.worker_address)
        if self.watch is not None:
            self.watch.close()


class PeerDirectory:
    """Storage nodes by id, with batch lookup tables; see the module docstring.

    >>> peers = PeerDirectory(client, runtime, local_map=True)
    >>> peers.connect_all()           # warm: endpoints, keys, mappings made now
    >>> peers.paths                   # {1: "mapped", 2: "ucx:tcp", 3: "ucx-am:tcp"}
    """

    def __init__(self, client, runtime, local_map: bool, host_memory: bool = True,
                 am_samples: bool = True):
        """`host_memory`: the learner's ring is host memory (a device ring
        cannot be written by process_vm_readv: same-host nodes then use UCX;
        nor received into: nodes are then read by gets). `am_samples`: read
        nodes that serve samples by active message that way
        (config.am_samples_enabled())."""
        self._client = client
        self._runtime = runtime
        self.local_map = local_map
        self.host_memory = host_memory
        self.am_samples = am_samples
        self._peers: dict[int, NodeReader] = {}
        self.rkeys: list = []  # remote keys, indexed by key_lut
        self.mappings: list = []  # mapped arenas, indexed by map_lut
        self.am_endpoints: list = []  # endpoints of "ucx-am" nodes, indexed by am_lut
        self.key_lut = np.full(0, -1, np.int64)
        self.map_lut = np.full(0, -1, np.int64)
        self.am_lut = np.full(0, -1, np.int64)
        self.base_lut = np.zeros(0, np.uint64)
        self._logged: set[tuple[int, str]] = set()
        self._failed: dict[int, float] = {}  # node id -> when its reads failed
        # Same-host nodes' processes, for sweep(): pidfds in one poll set
        # (pidfd -> node id), and nodes whose watch reads /proc instead.
        self._watch_poll = select.poll()
        self._watched: dict[int, int] = {}
        self._watched_slow: list[int] = []

    @property
    def paths(self) -> dict[int, str]:
        """How each known node is read: node id -> "mapped", "cma",
        "ucx:<transports>" or "ucx-am:<transports>"."""
        return {node_id: peer.path for node_id, peer in self._peers.items()}

    def get(self, node_id: int) -> NodeReader | None:
        """The peer of `node_id`, if the directory knows it."""
        return self._peers.get(node_id)

    def connect_all(self) -> None:
        """Make a peer for every live node now (endpoints, remote keys and
        mappings cost a round trip each; the first sample should not pay it)."""
        try:
            descs = self._client.nodes()
        except DistoreError as exc:
            log.debug("cannot list nodes to warm up: %s", exc)
            return
        for desc in descs:
            if desc["node_id"] not in self._peers:
                self._add(desc)
        self._rebuild()

    def check(self, node_id: int) -> None:
        """Make sure the lookup tables know `node_id` (a node met for the
        first time is looked up; liveness is sweep()'s)."""
        if node_id not in self._peers:
            failed = self._failed.get(node_id)
            if failed is not None and time.monotonic() - failed < COOLDOWN:
                if node_id >= len(self.key_lut):
                    self._rebuild(node_id + 1)
                return  # its items read as unreachable: resampled, not waited for
            self._failed.pop(node_id, None)
            self._lookup(node_id)
            self.sweep()

    def sweep(self) -> None:
        """Forget same-host nodes whose process ended, once per batch before
        reading: a dead node's mapping would still read fine, but its items
        are being dropped, and under UCX shared memory a read from it would
        abort us. Mappings go even when no batch names the node any more."""
        gone = [self._watched[fd] for fd, _ in self._watch_poll.poll(0)] if self._watched else []
        gone += [node_id for node_id in self._watched_slow
                 if not self._peers[node_id].watch.alive()]
        for node_id in gone:  # one poll for all of them: any event means it ended
            self.forget(node_id, "its process is gone")

    def forget(self, node_id: int, why: str, quiet: bool = False) -> None:
        """Drop a node: unmap its arena or drop its key and endpoint. Unless
        `quiet`, it failed: it is not looked up again for COOLDOWN s."""
        peer = self._peers.pop(node_id, None)
        if peer is None:
            return
        if not quiet:
            self._failed[node_id] = time.monotonic()
            log.warning("%s: %s; dropping it and resampling its items", peer.name, why)
        self._rebuild()
        peer.release(self._runtime)

    def forget_all(self, why: str) -> None:
        """Drop every node (a new control-plane session numbers nodes anew)."""
        for node_id in list(self._peers):
            self.forget(node_id, why, quiet=True)

    def close(self) -> None:
        """Release every peer."""
        self.rkeys = []
        self.mappings = []
        self.am_endpoints = []
        for peer in self._peers.values():
            peer.release(self._runtime)
        self._peers.clear()

    # -- internals --------------------------------------------------------
    def _lookup(self, node_id: int) -> NodeReader | None:
        peer = None
        for desc in self._client.nodes():
            if desc["node_id"] == node_id:
                peer = self._add(desc)
                break
        # Sized to cover node_id even when it is gone (its items then read as
        # unreachable and are resampled).
        self._rebuild(node_id + 1)
        return peer

    def _add(self, desc: dict) -> NodeReader | None:
        try:
            peer = NodeReader(self._runtime, desc, self._client.token, self.local_map,
                              self.host_memory, self.am_samples)
        except (UcxError, DistoreError) as exc:
            log.warning("cannot reach %s: %s", desc["name"], exc)
            return None
        self._peers[peer.node_id] = peer
        if (peer.node_id, peer.path) not in self._logged:
            self._logged.add((peer.node_id, peer.path))
            log.info("%s: read path %s%s", peer.name, peer.path,
                     f" ({peer.why_not_mapped})" if peer.why_not_mapped else "")
            if peer.why_not_am:
                log.warning("%s: read by one-sided gets, not by active message: %s", peer.name,
                            peer.why_not_am)
        return peer

    def _rebuild(self, size: int | None = None) -> None:
        """node id -> index into rkeys / mappings (-1: not that kind), and base."""
        size = max(size or 0, len(self.key_lut), max(self._peers, default=0) + 1)
        rkeys, mappings, am_endpoints = [], [], []
        key_lut = np.full(size, -1, np.int64)
        map_lut = np.full(size, -1, np.int64)
        am_lut = np.full(size, -1, np.int64)
        base_lut = np.zeros(size, np.uint64)
        for peer in self._peers.values():
            if peer.mapping is not None:
                map_lut[peer.node_id] = len(mappings)
                mappings.append(peer.mapping)
            else:
                key_lut[peer.node_id] = len(rkeys)
                rkeys.append(peer.rkey)
            if peer.am_endpoint is not None:
                am_lut[peer.node_id] = len(am_endpoints)
                am_endpoints.append(peer.am_endpoint)
            base_lut[peer.node_id] = peer.base
        # Replaced whole, never changed in place: the hand-out re-check reads
        # them from another thread (client/learner/recheck.py).
        self.rkeys, self.mappings, self.am_endpoints = rkeys, mappings, am_endpoints
        self.key_lut, self.map_lut, self.am_lut, self.base_lut = key_lut, map_lut, am_lut, base_lut
        poll, watched, slow = select.poll(), {}, []
        for peer in self._peers.values():
            if peer.watch is None:
                continue
            fd = peer.watch.fileno()
            if fd is None:
                slow.append(peer.node_id)
            else:
                poll.register(fd, select.POLLIN)
                watched[fd] = peer.node_id
        self._watch_poll, self._watched, self._watched_slow = poll, watched, slow


def _cma_key(runtime, desc: dict, name: str):
    """A key that reads a same-host node with process_vm_readv, or None when
    this process may not (ptrace restrictions): then UCX is used."""
    key = _native.RemoteKey(None, desc["rkey"], desc["arena_base"], desc["arena_size"], name,
                            pid=desc["pid"])
    probe = runtime.map_region(4096)
    status = _native.gather(runtime.worker, [key], np.zeros(1, np.uint32),
                            np.array([desc["arena_base"]], np.uint64), np.full(1, 16, np.uint64),
                            probe, np.zeros(1, np.uint64), 1.0)
    if status[0] != 0:
        log.info("%s: cannot read it with process_vm_readv (%s); reading it over UCX", name,
                 _native.status_name(int(status[0])))
        return None
    return key
