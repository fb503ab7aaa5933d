"""Learner: samples batches straight into a registered buffer, one-sided.

For each batch the learner asks the control plane for n items (one round
trip, which also releases the previous batch's lease), then makes one native
call that posts a UCX get for every item, from every storage node, into one
destination buffer. Each slot's header (key, generation) comes in the same
read and is checked: an item whose slot was reused, or whose node failed
mid-read, is dropped and resampled, never returned.

Batches are views into a ring of `ring` destination buffers: a batch stays
valid until `ring` more batches have been sampled (default: the next one
may be sampled while you use this one). `batch.clone()` keeps a copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native_loader import _native
from ..errors import ConfigError, ConnectionFailed, DistoreError, UcxError
from ..protocol import ITEM_LOCATION
from ..spec import SLOT_HEADER
from ..transport.runtime import ProcessWatch, host_id

log = logging.getLogger(__name__)

MAX_RESAMPLES = 20


@dataclass
class Batch:
    """A sampled batch.

    data: {field: array [n, ...]} (or one array for an unnamed spec), views
    into the learner's buffer; keys: uint64 [n]; probabilities: float64 [n],
    each item's probability when it was sampled; table_size: the table's
    size at sampling time; weights: importance weights
    (N * P(i))^-beta / max_j w_j when the learner was given `beta`, else None.
    """

    data: Any
    keys: np.ndarray
    probabilities: np.ndarray
    table_size: int
    weights: np.ndarray | None = None

    def clone(self) -> "Batch":
        """A copy that stays valid after the learner reuses its buffer."""
        if isinstance(self.data, dict):
            data = {k: v.copy() for k, v in self.data.items()}
        else:
            data = self.data.copy()
        weights = None if self.weights is None else self.weights.copy()
        return Batch(data, self.keys.copy(), self.probabilities.copy(), self.table_size, weights)

    def __len__(self) -> int:
        return len(self.keys)


class _Peer:
    """A storage node as the learner reads it: remote key on an endpoint."""

    def __init__(self, runtime, desc: dict):
        self.node_id = desc["node_id"]
        self.name = f"node {desc['node_id']} ({desc['name']})"
        self.worker_address = desc["worker_address"]
        self.base = np.uint64(desc["arena_base"])
        # Same host and pid namespace: read through shared memory (CMA), where
        # UCX has no peer-failure handling and aborts a reader whose peer died;
        # the node's pid is checked before every batch of reads instead.
        same_host = bool(desc.get("host_id")) and desc["host_id"] == host_id()
        self.watch = ProcessWatch(desc["pid"]) if same_host and desc.get("pid") else None
        ep = runtime.endpoint(self.worker_address, self.name, detect_failures=not same_host)
        self.rkey = _native.RemoteKey(
            ep, desc["rkey"], desc["arena_base"], desc["arena_size"], self.name
        )


class Learner:
    """Samples batches of one table into host memory (device="cpu").

    >>> learner = client.learner("replay", batch_size=32)
    >>> batch = learner.sample()
    >>> batch.data["obs"].shape
    (32, 4, 84, 84)
    """

    def __init__(
        self,
        client,
        table: str,
        batch_size: int,
        device: str = "cpu",
        ring: int = 2,
        timeout: float = 30.0,
        transfer_timeout: float = 10.0,
        beta: float | None = None,
    ):
        """See Client.learner. `beta`: importance-sampling exponent for
        prioritized tables (batch.weights); None leaves weights out."""
        if beta is not None and not (np.isfinite(beta) and beta >= 0):
            raise ConfigError(f"beta must be a finite number >= 0, got {beta!r}")
        if device != "cpu":
            raise ConfigError(
                f"device {device!r}: this version samples into host memory only (device='cpu')"
            )
        if batch_size < 1 or ring < 1:
            raise ConfigError("batch_size and ring must be positive")
        self.table = table
        self.batch_size = batch_size
        self.device = device
        self.path = "host"
        self.timeout = timeout
        self.transfer_timeout = transfer_timeout
        self._client = client
        self._rpc = client.connection()
        self.beta = beta
        info = client.table_info(table)
        self.spec = client.spec(table)
        # Only tables where sampling is free are sampled ahead: with
        # max_times_sampled or a Queue a batch fetched but never used would be
        # lost, and a ratio limiter would count it before it was asked for.
        self._consuming = (
            info["max_times_sampled"] > 0 or info["rate_limiter"]["kind"] != "min_size"
        )
        self.priority_updates_missing = 0
        self._slot = self.spec.slot_size
        self._read = SLOT_HEADER + self.spec.item_bytes
        runtime = client.runtime
        self._runtime = runtime
        self._ring = [runtime.map_region(batch_size * self._slot) for _ in range(ring)]
        self._ring_views = [r.view() for r in self._ring]
        self._next = 0
        self._peers: dict[int, _Peer] = {}
        self._rkeys: list = []
        self._key_lut = np.full(0, -1, np.int64)
        self._base_lut = np.zeros(0, np.uint64)
        self._lengths = np.full(batch_size, self._read, np.uint64)
        # Per ring buffer: a (batch, 2) uint64 view of every slot's header.
        self._headers = {
            r.address: np.ndarray((batch_size, 2), np.uint64, buffer=v, strides=(self._slot, 8))
            for r, v in zip(self._ring, self._ring_views)
        }
        self._done_leases: list[int] = []  # leases of batches already read
        self._outstanding = False  # a request for the next batch is in flight
        self._prefetched: dict | None = None  # its reply, if already received
        self._rows = np.arange(batch_size, dtype=np.uint64) * np.uint64(self._slot)
        self.resampled = 0
        log.info("learner on table %r: path=%s, UCX %s, UCX_TLS=%s", table, self.path,
                 _native.ucx_version(), runtime.transports)

    def sample(self, timeout: float | None = None) -> Batch:
        """The next batch; waits up to `timeout` s for the table to have items.

        While this batch is being read, the request for the next batch's
        locations is already with the control plane, so its round trip
        overlaps the transfer.
        """
        wait = float(self.timeout if timeout is None else timeout)
        slot = self._next
        self._next = (self._next + 1) % len(self._ring)
        dest, view = self._ring[slot], self._ring_views[slot]
        n = self.batch_size
        keys = np.empty(n, np.uint64)
        probs = np.empty(n, np.float64)
        rows = np.arange(n)
        reply = self._next_reply(wait)
        if not self._consuming:
            self._prefetch(wait)
        leases = []
        for attempt in range(MAX_RESAMPLES):
            leases.append(reply["lease"])
            table_size = reply["table_size"]
            got = self._gather(reply, rows, dest, view)
            keys[rows[got]] = np.frombuffer(reply["items"], ITEM_LOCATION)["key"][got]
            probs[rows[got]] = np.frombuffer(reply["probabilities"], np.float64)[got]
            rows = rows[~got]
            if len(rows) == 0:
                break
            self.resampled += len(rows)
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
        data = self.spec.views(view, n, self._slot)
        weights = None
        if self.beta is not None:
            w = (table_size * probs) ** -self.beta
            weights = w / w.max()
        return Batch(data, keys, probs, table_size, weights)

    def update_priorities(self, keys, priorities) -> dict:
        """Set new priorities for sampled items, in one batched request.

        Keys that were evicted meanwhile are skipped and counted (returned as
        "missing", summed in `priority_updates_missing`), never an error.
        >>> learner.update_priorities(batch.keys, np.abs(td_errors) + 1e-6)
        """
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
        release, self._done_leases = self._done_leases, []
        return {"table": self.table, "n": n, "release": release, "timeout": wait}

    def _next_reply(self, wait: float) -> dict:
        if self._prefetched is not None:
            reply, self._prefetched = self._prefetched, None
            return reply
        if self._outstanding:
            self._outstanding = False
            return self._rpc.receive(wait + 10.0)
        return self._rpc.call("sample", reply_timeout=wait + 10.0,
                              **self._sample_fields(self.batch_size, wait))

    def _prefetch(self, wait: float) -> None:
        self._rpc.send("sample", **self._sample_fields(self.batch_size, wait))
        self._outstanding = True

    def _resample(self, n: int, wait: float) -> dict:
        if self._outstanding:  # its reply comes first: keep it for the next batch
            self._outstanding = False
            self._prefetched = self._rpc.receive(wait + 10.0)
        return self._rpc.call("sample", reply_timeout=wait + 10.0, **self._sample_fields(n, wait))

    def _gather(self, reply: dict, rows: np.ndarray, dest, view) -> np.ndarray:
        """Read the sampled items into `rows` of dest; mask of rows that are good."""
        items = np.frombuffer(reply["items"], ITEM_LOCATION)
        nodes, offsets = items["node"], items["offset"]
        gens, keys = items["generation"], items["key"]
        for node_id in np.flatnonzero(np.bincount(nodes)):  # once per node, not per item
            self._check_peer(int(node_id))
        index = self._key_lut[nodes]
        known = index >= 0
        n = len(rows)
        if known.all():
            statuses = _native.gather(
                self._runtime.worker, self._rkeys, index.astype(np.uint32),
                self._base_lut[nodes] + offsets, self._lengths[:n], dest, self._rows[rows],
                self.transfer_timeout,
            )
        else:
            statuses = np.full(n, -6, np.int32)  # UCS_ERR_UNREACHABLE: node gone
            if known.any():
                statuses[known] = _native.gather(
                    self._runtime.worker, self._rkeys, index[known].astype(np.uint32),
                    self._base_lut[nodes[known]] + offsets[known],
                    self._lengths[: int(known.sum())], dest, self._rows[rows[known]],
                    self.transfer_timeout,
                )
        header = self._headers[dest.address][rows]  # (n, 2): key, generation
        good = (statuses == 0) & (header[:, 0] == keys) & (header[:, 1] == gens)
        if not good.all():
            for node_id in np.unique(nodes[statuses != 0]):  # once per failed node
                self._forget(int(node_id), "reads from it failed")
        return good

    def _check_peer(self, node_id: int) -> None:
        """Make sure the lookup tables know `node_id`, and that it still runs."""
        peer = self._peers.get(node_id)
        if peer is None:
            peer = self._peer(node_id)
        if peer is not None and peer.watch is not None and not peer.watch.alive():
            # Without peer-failure handling UCX aborts the process on a read
            # from a dead peer: never post one.
            self._forget(node_id, "its process is gone")

    def _peer(self, node_id: int) -> _Peer | None:
        if node_id >= len(self._key_lut):
            self._rebuild_luts(node_id + 1)
        for desc in self._client.nodes():
            if desc["node_id"] == node_id:
                try:
                    peer = _Peer(self._runtime, desc)
                except (UcxError, DistoreError) as exc:
                    log.warning("cannot reach %s: %s", desc["name"], exc)
                    return None
                self._peers[node_id] = peer
                self._rebuild_luts()
                return peer
        return None  # the node is gone; its items are being dropped

    def _rebuild_luts(self, size: int | None = None) -> None:
        """node id -> index into the remote keys, and -> arena base."""
        size = max(size or 0, len(self._key_lut), max(self._peers, default=0) + 1)
        self._rkeys = [peer.rkey for peer in self._peers.values()]
        self._key_lut = np.full(size, -1, np.int64)
        self._base_lut = np.zeros(size, np.uint64)
        for i, peer in enumerate(self._peers.values()):
            self._key_lut[peer.node_id] = i
            self._base_lut[peer.node_id] = peer.base

    def _forget(self, node_id: int, why: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is None:
            return
        log.warning("%s: %s; dropping it and resampling its items", peer.name, why)
        self._rebuild_luts()
        del peer.rkey  # the remote key goes before its endpoint
        self._runtime.drop_endpoint(peer.worker_address)

    def close(self) -> None:
        """Release the last lease and the learner's buffers and remote keys."""
        try:
            if self._outstanding:
                self._outstanding = False
                self._prefetched = self._rpc.receive(self.timeout + 10.0)
            if self._prefetched is not None:
                self._done_leases.append(self._prefetched["lease"])
                self._prefetched = None
            if self._done_leases:
                self._rpc.call("release", leases=self._done_leases)
        except DistoreError:
            pass  # the leases will expire
        self._done_leases = []
        self._rkeys.clear()
        self._peers.clear()
        self._rpc.close()

    def __enter__(self) -> "Learner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
