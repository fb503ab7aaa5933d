"""Re-checking a batch read ahead before it is handed out.

A batch the prefetch thread read ahead may hold items evicted since (by
inserts acknowledged after it was read). Their nodes mark such slots
before the evicting insert is acknowledged (control/retirements.py), so
reading every slot header of the batch again in place, when the batch is
handed out, finds them: those rows are resampled by the prefetch thread
first (Learner._repair), and no batch handed out holds an item evicted
before it was taken.
"""

from __future__ import annotations

import numpy as np

from ..._native_loader import _native
from .gather import checked_headers, fetch_by_message


class HeaderRecheck:
    """Finds the rows of a batch whose items left the table since it was
    read. Runs on the consumer's thread while the prefetch thread reads the
    next batches: it only reads the peers' current tables (replaced, never
    changed in place) and keeps its own remote keys and header buffer.
    """

    def __init__(self, client, runtime, peers, slot_size: int):
        self._client = client
        self._runtime = runtime
        self._peers = peers
        self._slot_size = slot_size  # what the items' grants name
        self._headers = None  # where batches fetched ahead have their headers re-read
        self._header_layout = None  # their layout: headers only (made with _headers)
        self._rows = None  # rows of the header buffer (made with _headers)
        self._check_keys: dict = {}  # node id -> (address, remote key) for those re-reads

    def retired_rows(self, locs: np.ndarray, timeout: float) -> np.ndarray:
        """Rows of a batch (its items' locations `locs`) whose items left the
        table since they were read (evicted while this learner held them:
        their node marked the slots, control/retirements.py), found by
        reading every slot header again in place: one native call for mapped
        nodes; for nodes that send samples by active message (over TCP), one
        headers-only request each, the node's reply carrying the headers;
        one small UCX gather (of `timeout` s at most) for the rest. A header
        that cannot be read counts as retired (the row is resampled)."""
        n = len(locs)
        if self._headers is None:
            self._headers = self._runtime.map_region(n * 16)
            # headers only: row r's [key, generation] at r * 16, no fields
            self._header_layout = _native.BatchLayout(n, 0, np.zeros(0, np.uint64),
                                                      np.zeros(0, np.uint64),
                                                      np.zeros(0, np.uint64))
            self._rows = np.arange(n, dtype=np.uint64)
        peers = self._peers
        mappings, map_lut = peers.mappings, peers.map_lut
        rkeys, key_lut, base_lut = peers.rkeys, peers.key_lut, peers.base_lut
        statuses = _native.mapped_gather_located(mappings, map_lut, locs.tobytes(),
                                                 self._rows[:n], self._header_layout,
                                                 self._headers, None)
        rest = np.flatnonzero(statuses == _native.STATUS_NOT_MAPPED)
        if len(rest):
            statuses[rest] = _native.STATUS_UNREACHABLE  # unless read below
            header = self._headers.view().view(np.uint64).reshape(n, 2)
            rest = self._reread_by_message(locs, rest, statuses, header, timeout)
            for node_id in np.unique(locs["node"][rest]).tolist():
                u = rest[locs["node"][rest] == node_id]
                worker, key = self._check_key(node_id, rkeys, key_lut)
                if key is None:
                    continue
                got = _native.gather(
                    worker, [key], np.zeros(len(u), np.uint32),
                    base_lut[node_id] + locs["offset"][u], np.full(len(u), 16, np.uint64),
                    self._headers, self._rows[u] * np.uint64(16), timeout)
                statuses[u] = checked_headers(got, header[u], locs[u])
                if (got != 0).any():
                    self._check_keys.pop(node_id, None)  # made again next time
        return np.flatnonzero(statuses != 0)

    def _reread_by_message(self, locs: np.ndarray, rest: np.ndarray, statuses: np.ndarray,
                           header: np.ndarray, timeout: float) -> np.ndarray:
        """Re-read the headers of rows `rest` on nodes that send samples by
        active message with one headers-only request per node (one native
        call): over TCP a one-sided get of 16 bytes is a round trip of its
        own, emulated by the node, where this is one message each way. Sets
        their statuses; returns the rows left to read with gets (other
        nodes, and nodes that refused the request as busy)."""
        eps, am_lut = self._peers.am_endpoints, self._peers.am_lut
        nodes = locs["node"][rest].astype(np.int64)
        known = nodes < len(am_lut)
        index = np.full(len(rest), -1, np.int64)
        index[known] = am_lut[nodes[known]]
        # The two tables are swapped one after the other by the prefetch
        # thread: an index past this list is left to the gets below (one
        # naming another node's endpoint reads headers that cannot match,
        # as keys are never reused: those rows are resampled, never kept).
        by_message = (index >= 0) & (index < len(eps))
        if not by_message.any():
            return rest
        u = rest[by_message]
        sent, got = fetch_by_message(self._runtime, eps, index[by_message], locs[u],
                                     self._rows[u], self._header_layout, self._headers,
                                     timeout, self._slot_size)
        done = u[sent]
        statuses[done] = checked_headers(got, header[done], locs[done])
        return np.concatenate([rest[~by_message], u[~sent]])

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

    def close(self) -> None:
        """Drop the header buffer and the remote keys of the re-reads."""
        self._headers = None
        self._check_keys = {}
