"""Reading a sampled batch's items into a ring slot: the gather.

The control plane answers a sample request with one record per item (node,
offset, key, generation: protocol.ITEM_LOCATION). Each item is read by the
path its node is reached by (client/learner/peers.py): items of mapped (same-host)
nodes are copied from the node's arena with plain loads, in one native call
that takes the records as they came (`_native.mapped_gather_located`); the
rest are read with one UCX gather (`_native.gather_dense`), one get per
item, or per run of items whose slots follow each other in a node's arena
(a slice's steps), into the ring's host staging area, then scattered, except those of
nodes that serve samples by active message (the "ucx-am" path, where UCX
emulates RMA: client/learner/peers.py), which come in one more native call
(`AmSampleClient.fetch`): each node sends its items' fields straight into
their rows (a node too busy to answer has those items read by gets). All
land each
item in the dense layout of the ring slot (client/learner/ring.py): its slot header
in the slot's (n, 2) header array and each field in that field's own
[n, ...] array. Every header read is checked against the (key, generation)
the control plane gave; a row that fails (slot reused, torn while copied,
node gone) is never used: it is resampled (a new request of the learner's
sample stream) and read again, up to MAX_RESAMPLES times.
"""

from __future__ import annotations

import time

import numpy as np

from ..._native_loader import _native
from ...errors import ConnectionFailed
from ...protocol import ITEM_LOCATION

MAX_RESAMPLES = 20


class Gather:
    """Reads batches into the slots of `ring` from the nodes of `peers`
    (a PeerDirectory), copying mapped nodes' items on `copy_pool`, asking
    `stream` (a SampleStream) for new items in place of rows that fail;
    counts what it read in `stats` (metrics.LearnerStats). Used from one
    thread at a time (the prefetch thread, while the learner is iterated).

    `resampled`: items dropped (slot reused, node gone) and sampled again;
    `torn`: items whose slot was rewritten while they were copied.
    """

    def __init__(self, runtime, ring, peers, copy_pool, stream, stats, item_read: int,
                 slot_size: int, slice_len: int = 0):
        self._runtime = runtime
        self._ring = ring
        self._peers = peers
        self._copy_pool = copy_pool
        self._stream = stream
        self._stats = stats
        self._read = item_read  # bytes read per item: slot header and item
        self._slot_size = slot_size  # what the control plane's grants name (ITEM_LOCATION pad)
        # A table of slices: rows come T at a time, one slice each, and a
        # slice is read whole or sampled again whole (1: items).
        self._slice = max(1, slice_len)
        self._rows = np.arange(ring.batch_size, dtype=np.uint64)  # rows of a ring slot's arrays
        # Every row of a batch, as a new batch is read (read_rows takes it
        # by identity: its rows are then filled by slices, not masks).
        self.all_rows = np.arange(ring.batch_size)
        self.all_rows.setflags(write=False)
        self.resampled = 0
        self.torn = 0

    def read_rows(self, reply: dict, rows: np.ndarray, dest, slot: int, keys: np.ndarray,
                  probs: np.ndarray, min_probs: np.ndarray, locs: np.ndarray, wait: float,
                  timeout: float, steps: tuple | None = None) -> int:
        """Read `reply`'s items into `rows` of ring slot `slot`, resampling
        those that fail their header check; fills keys, probabilities and
        locations of those rows (and, for a table of slices, `steps`: each
        row's position and flags; a slice with a row that failed is sampled
        again whole). Returns the table size of the last reply."""
        n = len(rows)
        leases = []
        for attempt in range(MAX_RESAMPLES):
            if reply["lease"] is not None:  # None: not the last batch of a reply
                leases.append(reply["lease"])
            table_size = reply["table_size"]
            got = self.read(reply, rows, dest, slot, timeout)
            items = np.frombuffer(reply["items"], ITEM_LOCATION)
            p = np.frombuffer(reply["probabilities"], np.float64)
            if got is None:  # every row read (the usual case): no masks to apply
                at = slice(None) if rows is self.all_rows else rows
                keys[at] = items["key"]
                locs[at] = items
                probs[at] = p
                min_probs[at] = reply.get("min_probability", 0.0)
                if steps is not None:
                    steps[0][at], steps[1][at] = _steps_of(reply)
                break
            if self._slice > 1:  # a slice is read whole, or again
                got = np.repeat(got.reshape(-1, self._slice).all(axis=1), self._slice)
            if steps is not None:
                positions, flags = _steps_of(reply)
                steps[0][rows[got]], steps[1][rows[got]] = positions[got], flags[got]
            keys[rows[got]] = items["key"][got]
            locs[rows[got]] = items[got]
            probs[rows[got]] = p[got]
            min_probs[rows[got]] = reply.get("min_probability", 0.0)
            rows = rows[~got]
            if len(rows) == 0:
                break
            self.resampled += len(rows)
            # The rows read so far are in dest: their leases, and the staged
            # copies of cold items under them, go back with the resample, so
            # a run of unreadable items never fills a node's staging area.
            self._stream.release_later(leases)
            leases = []
            if attempt:
                time.sleep(min(0.05 * attempt, 0.5))  # let the control plane drop a dead node
            reply = self._stream.resample(len(rows), wait)
        else:
            self._stream.release_later(leases)
            raise ConnectionFailed(
                f"table {self._stream.table!r}: {len(rows)} of {n} items still unreadable after "
                f"{MAX_RESAMPLES} resamples; storage nodes may be failing (see distore status)"
            )
        self._stream.release_later(leases)  # read: released with the next request
        return table_size

    def reread_rows(self, rows: np.ndarray, dest, slot: int, keys: np.ndarray,
                    probs: np.ndarray, min_probs: np.ndarray, locs: np.ndarray, wait: float,
                    timeout: float, steps: tuple | None = None) -> int:
        """Resample `rows` of a batch already read (their items were evicted
        since) and read the new items into the same rows; see read_rows. For
        a table of slices, the whole slices those rows are in."""
        if self._slice > 1:
            first = np.unique(np.asarray(rows) // self._slice) * self._slice
            rows = (first[:, None] + np.arange(self._slice)).ravel()
        self.resampled += len(rows)
        return self.read_rows(self._stream.resample(len(rows), wait), rows, dest, slot, keys,
                              probs, min_probs, locs, wait, timeout, steps)

    def read(self, reply: dict, rows: np.ndarray, dest, slot: int,
             timeout: float) -> np.ndarray | None:
        """Read the sampled items into `rows` of dest; mask of rows that are
        good, or None when every row is (the usual case, checked once).

        Items of mapped (same-host) nodes are copied and checked in one native
        call that takes the control plane's records as they came; the rest
        are read with UCX in another (each get given `timeout` s); both land
        each item's header in the ring slot's header array and each field in
        that field's dense array, and check every slot's header against the
        (key, generation) the control plane gave. Nodes whose reads failed
        are forgotten (looked up again when next met)."""
        t0 = time.perf_counter()  # metrics: one gather
        peers = self._peers
        peers.sweep()  # a same-host node that died: unmap it now
        raw = reply["items"]
        dest_rows = self._rows if rows is self.all_rows else self._rows[rows]
        statuses = _native.mapped_gather_located(
            peers.mappings, peers.map_lut, raw, dest_rows, self._ring.reads, dest,
            self._copy_pool)
        if not np.count_nonzero(statuses):  # every item mapped, read and checked
            self._stats.fetched("mapped", len(rows), len(rows) * self._read)
            self._stats.gather.observe(time.perf_counter() - t0)
            return None
        rest = statuses == _native.STATUS_NOT_MAPPED
        unmapped = int(np.count_nonzero(rest))
        if unmapped < len(rows):
            self._stats.fetched("mapped", len(rows) - unmapped, (len(rows) - unmapped) * self._read)
        if unmapped:
            statuses[rest] = self._unmapped(np.frombuffer(raw, ITEM_LOCATION)[rest],
                                            dest_rows[rest], rows[rest], dest, slot, timeout)
        good = statuses == 0
        if not good.all():
            self.torn += int(np.count_nonzero(statuses == _native.STATUS_TORN))
            failed = ((statuses != 0) & (statuses != _native.STATUS_TORN)
                      & (statuses != _native.STATUS_STALE))
            if failed.any():
                nodes = np.frombuffer(raw, ITEM_LOCATION)["node"]
                for node_id in np.unique(nodes[failed]):  # once per failed node
                    peers.forget(int(node_id), "reads from it failed")
        self._stats.gather.observe(time.perf_counter() - t0)
        return good

    def _unmapped(self, items: np.ndarray, dest_rows: np.ndarray, rows: np.ndarray,
                  dest, slot: int, timeout: float) -> np.ndarray:
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
        am = u & (peers.am_lut[nodes] >= 0)
        if am.any():
            a = np.flatnonzero(am)
            sent, got = fetch_by_message(self._runtime, peers.am_endpoints,
                                         peers.am_lut[nodes[a]], items[a], dest_rows[a],
                                         self._ring.reads, dest, timeout, self._slot_size)
            done = a[sent]  # the rest were refused as busy: read by gets below
            self._stats.fetched("ucx-am", len(done), len(done) * self._read)
            statuses[done] = checked_headers(got, self._ring.headers(slot)[rows[done]],
                                             items[done])
            u[done] = False
        if u.any():
            k = int(u.sum())
            got = _native.gather_dense(
                self._runtime.reader_worker, peers.rkeys, index[u].astype(np.uint32),
                peers.base_lut[nodes[u]] + items["offset"][u], dest_rows[u], self._ring.reads,
                dest, self._ring.staging(), timeout, slot_stride=self._slot_size,
                reads=self._stats.ucx_reads,
            )
            self._stats.fetched("ucx", k, k * self._read)
            statuses[u] = checked_headers(got, self._ring.headers(slot)[rows[u]], items[u])
        return statuses


def checked_headers(got: np.ndarray, headers: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Statuses of items read with UCX (`got`: the read's, 0 where read),
    each slot header read (`headers`: (k, 2) key, generation, read after
    the read completed) checked against the (key, generation) the control
    plane gave (`items`: protocol.ITEM_LOCATION records): STATUS_STALE
    where it differs (the slot was reused, or the node marked it retired)."""
    same = (headers[:, 0] == items["key"]) & (headers[:, 1] == items["generation"])
    return np.where((got == 0) & ~same, _native.STATUS_STALE, got)


def fetch_by_message(runtime, endpoints: list, index: np.ndarray, items: np.ndarray,
                     rows: np.ndarray, layout, dest, timeout: float,
                     slot_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Have nodes that serve samples by active message send `items`
    (ITEM_LOCATION records; `index`: each one's node in `endpoints`) into
    `rows` of `dest` laid out as `layout`, in one native call of at most
    `timeout` s. Returns (sent, statuses): the mask of items the nodes sent
    and, for those, the read's statuses (headers not checked yet:
    checked_headers). A node serving too many batches refuses with
    STATUS_BUSY: its items (~sent) are for the caller to read by gets."""
    got = runtime.am_sample_client().fetch(
        endpoints, index.astype(np.uint32), items["offset"], rows, layout, dest, timeout,
        tags=items["pad"], slot_size=slot_size)
    sent = got != _native.STATUS_BUSY
    return sent, got[sent]


def _steps_of(reply: dict) -> tuple[np.ndarray, np.ndarray]:
    """A table of slices' reply: each row's position in its episode and flags."""
    return (np.frombuffer(reply["positions"], np.uint32),
            np.frombuffer(reply["step_flags"], np.uint8))
