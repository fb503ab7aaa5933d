"""A storage node's disk tier: a preallocated tier file on local NVMe.

When the arena is full, the node demotes items of the inserting table to
the disk tier instead of failing the insert: the control plane picks them
(oldest first, or lowest priority for prioritized tables, never an item
under lease), the node writes them to the tier file in one batch, and the
control plane moves their records (see control/tiers.py). A cold item's
location is its disk slot with the top bit of `offset` set (COLD), and every
move gives it a new generation, so a learner holding an old location can
never accept its bytes.

A sampled cold item is staged: the node reads it from the tier file, in one
batch with the rest of the sample's cold items, straight into the staging
area at the bottom of its arena (registered, mapped by same-host learners),
and the control plane answers the sample with those locations. Slots that
follow each other on disk and in the batch (a cold slice's steps: demoted
together in episode order, given ascending disk slots, staged in one
extent) are read as one run (native/disk_io.h). Each disk
slot ends with a checksum of its bytes, written with it and checked on every
read: an item whose bytes changed on disk is reported lost (the control
plane drops it, its staged header is zeroed, learners resample it). The staged
copy stays until the sample's lease is released or expires.

The tier file is capacity, not persistence: a node that restarts starts
with an empty tier (docs/operations.md). It has a 4 KiB header (magic,
format version, sizes, the node and arena it belongs to, a CRC); a file
that is not a tier file, or whose header is corrupt, or that is shorter
than its header says, is refused, never overwritten.
Thread safety: one asyncio thread uses a DiskTier and a StagingArea; the
batched reads and writes (native/disk_io.cc) run on the node's disk thread.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
import time
import zlib

import numpy as np

from ..config import disk_bounce
from ..errors import ConfigError, StorageFull
from ..slot_format import ALIGN, COLD, stride_of
from .slots import SlotTable

log = logging.getLogger(__name__)

HEADER_BYTES = ALIGN
MAGIC = b"DSTIER\x00\x01"
FORMAT_VERSION = 1
# magic, version, header bytes, data bytes, arena id, created (unix s), node name
_HEADER = struct.Struct("<8sIIQQd64s")
IO_THREADS = 8  # transfers in flight per batch (the device's queue depth)
# The last TRAILER bytes of every disk slot (slot_format.py): CRC-32C of the
# rest and its complement, written with the slot and checked natively on every
# read (native/disk_io.h), so a flipped bit is a lost item (resampled), never
# a wrong one.
# Cold reads into an arena of 4 KiB pages go through this much contiguous
# memory per I/O thread (bounce_reads()): 8 x 2 MiB per node, each
# chunk one hugepage. Chunks smaller than an item let one chunk's copy run
# while the disk fills the next (docs/performance.md, perf/tier_bandwidth.py).
BOUNCE_CHUNK = 2 << 20


def bounce_reads(contiguous: bool) -> bool:
    """Whether cold reads go through a buffer of transparent hugepages,
    for an arena whose pages are (`contiguous`: reserved hugepages; the node
    decides) or are not physically contiguous.

    A disk splits a read at its segment limit (a few hundred pages), so a
    read into scattered 4 KiB pages costs several requests where a read into
    physically contiguous memory costs one, and cold sampling ran far below
    the disk's speed (docs/performance.md, perf/tier_bandwidth.py). Through
    the buffer,
    each of the node's reading threads (native DiskReader) reads into its
    own 2 MiB hugepage chunk and streams it on into the staging area.
    DISTORE_DISK_BOUNCE=0/1 overrides the choice."""
    return disk_bounce(not contiguous)


class TierFileError(ConfigError):
    """The tier file cannot be used (not ours, corrupt, truncated, locked)."""


class DiskTier:
    """The tier file of one node and the disk slots of each table in it."""

    def __init__(self, path: str, size: int, node_name: str, arena_id: int,
                 sync: bool = False):
        if size < ALIGN:
            raise ConfigError(f"--disk-size {size} is too small (at least 4KiB)")
        self.path = path
        self.size = size // ALIGN * ALIGN  # bytes of slots, after the header
        self.node_name = node_name
        self.sync = sync
        self.direct = True
        self._created = False  # made by this open: removed again if it cannot be used
        self.fd = self._open(path)
        try:
            self._check_or_create(arena_id)
        except BaseException:
            os.close(self.fd)
            if self._created:  # e.g. a --disk-size the disk cannot hold: leave nothing behind
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        self._tables: dict[str, SlotTable] = {}
        self._bump = 0
        self.used_bytes = 0
        self.write_errors = 0
        self.read_errors = 0
        self.bounce = False  # read through hugepage buffers (bounce_reads(); the node sets it)
        self._reader = None  # the native read queue, made on the first read
        self._reader_lock = threading.Lock()  # the node's two disk threads may both make it
        self._reads_before = 0  # read calls of readers replaced since
        self.demoted = 0  # items moved here from the arena

    # -- the file ----------------------------------------------------------
    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            try:  # a new file is ours to remove if it cannot be used
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
                self._created = True
            except FileExistsError:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != 22:  # EINVAL: the file system has no O_DIRECT (tmpfs)
                raise TierFileError(f"node {self.node_name}: cannot open the tier file {path!r}: "
                                    f"{exc.strerror}; pass a --disk path on a local disk "
                                    "this user can write") from None
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                self._created = True
            except FileExistsError:
                fd = os.open(path, flags, 0o600)
            self.direct = False
            log.warning("node %s: the file system of %s has no O_DIRECT; the disk tier goes "
                        "through the page cache (use a path on a real disk)", self.node_name,
                        path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise TierFileError(f"node {self.node_name}: the tier file {path!r} is in use by "
                                "another storage node; give each node its own --disk path"
                                ) from None
        return fd

    def _check_or_create(self, arena_id: int) -> None:
        """Refuse a file that is not a valid tier file; (re)write the header of
        a new or valid one and preallocate it."""
        path, have = self.path, os.fstat(self.fd).st_size
        if have > 0:
            head = self._read_header()
            magic, version, hbytes, data, _, created, name = _HEADER.unpack_from(head)
            crc = struct.unpack_from("<I", head, _HEADER.size)[0]
            what = None
            if magic != MAGIC:
                what = ("is not a distore tier file (no tier header); it is left untouched. "
                        "Pass another --disk path, or remove the file if it is yours to lose")
            elif version != FORMAT_VERSION:
                what = (f"has tier format {version}, this version reads {FORMAT_VERSION}. "
                        "Its items are not kept across restarts anyway: remove it")
            elif crc != zlib.crc32(head[: _HEADER.size]) or hbytes != HEADER_BYTES:
                what = ("has a corrupt header (checksum mismatch). Its items are not kept "
                        "across restarts: remove it (or pass another --disk path)")
            elif have < HEADER_BYTES + data:
                what = (f"is truncated: {have} bytes, its header says {HEADER_BYTES + data}. "
                        "Something outside distore cut it (a full disk?); remove it")
            if what is not None:
                raise TierFileError(f"node {self.node_name}: the tier file {path!r} {what}")
            log.info("node %s: reusing tier file %s (was node %r's, created %s); its former "
                     "items are discarded", self.node_name, path,
                     name.rstrip(b"\0").decode(errors="replace"), time.ctime(created))
            if data > self.size:
                os.ftruncate(self.fd, HEADER_BYTES + self.size)
        try:
            os.posix_fallocate(self.fd, 0, HEADER_BYTES + self.size)
        except OSError as exc:
            raise TierFileError(f"node {self.node_name}: cannot preallocate {self.size} bytes "
                                f"for the tier file {path!r}: {exc.strerror}. Free space there "
                                "or give a smaller --disk-size") from None
        self._write_header(arena_id)

    def _read_header(self) -> bytes:
        buf = mmap.mmap(-1, HEADER_BYTES)  # page aligned, as O_DIRECT needs
        try:
            got = os.preadv(self.fd, [buf], 0)
            if got < HEADER_BYTES:
                raise TierFileError(f"node {self.node_name}: the tier file {self.path!r} is "
                                    f"truncated ({got} bytes, shorter than its own header); "
                                    "remove it")
            return bytes(buf)
        finally:
            buf.close()

    def _write_header(self, arena_id: int) -> None:
        buf = mmap.mmap(-1, HEADER_BYTES)
        try:
            name = self.node_name.encode()[:64]
            _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, self.size, arena_id,
                              time.time(), name)
            struct.pack_into("<I", buf, _HEADER.size, zlib.crc32(buf[: _HEADER.size]))
            os.pwritev(self.fd, [buf], 0)
            os.fsync(self.fd)
        finally:
            buf.close()

    def close(self) -> None:
        """Close the tier file (its items are gone with the node)."""
        self._reader = None  # its threads end once queued batches are done
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- disk slots --------------------------------------------------------
    def room(self, table: str, slot_size: int) -> int:
        """How many more items of `table` fit on disk."""
        slots = self._tables.get(table)
        free = slots.free_slots if slots is not None else 0
        return free + (self.size - self._bump) // stride_of(slot_size)

    def allocate(self, table: str, slot_size: int, k: int) -> np.ndarray:
        """Data offsets of k free disk slots of `table` (ALLOCATED), ascending,
        so that items written in order (a slice's steps) follow each other on
        disk where the free slots do; all or nothing."""
        stride = stride_of(slot_size)
        slots = self._tables.get(table)
        if slots is None:
            slots = self._tables[table] = SlotTable(stride)
        if k > self.room(table, slot_size):
            raise StorageFull(
                f"node {self.node_name}: arena and disk tier both full ({self.used_bytes} of "
                f"{self.size} disk bytes used) while making room for {k} items of table "
                f"{table!r}. Lower the table's capacity to what the nodes' arenas and disk "
                "tiers hold (it then evicts by its remover), or give nodes a larger --disk-size")
        reused = np.sort(slots.reuse(k))  # freed in any order; fresh ones lie above
        rest = k - len(reused)
        fresh = (self._bump + np.arange(rest, dtype=np.uint64) * stride).astype(np.uint64)
        self._bump += rest * stride
        slots.carve(fresh)
        self.used_bytes += k * stride
        return np.concatenate([reused, fresh]) if len(reused) else fresh

    def commit(self, table: str, offsets, keys, generations, priorities,
               steps: tuple | None = None) -> None:
        """Disk slots whose items the control plane moved here: LIVE (`steps`:
        steps of episodes' (episodes, positions, flags))."""
        self._tables[table].commit(np.asarray(offsets, np.uint64), keys, generations, priorities,
                                   steps)

    def free(self, table: str, offsets, live_only: bool = False) -> None:
        """Return disk slots (data offsets, COLD bit cleared or not) to the table."""
        slots = self._tables.get(table)
        if slots is None or len(offsets) == 0:
            return
        offsets = np.asarray(offsets, np.uint64) & ~COLD
        try:
            freed = slots.release(offsets, live_only)
        except ValueError:
            raise ValueError(f"node {self.node_name}: free of disk slots never allocated in "
                             f"table {table!r}") from None
        self.used_bytes -= freed * slots.slot_size

    def tables(self) -> dict[str, SlotTable]:
        """Every table with disk slots, by name (offsets without the COLD bit)."""
        return dict(self._tables)

    def live(self, table: str):
        """LIVE disk items of `table`: (keys, COLD offsets, generations, priorities)."""
        keys, offsets, gens, prios = self._tables[table].live()
        return keys, offsets | COLD, gens, prios

    def live_steps(self, table: str) -> tuple | None:
        """live()'s (episodes, positions, flags), None for a table of items."""
        return self._tables[table].live_steps()

    @property
    def reads(self) -> int:
        """Read calls (pread/preadv) cold reads have taken: one per run of
        slots that follow each other on disk (a cold slice's steps), or per
        bounce chunk of a run; node_info's `disk_reads`."""
        reader = self._reader
        return self._reads_before + (reader.reads if reader is not None else 0)

    # -- batched I/O (run on the disk thread) --------------------------------
    def write(self, region, src_offsets, slot_size: int, disk_offsets, keys,
              generations) -> np.ndarray:
        """Write arena slots to disk with new generations; per-slot statuses."""
        from .._native_loader import _native  # here: the control plane imports this module

        return _native.disk_write(
            self.fd, region, np.ascontiguousarray(src_offsets, np.uint64), slot_size,
            np.ascontiguousarray(disk_offsets, np.uint64) + np.uint64(HEADER_BYTES),
            stride_of(slot_size), np.ascontiguousarray(keys, np.uint64),
            np.ascontiguousarray(generations, np.uint64), IO_THREADS, self.sync)

    def read(self, disk_offsets, slot_size: int, region, dest_offsets, keys,
             generations) -> np.ndarray:
        """Read disk slots into the arena (staging area) and check their
        headers and checksums (statuses: 0, an errno, STATUS_STALE,
        STATUS_CORRUPT); through hugepage buffers when `bounce` (bounce_reads())."""
        from .._native_loader import _native

        chunk = BOUNCE_CHUNK if self.bounce else 0
        with self._reader_lock:
            if self._reader is None or self._reader.chunk != chunk:
                # IO_THREADS threads for the node's life, one queue: batches
                # of concurrent samples are read one after another, in order,
                # each at the disk's full speed, the next one's reads queued.
                if self._reader is not None:
                    self._reads_before += self._reader.reads
                self._reader = _native.DiskReader(IO_THREADS, chunk)
            reader = self._reader
        data = (np.asarray(disk_offsets, np.uint64) & ~COLD) + np.uint64(HEADER_BYTES)
        return reader.read(
            self.fd, np.ascontiguousarray(data), stride_of(slot_size), region,
            np.ascontiguousarray(dest_offsets, np.uint64), np.ascontiguousarray(keys, np.uint64),
            np.ascontiguousarray(generations, np.uint64))


class StagingArea:
    """The bottom `size` bytes of the arena, lent out in 4 KiB-aligned
    extents to staged cold items until their sample's lease ends. A batch
    may take several extents, so that space freed in pieces is used."""

    def __init__(self, size: int):
        self.size = size // ALIGN * ALIGN
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []
        self._taken: dict[int, int] = {}
        self.used_bytes = 0

    def take(self, n: int, stride: int) -> tuple[np.ndarray, list[int]] | None:
        """Room for n items of `stride` bytes: the first free extent that holds
        them all (so the batch's items follow each other, and a cold slice
        read as one run lands in one piece), else as many extents as it
        takes (first fit): (the items' offsets, the starts of the extents
        taken), or None if there is not room for all n now."""
        fits = [length // stride for _, length in self._free]
        if sum(fits) < n:
            return None
        whole = next((i for i, fit in enumerate(fits) if fit >= n), None)
        if whole is not None:  # only that extent is taken from
            fits = [n if i == whole else 0 for i in range(len(fits))]
        offsets, starts, left, keep = [], [], n, []
        for (start, length), fit in zip(self._free, fits):
            k = min(fit, left)
            if k == 0:
                keep.append((start, length))
                continue
            offsets.append(start + np.arange(k, dtype=np.uint64) * np.uint64(stride))
            self._taken[start] = k * stride
            starts.append(start)
            if length > k * stride:
                keep.append((start + k * stride, length - k * stride))
            left -= k
        self._free = keep
        self.used_bytes += n * stride
        return np.concatenate(offsets), starts

    def give(self, start: int) -> bool:
        """Return an extent; False if `start` is not a taken one (ignored)."""
        nbytes = self._taken.pop(int(start), None)
        if nbytes is None:
            return False
        self.used_bytes -= nbytes
        self._free.append((int(start), nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged
        return True

    @property
    def extents(self) -> int:
        """Extents lent out now."""
        return len(self._taken)
