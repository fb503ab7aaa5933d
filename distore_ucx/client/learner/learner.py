"""Learner: samples batches straight into a registered buffer.

For each batch the learner takes the next reply of its sample stream
(client/learner/sample_stream.py): n items from the control plane in one round
trip, which also releases the previous batch's lease; the next batch's
request is sent before the current batch is read, and while replies carry
cold items (read from a node's disk tier first) two are kept in flight.
It then reads the items into one destination buffer (client/learner/gather.py),
each node by its path (client/learner/peers.py): same-host arenas it has
mapped in one native call; over TCP, where UCX emulates RMA, the nodes
send their items' fields into the buffer as active messages (one request
per node and batch, in another call: the default there); the rest with
one one-sided UCX get per item, from every storage node, in a third. Each
slot's header (key, generation) comes in the same read and is checked: an
item whose slot was reused, or whose node failed mid-read, is dropped and
resampled, never returned.

Batches land on the learner's device (client/learner/device.py: "cpu" or
"cuda:N"; numpy, torch or CuPy) through a ring of `prefetch + 1`
destination buffers mapped once (client/learner/ring.py). `batch.data` holds views
into one ring slot: a batch from `sample()` stays valid until `prefetch + 1`
more batches have been sampled; a batch from iterating the learner stays
valid until the next one is taken (the background thread then refills its
slot). `batch.clone()` keeps a copy (client/learner/batch.py).

Iterating (`for batch in learner`) keeps `prefetch` batches in flight on a
background thread (client/learner/prefetch.py) that then does all of this
learner's sampling: the control connection and the UCX gather are used
from one thread only. A batch it read ahead has its slot headers read again
when handed out (client/learner/recheck.py): rows whose items were evicted since
are resampled in place by the thread first, so no batch handed out holds
an item evicted before. For that, a batch read ahead keeps its leases until
it is handed out (an item evicted while leased has its slot marked by its
node; one evicted unleased would be freed with its header intact).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from ... import metrics
from ..._native_loader import _native
from ...config import am_samples_enabled
from ...errors import DistoreError, NoData, RateLimiterTimeout
from ...spec import SLOT_HEADER
from ..lifecycle import ensure_open, mark_closed
from .arguments import check_learner, check_sampling_ahead
from .batch import Batch
from .device import Device, read_settings, resolve_framework
from .gather import Gather
from .peers import PeerDirectory
from .prefetch import Prefetcher, Stopped
from .priorities import PriorityUpdates, checked_priorities
from .reader import BatchReader
from .recheck import HeaderRecheck
from .ring import Ring
from .sample_stream import SampleStream
from .slices import as_slices

log = logging.getLogger(__name__)

# The prefetch thread asks the control plane in slices this long, so that
# close() never waits long for a thread blocked on an empty table.
PREFETCH_POLL = 0.5


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
    request (default: as many as fit in 256 items and 256 MiB, at most 8; 1
    for tables whose sampling uses items up; `DISTORE_SAMPLE_AHEAD` overrides the
    default). Each request costs both processes a socket round trip; asking
    for 8 batches of 32 at once cuts that cost 8-fold. It applies only while
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
        info, self.spec, self._rows, prefetch = check_learner(client, table, batch_size, device,
                                                             prefetch, ring, beta)
        # A table of slices: a batch is batch_size slices of slice_len steps,
        # read as batch_size * slice_len rows (each slice's steps in order).
        self.slice_len = info.get("slice_len") or 0
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
        self._consuming, self.sample_ahead = check_sampling_ahead(
            info, sample_ahead, pipeline, self._rows, self.spec.slot_size)
        self.pipeline = pipeline
        self._read = SLOT_HEADER + self.spec.item_bytes
        runtime = client.runtime
        self._runtime = runtime
        self.path, copy_threads, local_map = read_settings(runtime, dev, path, copy_threads,
                                                           local_map, table)
        self._open_streams(client, pipeline and not self._consuming)
        self._prefetcher: Prefetcher | None = None
        self._held: int | None = None  # ring slot of the batch the caller holds (GPU fences)
        self._expired = 0  # batches read ahead, past their deadline when taken
        self.stats = metrics.LearnerStats()  # ds.metrics.registry() reads it
        self._map_and_connect(client, runtime, dev, copy_threads, local_map)
        self._gather = Gather(runtime, self._ring, self._peers, self._copy_pool, self._stream,
                              self.stats, self._read, self.spec.slot_size, self.slice_len)
        self._reader = BatchReader(self._ring, self._stream, self._gather, self._peers,
                                   self._rows, self.slice_len)
        self._recheck = HeaderRecheck(client, runtime, self._peers, self.spec.slot_size)
        metrics.track("learner", self)
        log.info("learner on table %r: device=%s, path=%s, framework=%s, prefetch=%d, "
                 "UCX %s, UCX_TLS=%s", table, self.device, self.path, self.framework, prefetch,
                 _native.ucx_version(), runtime.transports)

    def _open_streams(self, client, pipelined: bool) -> None:
        """The learner's control connection, its sample stream on it (the
        first request goes out now) and its priority updates."""
        self._rpc = client.connection()
        # Priority updates on a connection of their own, not waited for; each
        # sample request goes once those made before it are applied.
        self._priorities = PriorityUpdates(client.connection, self.table, self.timeout)
        # Requests and replies of the control connection: pipelining, sampling
        # ahead, cold depth and leases.
        self._stream = SampleStream(self._rpc, self.table, self._rows, self.sample_ahead,
                                    pipelined, before_request=self._priorities.settle)

    def _map_and_connect(self, client, runtime, dev: Device, copy_threads: int,
                         local_map: bool) -> None:
        """Map the ring, start the copy pool, and connect to every storage
        node now (endpoints, remote keys and mappings), not on the first
        sample; on failure, close what was made and the sample connection."""
        self._ring = self._peers = None
        try:
            self._ring = Ring(runtime, self.spec, self._rows, self.prefetch + 1, dev,
                              self.framework, self.path)
            self._copy_pool = _native.CopyPool(copy_threads - 1)
            self._peers = PeerDirectory(client, runtime, local_map,
                                        host_memory=self.path != "gpu-direct",
                                        am_samples=am_samples_enabled())
            self._peers.connect_all()
        except BaseException:
            for part in (self._peers, self._ring, self._rpc):  # the request dies with it
                if part is not None:
                    part.close()
            raise

    @property
    def paths(self) -> dict[int, str]:
        """How each storage node is read: node id -> "mapped" (same host,
        read-only mapping of its arena), "cma" (same host, process_vm_readv),
        "ucx:<transports>" (one-sided gets) or "ucx-am:<transports>" (the
        node sends the items as active messages, where UCX emulates RMA:
        over TCP)."""
        return self._peers.paths

    @property
    def requests(self) -> int:
        """Sample requests sent to the control plane."""
        return self._stream.requests

    @property
    def resampled(self) -> int:
        """Items dropped (slot reused, node gone, evicted since read ahead)
        and sampled again."""
        return self._gather.resampled

    @property
    def expired(self) -> int:
        """Batches sampled or read ahead, then dropped unused and sampled
        again because their lease might have expired: the learner paused
        longer than the control plane's lease_timeout (control.lease_timeout)
        less a quarter. Not an error; a count that grows steadily means
        steps (or a prefetch queue) slower than the lease, so raise it."""
        return self._stream.expired + self._expired

    @property
    def torn(self) -> int:
        """Items whose slot was rewritten while copied (resampled)."""
        return self._gather.torn

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
        self._ring.release(self._reader.next_slot)
        slot, batch = self._reader.read(wait, self.transfer_timeout, self.beta)
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
        reader = self._reader
        if reader.leases_may_have_expired(slot):
            # Read so long ago that its leases may have expired (the caller
            # paused longer than the control plane's lease_timeout): an item
            # evicted since may have been freed unmarked, which no re-check
            # can see. Every row is sampled and read again.
            reader.give_back_leases(slot)
            self._expired += 1
            batch = self._prefetcher.call(
                lambda: self._repair(slot, batch, self._gather.all_rows, wait),
                wait + self.transfer_timeout + 10.0)
        stale = self._recheck.retired_rows(reader.locations[slot], self.transfer_timeout)
        if len(stale):
            # Items evicted after the thread read them (their slots are
            # marked): never handed out, resampled in place by the thread.
            batch = self._prefetcher.call(lambda: self._repair(slot, batch, stale, wait),
                                          wait + self.transfer_timeout + 10.0)
        reader.give_back_leases(slot)  # re-checked: its items may go now
        return self._hand_out(slot, batch)

    def _produce(self, stopping) -> tuple[int, Batch]:
        """One batch on the prefetch thread, asking in short slices until
        `self.timeout` so that a closing learner is not kept waiting."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return self._reader.read(max(min(PREFETCH_POLL, remaining), 0.01),
                                         self.transfer_timeout, self.beta, hold=True)
            except RateLimiterTimeout:  # NoData too: keep polling in slices
                if stopping():
                    raise Stopped() from None
                if remaining <= PREFETCH_POLL:
                    raise

    def _repair(self, slot: int, batch: Batch, rows, wait: float) -> Batch:
        """On the prefetch thread: resample `rows` of a batch it read ahead
        (their items were evicted since) into the same ring slot."""
        return self._reader.repair(slot, batch, rows, wait, self.transfer_timeout, self.beta)

    def _hand_out(self, slot: int, batch: Batch) -> Batch:
        self.stats.batches += 1
        self._held = slot
        batch.data = self._ring.hand_out(slot)  # ordered after its staging copy
        if self.slice_len:
            batch = as_slices(batch, self._reader.steps[slot], self.batch_size, self.slice_len)
        return batch

    def update_priorities(self, keys, priorities, wait: bool = False) -> dict | None:
        """Set new priorities for sampled items, without waiting for the
        control plane (docs/semantics.md, "Priority updates").

        The update goes at once, or with the next ones while an earlier one
        is in flight; samples this learner asks for after the call follow
        it. An update the control plane refuses is raised by the next call
        or by `flush_priorities()`. With `wait=True` it returns, as
        `flush_priorities()`, once everything is applied: {"updated",
        "missing"} since the last flush (keys evicted meanwhile are skipped
        and counted, never an error; summed in `priority_updates_missing`).
        Thread safe.
        >>> learner.update_priorities(batch.keys, np.abs(td_errors) + 1e-6)
        """
        ensure_open(self, "learner")
        keys, prios = checked_priorities(keys, priorities)
        if len(keys):
            self._priorities.update(keys, prios)
        return self.flush_priorities() if wait else None

    def flush_priorities(self) -> dict:
        """Wait until every priority update made so far is applied; raise
        one the control plane refused, else return {"updated": keys
        updated, "missing": keys no longer in the table} since the last
        flush."""
        ensure_open(self, "learner")
        return self._priorities.flush()

    @property
    def priority_updates_missing(self) -> int:
        """Keys of priority updates that were no longer in the table
        (evicted), over the learner's life, as their replies came."""
        return self._priorities.missing_total

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
            # Batches read ahead and never handed out: their leases go too.
            self._reader.give_back_all()

    def close(self) -> None:
        """Stop the prefetch thread; release the last lease, the learner's
        buffers and remote keys."""
        mark_closed(self)
        # A prefetch thread reconnecting to a control plane that is gone (^C
        # stopped a local cluster) gives up now rather than after `timeout` s.
        self._rpc.stop_reconnecting()
        try:
            self._priorities.close()  # what was updated is applied before the learner goes
        except DistoreError as exc:
            log.warning("learner on table %r: priority updates not applied at close: %s",
                        self.table, exc)
        self._stop_prefetch()
        self._stream.release_all(self.timeout)
        self._recheck.close()
        self._peers.close()
        self._ring.close()
        self._rpc.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
