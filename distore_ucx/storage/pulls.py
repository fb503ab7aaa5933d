"""Where a storage node pulls inserts from: each writer's staging buffers.

A writer stages a batch in memory registered with UCX (remote READ only,
write-protected) and sends the node a descriptor; the node reads the items
one-sided, straight into its arena slots (storage/arena.py `Arena.pull`).
A `Source` is one staging buffer as the node reads it:

- mapped, from a same-host writer that handed the node the sealed memfd
  behind its buffer (transport/local_map.py, `send_staging`): the node maps
  it read-only once and copies each batch with plain loads
  (`_native.pull_mapped`): no system call or page pinning per item, and a
  writer that dies leaves the mapping readable, so it cannot fault the node.
  The writer names the buffer in its descriptors by the random ticket it
  handed it under; the first connection to name a ticket claims it;
- through UCX: an endpoint to the writer's worker (with peer-failure
  handling, so a writer that dies mid-read fails the read instead of
  hanging it) and the buffer's remote key unpacked on it;
- from a same-host writer when UCX may use shared memory: the writer's
  process, read with process_vm_readv. That is what UCX's CMA transport does
  underneath, but UCX has no peer-failure handling on shared memory and
  aborts the reading process when the peer died (seen with UCX 1.21): a
  storage node must outlive any writer. The writer's pid is trusted only
  once it is shown to own the writer's control connection.

- through UCX active messages (`am_inserts`; on by default where UCX
  emulates RMA, DISTORE_AM_INSERTS=0 turns it off): the writer connects
  to the node's insert listener (storage/puller.py, native/am_connections.h;
  the node advertises its port as `insert_port`) and posts each staged
  item as a rendezvous message, headed by a random batch token that its
  descriptor names, and the node receives each straight into its slot
  (`_native.pull_am`); items that fit several to a megabyte go as runs
  (several to a message, if the node advertises `insert_run_bytes`;
  DISTORE_AM_INSERT_RUNS=0 turns them off), received into a bounce chunk
  and copied into their slots. Made through a listener, the writer's
  endpoint has peer-failure handling and still sends zero-copy: a writer that dies
  mid-batch fails the node's receives (its slots are freed) instead of
  leaving them under way or crashing the node. Where UCX emulates RMA in
  software (TCP), a get is a request message answered with the bytes
  copied into bounce buffers on both sides; a rendezvous with the
  `put_zcopy` scheme sends them from the staging buffer and receives them
  into the slot with no copy of UCX's own (docs/performance.md has
  ucx_perftest's figures for both on TCP loopback). Where UCX has RDMA, the
  node keeps reading with one-sided gets (nothing is copied there either,
  and the writer's buffer stays remote-READ only, the node's slots
  unexposed).

Sources are cached per control connection, keyed by (worker address, remote
key) or ticket, and dropped with it. Thread safety: used from the node's
event loop, except `offer`, which the map socket's thread calls (under a
lock); a Source is immutable and may be handed to the pull thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .._native_loader import _native
from ..config import am_inserts_enabled
from ..errors import ConfigError, ConnectionFailed, InvalidArgument, UcxError
from ..transport.runtime import host_id

log = logging.getLogger(__name__)

MAX_SOURCES = 64  # cached staging buffers per writer connection
MAX_MAPPED = 4  # of which mapped (a writer uses one buffer per connection)
MAX_OFFERED = 1024  # handed-over buffers not yet claimed (hundreds of writers start at once)
# Seconds between sweeps of handed-over buffers whose writer exited unclaimed.
SWEEP_EVERY = 5.0


@dataclass(frozen=True)
class Source:
    """One writer staging buffer, ready to be read."""

    name: str  # the writer, for messages
    via: str  # "cma" or "ucx"
    base: int  # address of the staging buffer in the writer
    size: int
    worker: object | None = None  # our UCX worker (ucx)
    rkey: object | None = None  # _native.RemoteKey (ucx)
    pid: int = 0  # the writer's pid (cma)
    mapping: object | None = None  # _native.StagingMap (mapped)


class Sources:
    """The node's cache of writers' staging buffers, per connection."""

    def __init__(self, runtime, name: str = "node"):
        self.runtime = runtime
        self.name = name
        self._users: dict[bytes, int] = {}  # worker address -> connections using it
        self._offered: OrderedDict[bytes, tuple] = OrderedDict()  # ticket -> (map, pid)
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def offer(self, fd: int, size: int, ticket: bytes, pid: int) -> str:
        """A same-host writer (process `pid`) handed us its staging buffer's
        memfd: map it read-only, to be claimed by the descriptor naming
        `ticket`. Returns "" or why it was refused. Called from the map
        socket's thread; the caller closes `fd`."""
        name = f"writer pid {pid}"
        try:
            mapping = _native.StagingMap(fd, size, name)
        except UcxError as exc:
            log.warning("node %s: refused a staging buffer from %s: %s", self.name, name, exc)
            return str(exc)
        with self._lock:
            self._offered[ticket] = (mapping, pid)
            while len(self._offered) > MAX_OFFERED:
                self._offered.popitem(last=False)
        return ""

    def forget_departed(self) -> int:
        """Unmap handed-over buffers, never claimed, whose writer has exited
        (a writer hands same-host nodes its first buffer when it is made, and
        may never send to one of them): their pages are freed rather than
        held until MAX_OFFERED newer ones push them out. At most every
        SWEEP_EVERY s (call it often: the node's tick does); returns how many
        were unmapped."""
        now = time.monotonic()
        if now - self._swept < SWEEP_EVERY:
            return 0
        self._swept = now
        with self._lock:
            pids = {pid for _, pid in self._offered.values()}
        gone = {pid for pid in pids if not _alive(pid)}
        if not gone:
            return 0
        with self._lock:
            stale = [t for t, (_, pid) in self._offered.items() if pid in gone]
            for ticket in stale:
                del self._offered[ticket]
        log.debug("node %s: unmapped %d staging buffers of %d exited writers, never claimed",
                  self.name, len(stale), len(gone))
        return len(stale)

    def _claim(self, ticket: bytes, f: dict, peer) -> Source:
        with self._lock:
            offered = self._offered.pop(ticket, None)
        if offered is None:
            raise InvalidArgument(
                f"storage node {self.name}: the insert names staging buffer "
                f"{ticket.hex()[:8]}..., which the writer at {peer.address} never handed to "
                "this node (or another connection already uses it); hand it over again")
        mapping, pid = offered
        if f["size"] > mapping.size:
            raise InvalidArgument(
                f"storage node {self.name}: the insert claims a {f['size']}-byte staging "
                f"buffer, the writer handed a {mapping.size}-byte one")
        return Source(f"writer at {peer.address} (pid {pid})", "mapped (same host)", f["base"],
                      mapping.size, mapping=mapping, pid=pid)

    def get(self, peer, f: dict) -> Source:
        """The Source an insert descriptor names (cached on `peer`)."""
        cache = peer.state.get("sources")
        if cache is None:
            cache = peer.state["sources"] = OrderedDict()
            peer.state["worker_addresses"] = set()
        ticket = f.get("staging")
        if ticket:
            src = cache.get(ticket)
            if src is None:
                src = cache[ticket] = self._claim(ticket, f, peer)
                mapped = [k for k, v in cache.items() if v.mapping is not None]
                for old in mapped[: max(0, len(mapped) - MAX_MAPPED)]:
                    del cache[old]  # unmapped once no pull holds it
            cache.move_to_end(ticket)
            return src
        if f.get("am_token"):
            src = cache.get("am")
            if src is None:
                src = cache["am"] = Source(
                    f"writer at {peer.address}" + (f" (pid {f['pid']})" if f.get("pid") else ""),
                    f"ucx active messages (UCX_TLS={self.runtime.transports})", f["base"],
                    f["size"])
            return src
        key = (f["worker_address"], f["rkey"], f["base"], f["size"])
        src = cache.get(key)
        if src is not None:
            cache.move_to_end(key)
            return src
        src = self._make(peer, f)
        cache[key] = src
        if len(cache) > MAX_SOURCES:
            cache.popitem(last=False)
        return src

    def drop(self, peer) -> None:
        """The writer's connection closed: forget its buffers, and its endpoint
        once no other connection of that writer uses it."""
        cache = peer.state.pop("sources", None)
        if cache is not None:
            cache.clear()
        for address in peer.state.pop("worker_addresses", ()):
            self._users[address] -= 1
            if self._users[address] == 0:
                del self._users[address]
                self.runtime.drop_endpoint(address)

    def _make(self, peer, f: dict) -> Source:
        name = f"writer at {peer.address}" + (f" (pid {f['pid']})" if f.get("pid") else "")
        base, size = f["base"], f["size"]
        if base + size > 2**64:
            raise ConnectionFailed(f"{name}: staging buffer [{base}, +{size}) wraps around")
        same_host = bool(f.get("host_id")) and f["host_id"] == host_id()
        if same_host and f.get("pid") and self.runtime.shared_memory:
            if peer.state.get("verified_pid") == f["pid"] or _owns_connection(f["pid"], peer):
                peer.state["verified_pid"] = f["pid"]
                return Source(name, "cma (same host)", base, size, pid=f["pid"])
            log.warning("%s: pid %d does not own its connection; reading through UCX", name,
                        f["pid"])
        if not self.runtime.peer_failure_detection:
            raise ConfigError(
                f"storage node cannot read inserts from {name} safely: UCX_TLS="
                f"{self.runtime.transports} has no peer-failure handling, and a read from a "
                "writer that died would abort the node. Run writers on the node's host (same "
                "pid namespace), or allow a transport with failure handling (e.g. tcp)"
            )
        address = f["worker_address"]
        # On the reader worker: only the node's pull thread progresses it.
        ep = self.runtime.endpoint(address, name, detect_failures=True, reader=True)
        rkey = _native.RemoteKey(ep, f["rkey"], base, size, name)
        if address not in peer.state["worker_addresses"]:
            peer.state["worker_addresses"].add(address)
            self._users[address] = self._users.get(address, 0) + 1
        return Source(name, f"ucx (UCX_TLS={self.runtime.transports})", base, size,
                      worker=self.runtime.reader_worker, rkey=rkey)


def am_inserts(rdma: bool) -> str:
    """Whether a node whose UCX has (`rdma`) or lacks an RDMA transport takes
    inserts as UCX active messages: "" if so, else why not. Not with RDMA:
    there a one-sided get reads the writer's buffer with no copy, and keeps
    it remote-READ only (a rendezvous could expose the node's slots to the
    writer's writes). Not with `DISTORE_AM_INSERTS=0` (am_inserts_enabled)."""
    if not am_inserts_enabled():
        return "DISTORE_AM_INSERTS=0 turns active-message inserts off"
    if rdma:
        return "UCX has an RDMA transport, where a get copies nothing"
    return ""


def _alive(pid: int) -> bool:
    """Whether process `pid` (of this host and pid namespace) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


def _owns_connection(pid: int, peer) -> bool:
    """Whether process `pid` holds the far end of `peer`'s TCP connection
    (same host, IPv4): the writer's claimed pid is then its own."""
    sock = peer.writer.get_extra_info("socket")
    far = peer.writer.get_extra_info("peername")
    if sock is None or far is None or sock.family != socket.AF_INET:
        return False
    near = sock.getsockname()

    def hexaddr(addr) -> str:
        return socket.inet_aton(addr[0])[::-1].hex().upper() + f":{addr[1]:04X}"

    want_local, want_remote = hexaddr(far), hexaddr(near)
    inode = None
    try:
        with open("/proc/net/tcp") as fh:
            next(fh)
            for line in fh:
                cols = line.split()
                if cols[1] == want_local and cols[2] == want_remote:
                    inode = cols[9]
                    break
        if inode is None:
            return False
        target = f"socket:[{inode}]"
        fd_dir = f"/proc/{pid}/fd"
        return any(_readlink(os.path.join(fd_dir, fd)) == target for fd in os.listdir(fd_dir))
    except OSError:
        return False


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
