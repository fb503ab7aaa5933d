"""Checkpoints of the control plane, and the ids that must never repeat.

A checkpoint holds, for every table, its definition and counters and, for
every item in it, key, priority, times sampled and insertion sequence (so
priorities, use counts and FIFO order come back), plus the keys of items
that had left the table but whose slots were still leased (their nodes
still hold them; they must not come back). It holds no locations: after a
restart the nodes re-register and re-send their slot lists, because a
node's slot table is the truth about bytes. It names those nodes, so that
a restore knows when every one has re-sent its items.

File format, version 1: ``MAGIC``, then a little-endian header (format
version u32, metadata length u64, array bytes u64, CRC-32 of metadata and
arrays u32), then the metadata, one msgpack map (definitions, counters,
each array's length, and the nodes; files without "nodes" still read),
then every table's arrays as raw little-endian bytes.
The arrays never pass through msgpack: they are written from and read into
numpy buffers, and the CRC and file I/O release the GIL, so a checkpoint
written on a worker thread barely slows the control plane's event loop. A
checkpoint is written to a temporary file in the same folder, flushed to
disk, renamed over the previous one, and the folder is flushed too: a crash
leaves the old checkpoint or the new one, never a torn file.

Writer ids are the high bits of every key, so a restarted control plane
must never hand out one that an earlier run handed out, even one given
after the last checkpoint; node ids and lease ids likewise. Those counters
live in a small sidecar file (``PATH.ids``), written whenever they move
(writer ids are reserved in blocks, so that is rare).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..errors import CheckpointError

log = logging.getLogger(__name__)

MAGIC = b"DISTORE-CHECKPOINT\n"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<IQQI")  # format version, metadata bytes, array bytes, crc32
WRITER_ID_BLOCK = 256  # writer ids reserved (and persisted) at a time
KEY_BITS = 24  # a key is writer_id << KEY_BITS | the writer's sequence number

_ARRAYS = {"keys": np.uint64, "priorities": np.float64, "times_sampled": np.uint32,
           "sequences": np.uint64, "retired": np.uint64,
           # a table of slices: item i's episode, position and flags (empty otherwise;
           # absent from files written before tables of slices)
           "episodes": np.uint64, "positions": np.uint32, "step_flags": np.uint8}
_EMPTY = {name: np.empty(0, dt) for name, dt in _ARRAYS.items()}


@dataclass
class TableImage:
    """One table in a checkpoint: definition, counters and its items.

    `definition` holds the create_table fields; item i has key, priority,
    times sampled and insertion sequence at index i of the arrays (in no
    particular order); `retired` holds keys of items that had left the
    table while a learner still leased their slots. A table of slices also
    has each step's episode, position and flags (`steps`; empty arrays for
    a table of items).
    """

    definition: dict[str, Any]
    inserts: int
    samples: int
    deletes: int
    next_seq: int
    keys: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    sequences: np.ndarray
    retired: np.ndarray
    episodes: np.ndarray = field(default_factory=lambda: _EMPTY["episodes"])
    positions: np.ndarray = field(default_factory=lambda: _EMPTY["positions"])
    step_flags: np.ndarray = field(default_factory=lambda: _EMPTY["step_flags"])

    @property
    def steps(self) -> tuple | None:
        """(episodes, positions, flags) of a table of slices' items; None for items."""
        return (self.episodes, self.positions, self.step_flags) if len(self.episodes) else None

    @property
    def name(self) -> str:
        return self.definition["name"]

    def meta(self) -> dict[str, Any]:
        """Everything but the arrays, which are described by their lengths."""
        return {"definition": self.definition, "inserts": self.inserts, "samples": self.samples,
                "deletes": self.deletes, "next_seq": self.next_seq,
                "lengths": {name: len(getattr(self, name)) for name in _ARRAYS}}

    def arrays(self) -> list[np.ndarray]:
        """The arrays in file order, contiguous and little-endian."""
        return [np.ascontiguousarray(getattr(self, name), np.dtype(dt).newbyteorder("<"))
                for name, dt in _ARRAYS.items()]


@dataclass
class Image:
    """A whole checkpoint: when and by which run it was taken, and its tables.

    `nodes` (node id: name) are the storage nodes that may hold its items
    and `next_node_id` the first id not handed out when it was taken: a
    restore waits for those nodes and any that joined after it, and ends
    once they have all re-sent their items (None, 0: an older file, whose
    restore waits out its grace).
    """

    tables: list[TableImage]
    created: float = field(default_factory=time.time)
    incarnation: int = 0
    store_id: str = ""  # the store it belongs to (IdState.store_id; "" in older files)
    nodes: dict[int, str] | None = None
    next_node_id: int = 0

    @property
    def items(self) -> int:
        """Items in every table (retired keys not counted)."""
        return sum(len(t.keys) for t in self.tables)


def write(path: str, image: Image) -> int:
    """Write `image` to `path` atomically; returns the bytes written.

    Blocking: the control plane calls it on a worker thread.
    """
    meta = msgpack.packb({
        "created": image.created,
        "incarnation": image.incarnation,
        "store_id": image.store_id,
        "tables": [t.meta() for t in image.tables],
        **({"nodes": [[i, n] for i, n in sorted(image.nodes.items())],
            "next_node_id": image.next_node_id} if image.nodes is not None else {}),
    }, use_bin_type=True)
    arrays = [memoryview(a).cast("B") for t in image.tables for a in t.arrays()]
    crc = zlib.crc32(meta)
    for view in arrays:
        crc = zlib.crc32(view, crc)
    array_bytes = sum(v.nbytes for v in arrays)
    head = MAGIC + _HEADER.pack(FORMAT_VERSION, len(meta), array_bytes, crc)
    _atomic_write(path, [head, meta, *arrays])
    return len(head) + len(meta) + array_bytes


def read(path: str) -> Image:
    """Read and verify a checkpoint; raises CheckpointError saying what is wrong."""
    try:
        with open(path, "rb") as fh:
            return _read(fh, path, os.fstat(fh.fileno()).st_size)
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc.strerror}") from None


def _read(fh, path: str, size: int) -> Image:
    magic = fh.read(len(MAGIC))
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a distore checkpoint (no {MAGIC!r} header)")
    raw = fh.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise CheckpointError(f"{path} is truncated (its header is incomplete)")
    version, meta_len, array_bytes, crc = _HEADER.unpack(raw)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}; this distore-ucx reads version "
            f"{FORMAT_VERSION}. Restore it with the release that wrote it, or start without "
            "--restore"
        )
    body = size - len(MAGIC) - _HEADER.size
    if body != meta_len + array_bytes:
        raise CheckpointError(f"{path} is truncated or padded: {body} bytes after the header, "
                              f"the header says {meta_len + array_bytes}")
    meta = fh.read(meta_len)
    check = zlib.crc32(meta)
    try:
        doc = msgpack.unpackb(meta, raw=False)
        created, incarnation = float(doc["created"]), int(doc["incarnation"])
        store_id = str(doc.get("store_id", ""))
        nodes = None if "nodes" not in doc else {int(i): str(n) for i, n in doc["nodes"]}
        next_node_id = int(doc.get("next_node_id", 0))
        described = [(t, {n: int(t["lengths"].get(n, 0)) for n in _ARRAYS})
                     for t in doc["tables"]]
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{path}: metadata does not decode ({exc!r})") from None
    if sum(n * np.dtype(_ARRAYS[a]).itemsize for _, ls in described for a, n in ls.items()) \
            != array_bytes:
        raise CheckpointError(f"{path}: the arrays' lengths do not add up to the header's size")
    tables = []
    for t, lengths in described:
        arrays = {}
        for name, dt in _ARRAYS.items():
            a = np.empty(lengths[name], np.dtype(dt).newbyteorder("<"))
            if fh.readinto(memoryview(a).cast("B")) != a.nbytes:
                raise CheckpointError(f"{path} is truncated inside its arrays")
            check = zlib.crc32(memoryview(a).cast("B"), check)
            arrays[name] = a.astype(dt, copy=False)
        try:
            image = TableImage(dict(t["definition"]), int(t["inserts"]), int(t["samples"]),
                               int(t["deletes"]), int(t["next_seq"]), **arrays)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: a table entry is malformed ({exc!r})") from None
        if not (len(image.keys) == len(image.priorities) == len(image.times_sampled)
                == len(image.sequences)) or (len(image.episodes) and not (
                    len(image.keys) == len(image.episodes) == len(image.positions)
                    == len(image.step_flags))):
            raise CheckpointError(f"{path}: table {image.name!r} has item arrays of "
                                  "different lengths")
        tables.append(image)
    if check != crc:
        raise CheckpointError(f"{path} is corrupt (checksum mismatch); restore an older copy "
                              "or start without --restore")
    for image in tables:  # a valid checksum says nothing of a file made by hand
        _check_values(path, image)
    return Image(tables, created, incarnation, store_id, nodes, next_node_id)


def _check_values(path: str, t: TableImage) -> None:
    """Refuse a table whose values are outside their domain (CheckpointError)."""
    what = None
    if not isinstance(t.definition.get("name"), str):
        what = "has no table name"
    elif min(t.inserts, t.samples, t.deletes, t.next_seq) < 0:
        what = "has negative counters"
    elif not np.isfinite(t.priorities).all() or (t.priorities < 0).any():
        what = "has priorities that are not finite numbers >= 0 (NaN, inf or negative)"
    elif len(t.sequences) and int(t.sequences.max()) >= t.next_seq:
        what = "has insertion sequences at or past its next sequence number"
    elif len(t.keys) > 1 and (np.diff(np.sort(t.keys)) == 0).any():
        what = "has the same key twice"
    if what is not None:
        name = t.definition.get("name")
        raise CheckpointError(f"{path}: table {name!r} {what}; it was not written by "
                              "distore: restore an older copy or start without --restore")


def _atomic_write(path: str, chunks: list, what: str = "checkpoint") -> None:
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.writelines(chunks)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if os.path.exists(path):
            said = "the previous one is intact"
        elif not os.path.isdir(folder):
            said = (f"there is no {what} there yet, and its folder {folder} does not exist: "
                    "create it")
        else:
            said = f"there is no {what} there yet"
        raise CheckpointError(f"cannot write the {what} {path}: {exc.strerror}; {said}") from None
    dirfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


class IdState:
    """Counters that must not repeat across control-plane restarts.

    `incarnation` grows by one at each start; node ids and writer ids keep
    counting from where the previous run stopped. Without a path (no
    checkpoints) they live in memory only and the incarnation is random.
    """

    def __init__(self, path: str | None = None):
        self.path = path
        self.incarnation = secrets.randbits(16)
        self.next_node_id = 1
        self.next_writer_id = 1
        self.writer_ids_reserved = 1  # ids below this may have been handed out
        # Which store this is: written in its checkpoints, told to its nodes,
        # so neither is ever taken for another store's.
        self.store_id = secrets.token_hex(8)
        if path is not None:
            self._load()
            self.save()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            checkpoint = self.path[:-len(".ids")] if self.path.endswith(".ids") else None
            if checkpoint and os.path.exists(checkpoint):
                raise CheckpointError(
                    f"the checkpoint {checkpoint} has no id file {self.path} beside it; without "
                    "it, writer ids (the high bits of every key) would be handed out again: "
                    "restore the id file with the checkpoint, or remove the checkpoint to start "
                    "a new store (and restart every node empty)") from None
            self.incarnation = 1
            return
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"cannot read the id file {self.path} ({exc}); it keeps writer and node ids "
                "unique across restarts: restore it from a backup, or delete it together "
                "with the checkpoint and every node's data"
            ) from None
        try:
            self.incarnation = int(doc["incarnation"]) + 1
            self.next_node_id = int(doc["next_node_id"])
            # Everything reserved by the previous run may be in use.
            reserved = int(doc["writer_ids_reserved"])
            # Files of releases whose keys were `writer_id << 40 | seq`: writer w's
            # keys are those of the ids [w << 16, (w + 1) << 16) now.
            reserved <<= max(0, int(doc.get("key_bits", 40)) - KEY_BITS)
            self.next_writer_id = self.writer_ids_reserved = reserved
            self.store_id = str(doc.get("store_id") or self.store_id)  # older files: a new one
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the id file {self.path} is malformed ({exc!r})") from None

    def save(self) -> None:
        """Persist the counters (atomically); a no-op without a path."""
        if self.path is None:
            return
        doc = {"incarnation": self.incarnation, "next_node_id": self.next_node_id,
               "writer_ids_reserved": self.writer_ids_reserved, "key_bits": KEY_BITS,
               "store_id": self.store_id}
        _atomic_write(self.path, [json.dumps(doc).encode()], "id file")

    @staticmethod
    def store_of(path: str) -> str:
        """The store id in the id file at `path` ("" if it has none)."""
        try:
            with open(path, encoding="utf-8") as fh:
                return str(json.load(fh).get("store_id") or "")
        except (OSError, ValueError, AttributeError):
            return ""

    def writer_id(self) -> int:
        """A writer id never handed out before (by this run or an earlier one)."""
        wid = self.next_writer_id
        self.next_writer_id += 1
        if self.next_writer_id > self.writer_ids_reserved:
            self.writer_ids_reserved = wid + WRITER_ID_BLOCK
            self.save()
        return wid

    def node_id(self, wanted: int | None, in_use) -> int:
        """`wanted` (a re-registering node's old id) when `in_use(wanted)` is false
        and no later node could have got it; otherwise a fresh id."""
        if wanted is not None and 0 < wanted < self.next_node_id and not in_use(wanted):
            return wanted
        nid = self.next_node_id
        self.next_node_id += 1
        self.save()
        return nid


__all__ = ["FORMAT_VERSION", "MAGIC", "IdState", "Image", "TableImage", "read", "write"]
