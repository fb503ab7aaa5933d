"""Learner: samples batches straight into a registered buffer, one-sided.

For each batch the learner asks the control plane for n items (one round
trip, which also releases the previous batch's lease), then makes one native
call that posts a UCX get for every item, from every storage node, into one
destination buffer. Each slot's header (key, generation) comes in the same
read and is checked: an item whose slot was reused, or whose node failed
mid-read, is dropped and resampled, never returned. The next batch's
request is sent before the current batch is read; while replies carry cold
items (read from a node's disk tier first) two are kept in flight, so the
node reads one batch while the other's reads complete (COLD_DEPTH).

Batches land on the learner's device (client/device.py: "cpu" or
"cuda:N"; numpy, torch or CuPy) through a ring of `prefetch + 1`
destination buffers mapped once (client/ring.py). `batch.data` holds views
into one ring slot: a batch from `sample()` stays valid until `prefetch + 1`
more batches have been sampled; a batch from iterating the learner stays
valid until the next one is taken (the background thread then refills its
slot). `batch.clone()` keeps a copy.

Iterating (`for batch in learner`) keeps `prefetch` batches in flight on a
background thread (client/prefetch.py) that then does all of this
learner's sampling: the control connection and the UCX gather are used
from one thread only. A batch it read ahead has its slot headers read again
when handed out: rows whose items were evicted since (their nodes mark the
slots before the evicting insert is acknowledged) are resampled in place
by the thread first, so no batch handed out holds an item evicted before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import numpy as np

from .. import metrics
from .._native_loader import _native
from ..config import local_map_default, sample_ahead_from_env
from ..errors import (
    ConfigError,
    ConnectionFailed,
    DistoreError,
    NoData,
    RateLimiterTimeout,
)
from ..protocol import ITEM_LOCATION
from ..spec import SLOT_HEADER
from ..transport import capabilities
from .batch import Batch
from .device import Device, choose_path, resolve_framework
from .lifecycle import ensure_open, mark_closed
from .peers import PeerDirectory
from .prefetch import Prefetcher, Stopped
from .ring import Ring
from .weights import importance_weights

log = logging.getLogger(__name__)

MAX_RESAMPLES = 20
# Sampling ahead (see Learner): items one control-plane request asks for at
# most by default, and whatever the caller asks.
SAMPLE_AHEAD_ITEMS = 128
MAX_SAMPLE_AHEAD_ITEMS = 4096
# ... and at most this many bytes of items by default: a request's items stay
# leased until its last batch is read, and an item evicted while leased keeps
# its slot until then (10 MB items, batches of 4: 6 batches ahead, not 8).
SAMPLE_AHEAD_BYTES = 256 << 20
# A learner samples ahead only while sample() is called back to back: gaps
# between one batch read and the next call shorter than this, twice running.
# A training step between samples is longer; then a request asks one batch,
# leases live one step, and priority updates show a batch later, as before.
AHEAD_GAP = 0.001
# Sample requests a learner keeps in flight while its replies carry cold
# items (read from a node's disk tier while the control plane holds the
# reply): the node then has the next request before it has finished the
# current one, and the disk never waits for the learner's round trip. Each
# adds one batch to the staging space a learner holds (docs/operations.md).
COLD_DEPTH = 2
# The prefetch thread asks the control plane in slices this long, so that
# close() never waits long for a thread blocked on an empty table.
PREFETCH_POLL = 0.5


def _sample_ahead(asked: int | None, batch_size: int, consuming: bool,
                  slot_bytes: int = 0) -> int:
    """Batches per control-plane request (see Learner's `sample_ahead`);
    `slot_bytes` (an item's slot) bounds the default by SAMPLE_AHEAD_BYTES."""
    if consuming:
        if asked not in (None, 1):
            raise ConfigError(
                f"sample_ahead={asked}: this table's sampling uses items up (max_times_sampled, "
                "a queue or a rate limiter), so batches cannot be sampled ahead; leave it out")
        return 1
    if asked is None:
        asked = sample_ahead_from_env()
        if asked is None:
            by_bytes = SAMPLE_AHEAD_BYTES // max(1, batch_size * slot_bytes)
            return max(1, min(8, SAMPLE_AHEAD_ITEMS // batch_size, by_bytes))
    if asked < 1 or asked * batch_size > MAX_SAMPLE_AHEAD_ITEMS:
        raise ConfigError(
            f"sample_ahead={asked} with batch_size={batch_size}: it must be at least 1 and ask "
            f"for at most {MAX_SAMPLE_AHEAD_ITEMS} items per request (1 turns it off)")
    return asked


class Learner:
    """Samples batches of one table into host or GPU memory.

    >>> learner = client.learner("replay", batch_size=32)              # numpy
    >>> batch = learner.sample()
    >>> batch.data["obs"].shape
    (32, 4, 84, 84)
    >>> gpu = client.learner("replay", 32, device="cuda:0", prefetch=2)  # torch
    >>> for batch in gpu:        # 2 batches in flight on a background thread
    ...     train(batch.data["obs"])  # valid until the next batch is taken

    Options: `prefetch` batches in flight while iterating (ring of
    `prefetch + 1` buffers; `ring=` is the older spelling of the ring size,
    `prefetch = ring - 1`); `framework` "numpy" (CPU default), "torch"
    (GPU default; CPU tensors through DLPack, no copy) or "cupy"; `path`
    "auto" (see `learner.path`) or a forced "gpu-direct" / "host-staged";
    `local_map` (default True, `DISTORE_LOCAL_MAP=0` turns it off): read
    same-host nodes through a read-only mapping of their arena instead of
    UCX (`learner.paths` says which node is read how); `copy_threads`:
    threads that copy large same-host batches (default: up to 4, at least 2);
    `sample_ahead`: batches the learner asks the control plane for in one
    request (default: as many as fit in 128 items and 256 MiB, at most 8; 1
    for tables whose sampling uses items up; `DISTORE_SAMPLE_AHEAD` overrides the
    default). Each request costs both processes a socket round trip; asking
    for 4 batches of 32 at once cuts that cost 4-fold. It applies only while
    `sample()` is called back to back (under 1 ms between a batch and the
    next call, twice running): with a training step in between, a request
    asks one batch. The price: batches sampled ahead were drawn before the
    priority updates of the batches before them (as with Reverb's in-flight
    samples); items evicted meanwhile are caught by the header check and
    resampled. `pipeline=False` asks for each batch only when `sample()` is
    called (no request in flight in between, no sampling ahead): a batch
    then reflects every insert, eviction and priority update acknowledged
    before the call, at the price of a round trip `sample()` waits for
    (distore_ucx.torchrl's buffers sample so, as TorchRL's own do).
    """

    def __init__(
        self,
        client,
        table: str,
        batch_size: int,
        device: str = "cpu",
        prefetch: int = 2,
        timeout: float = 30.0,
        transfer_timeout: float = 10.0,
        framework: str | None = None,
        path: str = "auto",
        ring: int | None = None,
        beta: float | None = None,
        local_map: bool | None = None,
        copy_threads: int | None = None,
        sample_ahead: int | None = None,
        pipeline: bool = True,
    ):
        """See the class docstring. `beta`: importance-sampling exponent for
        prioritized tables (batch.weights); None leaves weights out."""
        if beta is not None and not (np.isfinite(beta) and beta >= 0):
            raise ConfigError(f"beta must be a finite number >= 0, got {beta!r}")
        if ring is not None:
            prefetch = ring - 1
        if batch_size < 1 or prefetch < 0:
            raise ConfigError("batch_size must be positive and prefetch (ring - 1) not negative")
        dev = Device.parse(device)
        self.table = table
        self.batch_size = batch_size
        self.device = str(dev)
        self.framework = resolve_framework(dev, framework)
        self.prefetch = prefetch
        self.timeout = timeout
        self.transfer_timeout = transfer_timeout
        self._client = client
        self.beta = beta
        info = client.table_info(table)
        self.spec = client.spec(table)
        # Only tables where sampling is free are sampled ahead: with
        # max_times_sampled or a Queue a batch fetched but never used would be
        # lost, and a ratio limiter would count it before it was asked for.
        self._consuming = (
            info["max_times_sampled"] > 0 or info["rate_limiter"]["kind"] != "min_size"
        )
        if not pipeline and sample_ahead not in (None, 1):
            raise ConfigError(f"sample_ahead={sample_ahead} samples ahead, which pipeline=False "
                              "rules out: leave one of them out")
        self.pipeline = pipeline
        self.sample_ahead = _sample_ahead(sample_ahead, batch_size,
                                          self._consuming or not pipeline, self.spec.slot_size)
        self.priority_updates_missing = 0
        self._read = SLOT_HEADER + self.spec.item_bytes
        runtime = client.runtime
        self._runtime = runtime
        caps = capabilities.query(runtime.context) if dev.is_cuda else None
        self.path = choose_path(dev, caps, path)
        if copy_threads is None:
            copy_threads = max(2, min(4, os.cpu_count() or 2))
        if copy_threads < 1:
            raise ConfigError(f"copy_threads must be >= 1, got {copy_threads}")
        if local_map is None:
            local_map = local_map_default()
        if local_map and self.path == "gpu-direct":
            log.info("learner on table %r: gpu-direct ring is device memory; same-host nodes "
                     "are read over UCX", table)
            local_map = False
        self._rpc = client.connection()
        self._session = self._rpc.session  # a new one means a new control-plane connection
        self._done_leases: list[int] = []  # leases of batches already read
        # Replies received but not yet used (a resample had to wait behind
        # them); the requests still in flight are self._rpc.in_flight.
        self._received: list[dict] = []
        # Sample requests kept in flight ahead of the batch being read: one,
        # or COLD_DEPTH while replies carry cold items (set in _next_reply).
        self._depth = 1
        # Batches of a reply sampled ahead, not yet read; the last one carries
        # the reply's lease (released once every batch of it has been read).
        self._ahead: list[dict] = []
        self._fast = 0  # back-to-back samples in a row (see AHEAD_GAP), up to 2
        self._read_at: float | None = None  # when the last batch was read
        self.requests = 0  # sample requests sent to the control plane
        # The first batch's locations are asked for first (without waiting for
        # data): the control plane answers while the ring, the endpoints and
        # the mappings are made below, so the first sample() finds the reply
        # waiting. Not where sampling uses items up (see _consuming).
        self._early = False
        if pipeline and not self._consuming:
            self._prefetch(0.0)
            self._early = True
        self._next = 0
        self._prefetcher: Prefetcher | None = None
        self._held: int | None = None  # ring slot of the batch the caller holds (GPU fences)
        self._locs: list = [None] * (prefetch + 1)  # per ring slot: its items' locations
        self._min_probs: list = [None] * (prefetch + 1)  # per ring slot: each row's P_min
        self._headers = None  # where batches fetched ahead have their headers re-read
        self._header_layout = None  # their layout: headers only (made with _headers)
        self._check_keys: dict = {}  # node id -> (address, remote key) for those re-reads
        self._rows = np.arange(batch_size, dtype=np.uint64)  # rows of a ring slot's arrays
        self.resampled = 0
        self.torn = 0  # items whose slot was rewritten while copied (resampled)
        self.stats = metrics.LearnerStats()  # ds.metrics.registry() reads it
        self._ring = self._peers = None
        try:
            self._ring = Ring(runtime, self.spec, batch_size, prefetch + 1, dev,
                              self.framework, self.path)
            self._copy_pool = _native.CopyPool(copy_threads - 1)
            self._peers = PeerDirectory(client, runtime, local_map,
                                        host_memory=self.path != "gpu-direct")
            # Endpoints, remote keys and mappings now, not on the first sample.
            self._peers.connect_all()
        except BaseException:
            for part in (self._peers, self._ring, self._rpc):  # the request dies with it
                if part is not None:
                    part.close()
            raise
        metrics.track("learner", self)
        log.info("learner on table %r: device=%s, path=%s, framework=%s, prefetch=%d, "
                 "UCX %s, UCX_TLS=%s", table, self.device, self.path, self.framework, prefetch,
                 _native.ucx_version(), runtime.transports)

    @property
    def paths(self) -> dict[int, str]:
        """How each storage node is read: node id -> "mapped" (same host,
        read-only mapping of its arena), "cma" (same host, process_vm_readv)
        or "ucx:<transports>"."""
        return self._peers.paths

    def sample(self, timeout: float | None = None) -> Batch:
        """The next batch; waits up to `timeout` s for the table to have items.

        While this batch is being read, the request for the next batch's
        locations is already with the control plane, so its round trip
        overlaps the transfer. While the learner is being iterated, this
        takes the next prefetched batch instead.
        """
        ensure_open(self, "learner")
        wait = float(self.timeout if timeout is None else timeout)
        if self._prefetcher is not None:
            return self._take(wait)
        # GPU paths: the slot about to be refilled may hold a batch the
        # caller's stream still reads; fence all work enqueued so far.
        self._ring.release(self._next)
        slot, batch = self._sample(wait)
        return self._hand_out(slot, batch)

    def __iter__(self) -> Iterator[Batch]:
        """Batches forever, `prefetch` of them in flight on a background thread
        (none with prefetch=0). Each stays valid until the next is taken."""
        ensure_open(self, "learner")
        if self.prefetch == 0:
            while True:
                yield self.sample()
        if self._prefetcher is None:
            self._ring.release_all()  # batches from sample() may still be in use
            self._held = None
            self._prefetcher = Prefetcher(self._produce, self.prefetch,
                                          name=f"distore-prefetch-{self.table}")
        while True:
            yield self._take(self.timeout)

    def _take(self, wait: float) -> Batch:
        """The next batch from the prefetch thread, its errors re-raised here."""
        if self._held is not None:
            # Taking the next batch frees the held one's slot for the thread to
            # refill: fence the caller's GPU work on it first.
            self._ring.release(self._held)
            self._held = None
        t0 = time.monotonic()
        try:
            slot, batch = self._prefetcher.next(wait + self.transfer_timeout + 10.0)
            self.stats.waited(time.monotonic() - t0)  # metrics: data-wait while iterating
        except DistoreError:  # raised on the thread (NoData included): as is
            self._stop_prefetch()  # the thread has ended; the next iteration restarts it
            raise
        except TimeoutError:
            raise NoData(f"table {self.table!r}: no batch within {wait:.1f} s from the "
                         "prefetch thread; is anything inserting?") from None
        except BaseException:
            self._stop_prefetch()  # the thread has ended; the next iteration restarts it
            raise
        stale = self._retired_rows(slot)
        if len(stale):
            # Items evicted after the thread read them (their slots are
            # marked): never handed out, resampled in place by the thread.
            batch = self._prefetcher.call(lambda: self._repair(slot, batch, stale, wait),
                                          wait + self.transfer_timeout + 10.0)
        return self._hand_out(slot, batch)

    def _produce(self, stopping) -> tuple[int, Batch]:
        """One batch on the prefetch thread, asking in short slices until
        `self.timeout` so that a closing learner is not kept waiting."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return self._sample(max(min(PREFETCH_POLL, remaining), 0.01))
            except RateLimiterTimeout:  # NoData too: keep polling in slices
                if stopping():
                    raise Stopped() from None
                if remaining <= PREFETCH_POLL:
                    raise

    def _hand_out(self, slot: int, batch: Batch) -> Batch:
        self.stats.batches += 1
        self._held = slot
        batch.data = self._ring.hand_out(slot)  # ordered after its staging copy
        return batch

    def _sample(self, wait: float) -> tuple[int, Batch]:
        """Sample and read one batch into the next ring slot: (slot, batch)."""
        now = time.monotonic()
        if self._read_at is not None:
            self._fast = min(self._fast + 1, 2) if now - self._read_at < AHEAD_GAP else 0
        slot = self._next
        self._next = (self._next + 1) % len(self._ring)
        dest = self._ring.acquire(slot)
        n = self.batch_size
        keys = np.empty(n, np.uint64)
        probs = np.empty(n, np.float64)
        locs = self._locs[slot] = np.empty(n, ITEM_LOCATION)  # re-checked at hand-out
        # each row's reply's smallest probability (the weights' P_min)
        min_probs = self._min_probs[slot] = np.empty(n, np.float64)
        reply = self._next_reply(wait)
        if self.pipeline and not self._consuming and not self._ahead:
            self._top_up(wait)  # the last batch of a reply: ask for the next ones
        if self._rpc.session != self._session:
            self._new_session()
        table_size = self._read_rows(reply, np.arange(n), dest, slot, keys, probs, min_probs,
                                     locs, wait)
        self._ring.fill(slot, n)
        self._read_at = time.monotonic()
        weights = None
        if self.beta is not None:
            weights = importance_weights(probs, min_probs, self.beta)
        return slot, Batch(None, keys, probs, table_size, weights)

    def _read_rows(self, reply: dict, rows: np.ndarray, dest, slot: int, keys: np.ndarray,
                   probs: np.ndarray, min_probs: np.ndarray, locs: np.ndarray,
                   wait: float) -> int:
        """Read `reply`'s items into `rows` of ring slot `slot`, resampling
        those that fail their header check; fills keys, probabilities and
        locations of those rows. Returns the table size of the last reply."""
        n = len(rows)
        leases = []
        for attempt in range(MAX_RESAMPLES):
            if reply["lease"] is not None:  # None: not the last batch of a reply
                leases.append(reply["lease"])
            table_size = reply["table_size"]
            got = self._gather(reply, rows, dest, slot)
            items = np.frombuffer(reply["items"], ITEM_LOCATION)
            keys[rows[got]] = items["key"][got]
            locs[rows[got]] = items[got]
            probs[rows[got]] = np.frombuffer(reply["probabilities"], np.float64)[got]
            min_probs[rows[got]] = reply.get("min_probability", 0.0)
            rows = rows[~got]
            if len(rows) == 0:
                break
            self.resampled += len(rows)
            # The rows read so far are in dest: their leases, and the staged
            # copies of cold items under them, go back with the resample, so
            # a run of unreadable items never fills a node's staging area.
            self._done_leases.extend(leases)
            leases = []
            if attempt:
                time.sleep(min(0.05 * attempt, 0.5))  # let the control plane drop a dead node
            reply = self._resample(len(rows), wait)
        else:
            self._done_leases.extend(leases)
            raise ConnectionFailed(
                f"table {self.table!r}: {len(rows)} of {n} items still unreadable after "
                f"{MAX_RESAMPLES} resamples; storage nodes may be failing (see distore status)"
            )
        self._done_leases.extend(leases)  # read: released with the next request
        return table_size

    def _retired_rows(self, slot: int) -> np.ndarray:
        """Rows of the batch in ring slot `slot` whose items left the table
        since they were read (evicted while this learner held them: their
        node marked the slots, control/retirements.py), found by reading
        every slot header again in place: one native call for mapped nodes,
        one small UCX gather for the rest. A header that cannot be read
        counts as retired (the row is resampled). Runs on the consumer's
        thread while the prefetch thread reads the next batches: it only
        reads the peers' current tables (replaced, never changed in place)."""
        locs = self._locs[slot]
        n = len(locs)
        if self._headers is None:
            self._headers = self._runtime.map_region(n * 16)
            # headers only: row r's [key, generation] at r * 16, no fields
            self._header_layout = _native.BatchLayout(n, 0, np.zeros(0, np.uint64),
                                                      np.zeros(0, np.uint64),
                                                      np.zeros(0, np.uint64))
        peers = self._peers
        mappings, map_lut = peers.mappings, peers.map_lut
        rkeys, key_lut, base_lut = peers.rkeys, peers.key_lut, peers.base_lut
        rows16 = np.arange(n, dtype=np.uint64) * np.uint64(16)
        statuses = _native.mapped_gather_located(mappings, map_lut, locs.tobytes(),
                                                 self._rows[:n], self._header_layout,
                                                 self._headers, None)
        rest = np.flatnonzero(statuses == _native.STATUS_NOT_MAPPED)
        if len(rest):
            statuses[rest] = _native.STATUS_UNREACHABLE  # unless read below
            header = self._headers.view().view(np.uint64).reshape(n, 2)
            for node_id in np.unique(locs["node"][rest]).tolist():
                u = rest[locs["node"][rest] == node_id]
                worker, key = self._check_key(node_id, rkeys, key_lut)
                if key is None:
                    continue
                got = _native.gather(
                    worker, [key], np.zeros(len(u), np.uint32),
                    base_lut[node_id] + locs["offset"][u], np.full(len(u), 16, np.uint64),
                    self._headers, rows16[u], self.transfer_timeout)
                same = ((header[u, 0] == locs["key"][u])
                        & (header[u, 1] == locs["generation"][u]))
                statuses[u] = np.where((got == 0) & ~same, _native.STATUS_STALE, got)
                if (got != 0).any():
                    self._check_keys.pop(node_id, None)  # made again next time
        return np.flatnonzero(statuses != 0)

    def _check_key(self, node_id: int, rkeys: list, key_lut: np.ndarray):
        """(worker, remote key) to re-read a node's headers from the consumer's
        thread. A same-host node read with process_vm_readv: its key, on the
        reader worker (no round trip). Over UCX: a key of our own on the main
        worker's endpoint, whose connection carries no batch reads, so the
        16-byte reads do not wait behind the prefetch thread's (over TCP the
        node answers each connection in order). (None, None): unknown node."""
        peer = self._peers.get(node_id)
        if peer is None or node_id >= len(key_lut) or key_lut[node_id] < 0:
            return None, None
        if peer.path == "cma":
            return self._runtime.reader_worker, rkeys[key_lut[node_id]]
        key = self._check_keys.get(node_id)
        if key is None or key[0] != peer.worker_address:
            desc = next((d for d in self._client.nodes() if d["node_id"] == node_id), None)
            if desc is None or desc["worker_address"] != peer.worker_address:
                return None, None
            ep = self._runtime.endpoint(peer.worker_address, peer.name)
            key = (peer.worker_address, _native.RemoteKey(
                ep, desc["rkey"], desc["arena_base"], desc["arena_size"], peer.name))
            self._check_keys[node_id] = key
        return self._runtime.worker, key[1]

    def _repair(self, slot: int, batch: Batch, rows: np.ndarray, wait: float) -> Batch:
        """On the prefetch thread: resample `rows` of a batch it read ahead
        (their items were evicted since) into the same ring slot."""
        dest = self._ring.acquire(slot)
        self.resampled += len(rows)
        min_probs = self._min_probs[slot]
        batch.table_size = self._read_rows(self._resample(len(rows), wait), rows, dest, slot,
                                           batch.keys, batch.probabilities, min_probs,
                                           self._locs[slot], wait)
        self._ring.fill(slot, self.batch_size)
        if batch.weights is not None:
            batch.weights = importance_weights(batch.probabilities, min_probs, self.beta)
        return batch

    def update_priorities(self, keys, priorities) -> dict:
        """Set new priorities for sampled items, in one batched request.

        Keys that were evicted meanwhile are skipped and counted (returned as
        "missing", summed in `priority_updates_missing`), never an error.
        Thread safe: it uses the client's connection, not the learner's.
        >>> learner.update_priorities(batch.keys, np.abs(td_errors) + 1e-6)
        """
        ensure_open(self, "learner")
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        prios = np.ascontiguousarray(priorities, dtype=np.float64).reshape(-1)
        if len(keys) != len(prios):
            raise ValueError(f"{len(keys)} keys but {len(prios)} priorities")
        if not np.isfinite(prios).all() or (prios < 0).any():
            bad = prios[~(np.isfinite(prios) & (prios >= 0))][:3]
            raise ValueError(f"priorities must be finite and >= 0; got {bad.tolist()}")
        if len(keys) == 0:
            return {"updated": 0, "missing": 0}
        reply = self._client.call(
            "update_priorities", table=self.table, keys=keys, priorities=prios
        )
        self.priority_updates_missing += reply["missing"]
        return {"updated": reply["updated"], "missing": reply["missing"]}

    # -- control-plane requests (one connection, replies in order) --------
    def _sample_fields(self, n: int, wait: float) -> dict:
        self.requests += 1
        release, self._done_leases = self._done_leases, []
        fields = {"table": self.table, "n": n, "release": release, "timeout": wait}
        if n > self.batch_size:  # sampled ahead: the answer may hold fewer batches
            fields["batch"] = self.batch_size
        return fields

    def _next_reply(self, wait: float) -> dict:
        """The next batch's reply: one sampled ahead, or a new reply split
        into `sample_ahead` batches."""
        if not self._ahead:
            reply = self._new_reply(wait)
            self._depth = COLD_DEPTH if reply.get("staged", 0) else 1
            self._ahead = self._split(reply)
        return self._ahead.pop(0)

    def _split(self, reply: dict) -> list[dict]:
        """A reply of k x batch_size items as k one-batch replies, in order;
        only the last carries the lease (every batch of it must be read
        before it is released)."""
        items = reply["items"]
        n = len(items) // ITEM_LOCATION.itemsize
        if n <= self.batch_size:
            return [reply]
        probs = np.frombuffer(reply["probabilities"], np.float64)
        b, rec = self.batch_size, ITEM_LOCATION.itemsize
        parts = [dict(reply, lease=None, items=items[i * rec:(i + b) * rec],
                      probabilities=probs[i:i + b]) for i in range(0, n, b)]
        parts[-1]["lease"] = reply["lease"]
        return parts

    def _new_reply(self, wait: float) -> dict:
        if self._received:
            return self._received.pop(0)
        while self._rpc.in_flight:
            early, self._early = self._early, False
            try:
                return self._rpc.receive(wait + 10.0)
            except ConnectionFailed as exc:
                # The control plane went away with our requests (in_flight is
                # now 0), or answered this one with a failure (a node left
                # while it staged cold items) and the next is on its way:
                # take the next, or ask again (the call waits for it to come
                # back, up to the timeout).
                log.warning("table %r: %s; asking again", self.table, exc)
            except (NoData, RateLimiterTimeout):
                if not early:
                    raise
                # The request made at creation does not wait for data: this
                # one does, up to the caller's timeout.
        return self._rpc.call("sample", reply_timeout=wait + 10.0,
                              **self._sample_fields(self._ask, wait))

    @property
    def _ask(self) -> int:
        """Items one sample request asks for: sample_ahead batches while
        samples come back to back, else one."""
        return self.batch_size * (self.sample_ahead if self._fast >= 2 else 1)

    def _prefetch(self, wait: float) -> None:
        self._rpc.send("sample", **self._sample_fields(self._ask, wait))

    def _top_up(self, wait: float) -> None:
        """Send sample requests until `_depth` are in flight or received
        but unused. Cold items are read from disk by their node while the
        control plane holds the reply; with two requests in flight the node
        has the next batch's request before it has finished the current
        one's, so the disk does not wait for the learner's round trip."""
        while self._rpc.in_flight + len(self._received) < self._depth:
            self._prefetch(wait)

    def _resample(self, n: int, wait: float) -> dict:
        while self._rpc.in_flight:  # their replies come first: keep them for the next batches
            try:
                self._received.append(self._rpc.receive(wait + 10.0))
            except ConnectionFailed as exc:  # the rest went with the connection
                log.warning("table %r: %s; asking again", self.table, exc)
        return self._rpc.call("sample", reply_timeout=wait + 10.0, **self._sample_fields(n, wait))

    def _new_session(self) -> None:
        """A new control-plane connection (it restarted, or the link broke):
        leases of the old one are gone, and a control plane that started
        afresh numbers nodes anew, so look every node up again."""
        self._session = self._rpc.session
        self._done_leases = []
        self._ahead = []  # sampled under the old connection: its leases are gone
        self._received = []
        self._peers.forget_all("the control-plane connection is new")

    def _gather(self, reply: dict, rows: np.ndarray, dest, slot: int) -> np.ndarray:
        """Read the sampled items into `rows` of dest; mask of rows that are good.

        Items of mapped (same-host) nodes are copied and checked in one native
        call that takes the control plane's records as they came; the rest
        are read with UCX in another; both land each item's header in the
        ring slot's header array and each field in that field's dense array,
        and check every slot's header against the (key, generation) the
        control plane gave."""
        t0 = time.perf_counter()  # metrics: one gather
        peers = self._peers
        peers.sweep()  # a same-host node that died: unmap it now
        raw = reply["items"]
        dest_rows = self._rows[rows]
        statuses = _native.mapped_gather_located(
            peers.mappings, peers.map_lut, raw, dest_rows, self._ring.reads, dest,
            self._copy_pool)
        rest = statuses == _native.STATUS_NOT_MAPPED
        unmapped = int(np.count_nonzero(rest))
        if unmapped < len(rows):
            self.stats.fetched("mapped", len(rows) - unmapped, (len(rows) - unmapped) * self._read)
        if unmapped:
            statuses[rest] = self._gather_unmapped(np.frombuffer(raw, ITEM_LOCATION)[rest],
                                                   dest_rows[rest], rows[rest], dest, slot)
        good = statuses == 0
        if not good.all():
            self.torn += int(np.count_nonzero(statuses == _native.STATUS_TORN))
            failed = ((statuses != 0) & (statuses != _native.STATUS_TORN)
                      & (statuses != _native.STATUS_STALE))
            if failed.any():
                nodes = np.frombuffer(raw, ITEM_LOCATION)["node"]
                for node_id in np.unique(nodes[failed]):  # once per failed node
                    peers.forget(int(node_id), "reads from it failed")
        self.stats.gather.observe(time.perf_counter() - t0)
        return good

    def _gather_unmapped(self, items: np.ndarray, dest_rows: np.ndarray, rows: np.ndarray,
                         dest, slot: int) -> np.ndarray:
        """Statuses of items whose nodes are not mapped: nodes met for the
        first time are looked up (and mapped, if they can be), the rest read
        with one UCX gather and their headers checked."""
        peers = self._peers
        nodes = items["node"]
        for node_id in np.flatnonzero(np.bincount(nodes)):  # once per node, not per item
            peers.check(int(node_id))  # known ones cost a dict look-up
        statuses = _native.mapped_gather_located(  # a node just met may be mapped now
            peers.mappings, peers.map_lut, items.tobytes(), dest_rows, self._ring.reads, dest,
            self._copy_pool)
        index = peers.key_lut[nodes]
        u = (statuses == _native.STATUS_NOT_MAPPED) & (index >= 0)
        statuses[statuses == _native.STATUS_NOT_MAPPED] = _native.STATUS_UNREACHABLE  # gone
        if u.any():
            k = int(u.sum())
            got = _native.gather_dense(
                self._runtime.reader_worker, peers.rkeys, index[u].astype(np.uint32),
                peers.base_lut[nodes[u]] + items["offset"][u], dest_rows[u], self._ring.reads,
                dest, self._ring.staging(), self.transfer_timeout,
            )
            self.stats.fetched("ucx", k, k * self._read)
            header = self._ring.headers(slot)[rows[u]]  # (k, 2): key, generation
            same = (header[:, 0] == items["key"][u]) & (header[:, 1] == items["generation"][u])
            statuses[u] = np.where((got == 0) & ~same, _native.STATUS_STALE, got)
        return statuses

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        """Stop the prefetch thread; release the last lease, the learner's
        buffers and remote keys."""
        mark_closed(self)
        # A prefetch thread reconnecting to a control plane that is gone (^C
        # stopped a local cluster) gives up now rather than after `timeout` s.
        self._rpc.stop_reconnecting()
        self._stop_prefetch()
        try:
            if not self._rpc.connected:
                # Lost with the control plane: its leases are gone or will
                # expire; do not wait for it to come back just to say so.
                self._received, self._done_leases, self._ahead = [], [], []
            self._done_leases.extend(r["lease"] for r in self._ahead if r["lease"] is not None)
            self._ahead = []
            while self._rpc.in_flight:
                try:
                    self._received.append(self._rpc.receive(self.timeout + 10.0))
                except (NoData, RateLimiterTimeout):
                    pass  # that request was answered without a lease
            self._done_leases.extend(r["lease"] for r in self._received)
            self._received = []
            if self._done_leases:
                self._rpc.call("release", leases=self._done_leases)
        except DistoreError:
            pass  # the leases will expire
        self._done_leases = []
        self._headers = None
        self._check_keys = {}
        self._peers.close()
        self._ring.close()
        self._rpc.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
