"""A writer's staging memory: the buffers items are packed into, and batches.

Staging memory is bounded: a pool of `max_in_flight` buffers of
`batch_bytes` (the first made with the writer, the others on first use),
registered with UCX once, remote-READ
only and write-protected (a node cannot write the writer's memory). A buffer
is refilled only after its batch's acknowledgement (the writer's batches in
flight, client/writer/in_flight.py, hand it back). An item larger than
`batch_bytes` grows the buffer it goes to (to the item's size, kept for later
items), so the bound is `max_in_flight` x max(`batch_bytes`, largest item).
With `batch_bytes` left at its default (`min_items` set), a buffer also grows
to hold `min_items` items of a table with large items, up to `grow_to` bytes
(each batch costs every process on its way a few milliseconds of CPU whatever
its size, so batches of one or two items of megabytes go at half the rate):
the bound is then `max_in_flight` x max(`batch_bytes`, min(`min_items` x
largest item, `grow_to`), largest item).

A batch is the items of one table staged in one buffer; each table has at
most one batch being filled. Thread safety: none (a writer is used by one
thread).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass

import numpy as np

from ..._native_loader import _native
from ...transport.local_map import TICKET_BYTES

_PAGE = 1 << 12
# A field this large is staged by the native copy (non-temporal stores past
# the cache, GIL released: native/rows.h copy_rows, whose threshold it is),
# smaller ones by numpy.
STREAM_FIELD_BYTES = _native.STAGE_STREAM_MIN


def copy_field_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for a field's (k, nbytes) uint8 rows: natively for
    fields of STREAM_FIELD_BYTES and more whose rows are contiguous."""
    if dst.shape[1] >= STREAM_FIELD_BYTES and src.strides[1] == 1:
        _native.copy_rows(dst, src)
    else:
        dst[...] = src


class StagingBuffer:
    """One staging buffer: memory registered once, read-only to peers."""

    def __init__(self, runtime, index: int, size: int):
        self.index = index
        self._runtime = runtime
        self._map(size)

    def _map(self, size: int) -> None:
        size = -(-size // _PAGE) * _PAGE
        self.region = _native.MemoryRegion.write_protected(self._runtime.region_owner, size)
        self.view = self.region.view()  # the writable alias
        self.rkey = self.region.pack_rkey()
        self.base = self.region.address  # what the node reads
        self.size = self.region.size
        # The sealed memfd behind it (-1 if the kernel cannot seal it), handed
        # to same-host nodes under a random ticket; a new region, a new ticket.
        self.fd = self.region.share_fd
        self.ticket = secrets.token_bytes(TICKET_BYTES)

    def grow(self, size: int) -> None:
        """Make room for at least `size` bytes (an item larger than batch_bytes)."""
        if size > self.size:
            self.view = self.region = None
            self._map(size)


class OneItemLayout:
    """What a one-item insert of a table needs, computed once: each field's
    name, shape, dtype and byte range in the item. Only for items without
    padding between fields (the general path zeroes padding)."""

    def __init__(self, spec):
        self.spec = spec
        self.item_bytes = spec.item_bytes
        self.unnamed = spec.unnamed
        self.fields = [(f.name, f.shape, f.dtype, f.offset, f.nbytes) for f in spec.fields]
        self.dense = sum(f[4] for f in self.fields) == self.item_bytes

    def parts(self, data, priority) -> tuple | list | None:
        """`data`'s arrays in field order when it is the common call: one item
        given as numpy arrays of the spec's shapes and dtypes, with a float
        priority that is finite and non-negative. None for any other call
        (the general path takes it, and says what is wrong with it)."""
        if not self.dense or type(priority) not in (float, int):
            return None
        if not 0.0 <= priority < math.inf:  # NaN fails too
            return None
        if self.unnamed:
            name, shape, dtype, _, _ = self.fields[0]
            if type(data) is not np.ndarray or data.shape != shape or data.dtype != dtype:
                return None
            return (data,)
        if type(data) is not dict or len(data) != len(self.fields):
            return None
        parts = []
        for name, shape, dtype, _, _ in self.fields:
            a = data.get(name)
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
            parts.append(a)
        return parts


@dataclass
class StagedBatch:
    """Items of one table staged in one buffer."""

    table: str
    spec: object
    buffer: StagingBuffer
    capacity: int  # items that fit
    n: int = 0
    keys: np.ndarray = None  # uint64[capacity], the first n in use
    priorities: np.ndarray = None  # float64[capacity]
    sent: float = 0.0  # perf_counter when sent (metrics: time to acknowledgement)
    send_by: float = math.inf  # time.monotonic() past which it goes at the next insert
    # Steps of episodes (a table of slices): each item's episode, position
    # and flags (None for a table of items).
    episodes: np.ndarray | None = None
    positions: np.ndarray | None = None
    step_flags: np.ndarray | None = None

    def __post_init__(self):
        self.keys = np.empty(self.capacity, np.uint64)
        self.priorities = np.empty(self.capacity, np.float64)

    def put_steps(self, arrays: list, keys: np.ndarray, priorities: np.ndarray,
                  steps: tuple, lo: int, k: int) -> None:
        """put() for steps of episodes: with each step's (episode, position,
        flags) from the arrays of `steps`."""
        if self.episodes is None:
            self.episodes = np.empty(self.capacity, np.uint64)
            self.positions = np.empty(self.capacity, np.uint32)
            self.step_flags = np.empty(self.capacity, np.uint8)
        at = slice(self.n, self.n + k)
        self.episodes[at], self.positions[at], self.step_flags[at] = (
            a[lo : lo + k] for a in steps)
        self.put(arrays, keys, priorities, lo, k)

    def group_episodes(self) -> None:
        """Put the staged steps of each episode next to each other, in
        order (a stable sort by episode): the node stores a batch's rows in
        slots that follow each other, so a slice of them is one read for a
        learner. A vectorized actor appends one step of each env a call,
        interleaved; a batch already grouped (one env) is left as it is."""
        if self.episodes is None or self.n < 2:
            return
        episodes = self.episodes[: self.n]
        changes = int(np.count_nonzero(episodes[1:] != episodes[:-1]))
        if changes == 0 or changes + 1 == len(np.unique(episodes)):
            return  # grouped already
        order = np.argsort(episodes, kind="stable")
        ib = self.spec.item_bytes
        _native.permute_rows(self.buffer.view[: self.n * ib].reshape(self.n, ib), order)
        for column in (self.keys, self.priorities, self.episodes, self.positions,
                       self.step_flags):
            column[: self.n] = column[: self.n][order]

    def step_fields(self) -> dict:
        """The descriptor's per-step fields ({} for items)."""
        if self.episodes is None:
            return {}
        return {"episodes": self.episodes[: self.n], "positions": self.positions[: self.n],
                "step_flags": self.step_flags[: self.n]}

    def rows(self, k: int) -> np.ndarray:
        """The next k free rows of the buffer, as an (k, item_bytes) uint8 view."""
        ib = self.spec.item_bytes
        return self.buffer.view[self.n * ib : (self.n + k) * ib].reshape(k, ib)

    def put(self, arrays: list, keys: np.ndarray, priorities: np.ndarray, lo: int, k: int
            ) -> None:
        """Stage items lo..lo+k of `arrays` (the spec's `arrays` of a call),
        with their keys and priorities, in the next k free rows."""
        self.spec.pack_into(self.rows(k), arrays, lo, lo + k, copy_field_rows)
        self.keys[self.n : self.n + k] = keys[lo : lo + k]
        self.priorities[self.n : self.n + k] = priorities[lo : lo + k]
        self.n += k

    def put_one(self, layout: OneItemLayout, parts, key: int, priority: float) -> None:
        """Stage one item given as its fields' arrays (OneItemLayout.parts) in
        the next free row: one slice copy per field, no other numpy work."""
        row = self.n * layout.item_bytes
        view = self.buffer.view[row : row + layout.item_bytes]
        for (_, _, _, offset, nbytes), a in zip(layout.fields, parts):
            src = a.reshape(-1).view(np.uint8)  # contiguous: reshape(-1) copies if need be
            if nbytes >= STREAM_FIELD_BYTES:
                _native.copy_rows(view[offset : offset + nbytes].reshape(1, nbytes),
                                  src.reshape(1, nbytes))
            else:
                view[offset : offset + nbytes] = src
        self.keys[self.n] = key
        self.priorities[self.n] = priority
        self.n += 1

    def all_keys(self) -> np.ndarray:
        """A copy of the keys of the items staged so far."""
        return self.keys[: self.n].copy()


def batch_bytes_for(item_bytes: int, batch_bytes: int, min_items: int = 0,
                    grow_to: int = 0) -> int:
    """Bytes a batch of items of `item_bytes` takes: `batch_bytes`, or
    `min_items` items of a table whose items are so large that `batch_bytes`
    holds fewer (as many as fit in `grow_to`), or one item larger than either."""
    grown = min(min_items * item_bytes, grow_to // item_bytes * item_bytes)
    return max(item_bytes, batch_bytes, grown)


class StagingPool:
    """The writer's staging buffers and the batch being filled for each table."""

    def __init__(self, runtime, batch_bytes: int, max_items: int, max_in_flight: int,
                 max_delay: float, min_items: int = 0, grow_to: int = 0):
        """`min_items` (0: off): a batch holds at least this many items where
        that takes at most `grow_to` bytes (buffers grow past `batch_bytes`
        for it; see the module docstring)."""
        self.runtime = runtime
        self.batch_bytes = batch_bytes
        self.min_items = min_items
        self.grow_to = grow_to
        self.max_items = max_items
        self.max_in_flight = max_in_flight
        self.max_delay = max_delay
        self.buffers: list[StagingBuffer] = []
        self.free: list[StagingBuffer] = []
        self.open: dict[str, StagedBatch] = {}  # one batch being filled per table

    def spare(self) -> StagingBuffer | None:
        """A buffer no batch uses (a new one while fewer than `max_in_flight`
        exist); None when every buffer holds a batch."""
        if self.free:
            return self.free.pop()
        if len(self.buffers) < self.max_in_flight:
            buf = StagingBuffer(self.runtime, len(self.buffers), self.batch_bytes)
            self.buffers.append(buf)
            return buf
        return None

    def first(self) -> StagingBuffer:
        """The first buffer (made now if need be), spare or not: a new writer
        hands it to same-host nodes before its first insert."""
        if not self.buffers:
            self.release(self.spare())
        return self.buffers[0]

    def open_batch(self, table: str, spec, buf: StagingBuffer) -> StagedBatch:
        """A new batch of `table` in `buf` (grown for one item if need be),
        sent at the next insert once it is `max_delay` old."""
        ib = spec.item_bytes
        want = batch_bytes_for(ib, self.batch_bytes, self.min_items, self.grow_to)
        buf.grow(want)
        capacity = min(self.max_items, min(want, buf.size) // ib)
        batch = StagedBatch(table, spec, buf, capacity, send_by=time.monotonic() + self.max_delay)
        self.open[table] = batch
        return batch

    def release(self, buf: StagingBuffer) -> None:
        """Take back a buffer whose batch was acknowledged or given up."""
        self.free.append(buf)

    def clear(self) -> None:
        """Forget every batch and buffer (the writer is closed)."""
        self.open.clear()
        self.free.clear()
        self.buffers.clear()
