"""A storage node serving samples by UCX active message (native/am_sample.h).

Where UCX has no RDMA transport (TCP), a one-sided get is emulated: UCX
copies the bytes through bounce buffers on both sides and the node's
progress thread does the work. There a learner instead sends the node one
small request per batch (each item's slot offset and the row it goes to)
and the node sends each field of each item (of a run of items bound for
consecutive rows, up to a 1 MiB chunk of them copied together) as an
active message whose rendezvous (`UCX_RNDV_SCHEME=put_zcopy`, set on the node's runtime by
config.rendezvous_config) puts the bytes from the arena straight into the
learner's registered ring. The handler runs on the progress thread of the
node's worker, the one whose address learners are given. Learners connect
to a UCX listener on that worker, on the node's host (the address of its
RPC server) and a port of its own: an endpoint made through a listener
keeps zero-copy rendezvous over TCP with peer-failure handling
(native/am_connections.h), so a learner that dies mid-batch fails the
node's sends, and a learner whose node stops answering can force-close its
endpoint. The node advertises both (register_node's `am_sample` and
`sample_port`); learners check every item's slot header against the (key,
generation) they asked for, as after a get.

With an RDMA transport nothing is made: a learner's get then reads the
arena with no copy and no work on the node.

A learner that dies mid-batch fails the node's sends; a batch whose sends
make no progress for `STALL` s is given up (its state freed whenever UCX
ends them): `check`, called each second, closes the connections of
learners that went away, reads the counters (which is what gives stalled
batches up) and logs what went wrong since the last look.
"""

from __future__ import annotations

import asyncio
import logging

from .._native_loader import _native
from ..errors import DistoreError
from ..protocol import AM_SAMPLE_DATA_ID, AM_SAMPLE_REQUEST_ID
from ..transport import capabilities

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 16  # messages of one batch in flight at a time
MAX_BATCHES = 256  # batches served at a time; more are refused (the learner reads by gets)
STALL = 10.0  # s without progress after which a batch's sends are given up
CLOSE_TIMEOUT = 5.0  # s that closing waits for batches still being sent
MAX_CONNECTIONS = 4096  # learners' connections at once; more are refused (they read by gets)
# Runs: a field of consecutive items of a batch (up to 64, as many as fit a
# chunk) is copied into a chunk and sent as one message. Over TCP each
# rendezvous costs both sides a handshake and system calls: 110 KB items
# move faster and cheaper in ~1 MiB messages (docs/performance.md). The
# region is touched only as chunks are used.
RUN_CHUNK_BYTES = 1 << 20
RUN_CHUNKS = 32
REAP_TIMEOUT = 0.2  # s each close of a dead learner's connection may progress the worker

# Counters whose increase is worth a log line: (stats key, what it means).
_TROUBLE = (
    ("batches_failed", "batch(es) failed (a learner went away mid-batch)"),
    ("abandoned", "batch(es) given up after making no progress"),
    ("stuck", "of those still held by UCX"),
)
# ... and of peers refused: (stats key, what it means).
_REFUSED = (
    ("connections_unauthenticated", "connection(s) closed without authenticating"),
    ("unauthorized", "request(s) dropped: no authenticated connection, or items without "
     "the control plane's grant"),
)


def why_not(runtime, enabled: bool) -> str:
    """Why a node on `runtime` does not serve samples by active message, or ""
    if it does: not with an RDMA transport (a get there copies nothing), not
    when switched off (`enabled`: config.am_samples_enabled())."""
    if not enabled:
        return "switched off (DISTORE_AM_SAMPLES=0)"
    if capabilities.query(runtime.context).rdma:
        return "UCX has an RDMA transport, where a learner's get copies nothing"
    return ""


class SampleServer:
    """The node's AmSampleServer, its counters and their log lines.

    >>> server = SampleServer.start(runtime, arena, "node-a", "10.0.0.5", enabled=True)
    >>> server.port                 # register_node's sample_port (None: gets only)
    >>> server.check()              # once a second (storage/guard.py's watch)
    >>> await server.close()        # before the arena and the runtime go
    """

    def __init__(self, native, name: str, port: int):
        self._native = native
        self.name = name
        self.port = port  # of the listener learners connect to
        self.stats: dict[str, int] = self._read()  # as of the last check

    @classmethod
    def start(cls, runtime, arena, name: str, host: str, enabled: bool,
              key: bytes) -> SampleServer | None:
        """Serve samples from `arena` (storage/arena.py) on `runtime.worker`
        to learners that connect to its listener on `host` (the address the
        node's RPC server binds), on a free port; or None where learners
        read by gets (why_not says why, or UCX cannot listen there: logged).
        `key` (the node's, 16 bytes): a connection must prove the capability
        the control plane derives from it, and each request carry its grants
        (native/am_grant.h); others are served nothing."""
        why = why_not(runtime, enabled)
        if why:
            log.info("node %s: learners on other hosts read it with one-sided gets: %s",
                     name, why)
            return None
        bounce = runtime.map_region(RUN_CHUNKS * RUN_CHUNK_BYTES)
        native = _native.AmSampleServer(
            runtime.worker, arena.region, request_id=AM_SAMPLE_REQUEST_ID,
            data_id=AM_SAMPLE_DATA_ID, endpoints="reply", max_in_flight=MAX_IN_FLIGHT,
            max_batches=MAX_BATCHES, stall=STALL, bounce=bounce, chunk_bytes=RUN_CHUNK_BYTES)
        try:
            port = native.listen(host, 0, MAX_CONNECTIONS, key)
        except DistoreError as exc:  # e.g. UCX has no connection manager for this address
            native.close(CLOSE_TIMEOUT)
            log.warning("node %s: cannot listen for learners' sample connections on %s (%s); "
                        "learners on other hosts read it with one-sided gets", name, host, exc)
            return None
        except BaseException:
            native.close(CLOSE_TIMEOUT)
            raise
        log.info("node %s: serves samples by UCX active message on %s:%d (rendezvous into "
                 "the learner's ring: UCX emulates RMA here)", name, host, port)
        return cls(native, name, port)

    def _read(self) -> dict[str, int]:
        """The native counters (reading them gives up stalled batches), and
        the learners' connections open now and failed so far."""
        stats = dict(self._native.stats)
        conns = self._native.connections
        stats["connections"] = conns["open"]
        stats["connections_failed"] = conns["failed"]
        stats["connections_unauthenticated"] = conns["unauthenticated"]
        return stats

    def check(self) -> None:
        """Close the connections of learners that went away, read the
        counters (which gives up stalled batches) and log the failures since
        the last check."""
        self._native.reap(REAP_TIMEOUT)
        now = self._read()
        new = [(now[k] - self.stats.get(k, 0), what) for k, what in _TROUBLE]
        refused = [(now[k] - self.stats.get(k, 0), what) for k, what in _REFUSED]
        self.stats = now
        if any(n > 0 for n, _ in new[:2]):
            log.warning("node %s, samples by active message: %s; the node serves on", self.name,
                        ", ".join(f"{n} {what}" for n, what in new if n > 0))
        if any(n > 0 for n, _ in refused):
            log.warning("node %s, sample listener: %s (a peer without the store's token, or "
                        "of another version?); the node serves on", self.name,
                        ", ".join(f"{n} {what}" for n, what in refused if n > 0))

    async def close(self) -> None:
        """Stop serving and wait up to CLOSE_TIMEOUT s for batches being sent."""
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(None, self._native.close, CLOSE_TIMEOUT)
        if not done:
            log.debug("node %s: sample batches still being sent after %g s; the arena stays "
                      "mapped until the process exits", self.name, CLOSE_TIMEOUT)
        self.stats = self._read()
