"""Learner: samples batches straight into a registered buffer.

Each batch is the next reply of the learner's sample stream
(client/learner/sample_stream.py: n items in one round trip, which also
releases the previous batch's lease; the next request goes before the
current batch is read), read into one destination buffer by the gather
(gather.py), each node by its path (peers.py: a same-host mapping, active
messages over TCP, one-sided UCX gets). Each slot's header (key,
generation) comes in the same read and is checked: an item whose slot was
reused, or whose node failed mid-read, is dropped and resampled, never
returned.

Batches land on the learner's device (device.py) in a ring of `prefetch +
1` buffers mapped once (ring.py); `batch.data` holds views into one slot
(batch.py). Iterating keeps `prefetch` batches in flight on a background
thread (prefetch.py) that then does all of this learner's sampling; a
batch it read ahead keeps its leases and has its headers read again when
handed out (recheck.py): no batch handed out holds an item evicted before.
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
    """Samples batches of one table into host or GPU memory (`Client.learner`
    makes one). A closed learner raises `Closed`.

    >>> learner = client.learner("replay", batch_size=32)              # numpy
    >>> batch = learner.sample()
    >>> batch.data["obs"].shape
    (32, 4, 84, 84)
    >>> gpu = client.learner("replay", 32, device="cuda:0", prefetch=2)  # torch
    >>> for batch in gpu:        # 2 batches in flight on a background thread
    ...     train(batch.data["obs"])  # valid until the next batch is taken

    Args:
        client: The `Client` it belongs to.
        table: The table's name.
        batch_size: Items (slices, on a table of slices) a batch: 1 to 65536.
        device: "cpu", "cuda" or "cuda:N": where batches land.
        prefetch: Batches in flight while iterating (a ring of `prefetch + 1`).
        timeout: Seconds `sample()` waits for the table to have items.
        transfer_timeout: Seconds a read from a storage node may take.
        framework: "numpy" (CPU default), "torch" (GPU default; CPU: DLPack, no copy), "cupy".
        path: "auto" (the `path` attribute says which), "gpu-direct" or "host-staged".
        ring: The older spelling of the ring size: `prefetch = ring - 1`.
        beta: Importance-sampling exponent (`Batch.weights`); None: no weights.
        local_map: Read same-host nodes through a read-only mapping of their
            arena, not UCX (default True, `DISTORE_LOCAL_MAP=0`: off).
        copy_threads: Threads that copy large same-host batches (default 2 to 4).
        sample_ahead: Batches asked for in one request while `sample()` is
            called back to back (default: as fit in 256 items and 256 MiB,
            at most 8), drawn before the updates of the batches before them.
        pipeline: False: ask for each batch only when `sample()` is called,
            a round trip it waits for (docs/semantics.md, "Sampling ahead").

    Raises:
        ConfigError: An argument is invalid, or does not fit the table.
        TableNotFound: There is no table `table`.
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
        """See the class docstring."""
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
        """How each storage node is read, by node id, as "mapped" (same host,
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
        """Items dropped (slot reused, node gone, evicted since read ahead) and sampled again."""
        return self._gather.resampled

    @property
    def expired(self) -> int:
        """Batches sampled or read ahead, then dropped unused and sampled again:
        the learner paused longer than the control plane's lease_timeout less
        a quarter, so their lease might have expired. Not an error; a count
        that grows steadily means steps (or a prefetch queue) slower than the
        lease (control.lease_timeout): raise it."""
        return self._stream.expired + self._expired

    @property
    def torn(self) -> int:
        """Items whose slot was rewritten while copied (resampled)."""
        return self._gather.torn

    def sample(self, timeout: float | None = None) -> Batch:
        """The next batch. While it is read, the next batch's request is
        already with the control plane; while the learner is iterated, this
        takes the next prefetched batch instead.

        Args:
            timeout: Seconds to wait for items (None: the learner's `timeout`).

        Returns:
            A `Batch` of views into the learner's ring, valid until
            `prefetch + 1` more batches are sampled (`Batch.clone` copies).

        Raises:
            NoData: The table had too few items within `timeout`.
            RateLimiterTimeout: Its rate limiter held the sample past `timeout`.
            ConnectionFailed: Items stayed unreadable (storage nodes failing).
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
        (none with prefetch=0), each valid until the next is taken; raises as `sample`."""
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
        control plane (docs/semantics.md, "Priority updates"). Thread safe.
        The update goes at once, or with the next ones while an earlier one
        is in flight; samples this learner asks for after the call follow
        it. Keys evicted meanwhile are skipped and counted, never an error.

        Args:
            keys: The items' keys (`Batch.keys`).
            priorities: One priority a key: finite, >= 0.
            wait: Wait until everything is applied and return what
                `flush_priorities` returns (else None).

        Raises:
            ValueError: Not one priority a key, or one negative or not finite.
            DistoreError: An earlier update the control plane refused.

        >>> learner.update_priorities(batch.keys, np.abs(td_errors) + 1e-6)
        """
        ensure_open(self, "learner")
        keys, prios = checked_priorities(keys, priorities)
        if len(keys):
            self._priorities.update(keys, prios)
        return self.flush_priorities() if wait else None

    def flush_priorities(self) -> dict:
        """Wait until every priority update made so far is applied.

        Returns:
            ``{"updated": n, "missing": m}`` keys since the last flush.

        Raises:
            DistoreError: An update the control plane refused.
        """
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
