"""Checkpoints of the control plane, and the ids that must never repeat.

A checkpoint holds, for every table, its definition and counters and, for
every item in it, key, priority, times sampled and insertion sequence (so
priorities, use counts and FIFO order come back), plus the keys of items
that had left the table but whose slots were still leased (their nodes
still hold them; they must not come back). It holds no locations: after a
restart the nodes re-register and re-send their slot lists, because a
node's slot table is the truth about bytes.

File format, version 1: ``MAGIC``, then a little-endian header (format
version u32, body length u64, CRC-32 of the body u32), then the body, one
msgpack map whose arrays are raw little-endian bytes. A checkpoint is
written to a temporary file in the same folder, flushed to disk, renamed
over the previous one, and the folder is flushed too: a crash leaves the
old checkpoint or the new one, never a torn file.

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
_HEADER = struct.Struct("<IQI")  # format version, body length, crc32(body)
WRITER_ID_BLOCK = 256  # writer ids reserved (and persisted) at a time

_ARRAYS = {"keys": np.uint64, "priorities": np.float64, "times_sampled": np.uint32,
           "sequences": np.uint64, "retired": np.uint64}


@dataclass
class TableImage:
    """One table in a checkpoint: definition, counters and its items.

    `definition` holds the create_table fields; the item arrays are in
    insertion order; `retired` holds keys of items that had left the table
    while a learner still leased their slots.
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

    @property
    def name(self) -> str:
        return self.definition["name"]

    def to_wire(self) -> dict[str, Any]:
        d = {"definition": self.definition, "inserts": self.inserts, "samples": self.samples,
             "deletes": self.deletes, "next_seq": self.next_seq}
        for name, dtype in _ARRAYS.items():
            little = np.dtype(dtype).newbyteorder("<")
            d[name] = np.ascontiguousarray(getattr(self, name), dtype=little).tobytes()
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any], where: str) -> TableImage:
        try:
            arrays = {name: np.frombuffer(d[name], dtype=np.dtype(dt).newbyteorder("<")).astype(dt)
                      for name, dt in _ARRAYS.items()}
            image = cls(dict(d["definition"]), int(d["inserts"]), int(d["samples"]),
                        int(d["deletes"]), int(d["next_seq"]), **arrays)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: a table entry is malformed ({exc!r})") from None
        n = len(image.keys)
        if not (len(image.priorities) == len(image.times_sampled) == len(image.sequences) == n):
            raise CheckpointError(f"{where}: table {image.name!r} has item arrays of "
                                  "different lengths")
        return image


@dataclass
class Image:
    """A whole checkpoint: when and by which run it was taken, and its tables."""

    tables: list[TableImage]
    created: float = field(default_factory=time.time)
    incarnation: int = 0

    @property
    def items(self) -> int:
        """Items in every table (retired keys not counted)."""
        return sum(len(t.keys) for t in self.tables)


def write(path: str, image: Image) -> int:
    """Write `image` to `path` atomically; returns the bytes written.

    Blocking: the control plane calls it on a worker thread.
    """
    body = msgpack.packb({
        "created": image.created,
        "incarnation": image.incarnation,
        "tables": [t.to_wire() for t in image.tables],
    }, use_bin_type=True)
    head = MAGIC + _HEADER.pack(FORMAT_VERSION, len(body), zlib.crc32(body))
    _atomic_write(path, [head, body])
    return len(head) + len(body)


def read(path: str) -> Image:
    """Read and verify a checkpoint; raises CheckpointError saying what is wrong."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc.strerror}") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a distore checkpoint (no {MAGIC!r} header)")
    off = len(MAGIC)
    if len(data) < off + _HEADER.size:
        raise CheckpointError(f"{path} is truncated (its header is incomplete)")
    version, length, crc = _HEADER.unpack_from(data, off)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}; this distore-ucx reads version "
            f"{FORMAT_VERSION}. Restore it with the release that wrote it, or start without "
            "--restore"
        )
    body = memoryview(data)[off + _HEADER.size:]
    if len(body) != length:
        raise CheckpointError(f"{path} is truncated or padded: {len(body)} body bytes, "
                              f"the header says {length}")
    if zlib.crc32(body) != crc:
        raise CheckpointError(f"{path} is corrupt (checksum mismatch); restore an older copy "
                              "or start without --restore")
    try:
        doc = msgpack.unpackb(body, raw=False)
        tables = [TableImage.from_wire(t, path) for t in doc["tables"]]
        return Image(tables, float(doc["created"]), int(doc["incarnation"]))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{path}: body does not decode ({exc!r})") from None


def _atomic_write(path: str, chunks: list[bytes]) -> None:
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
        raise CheckpointError(f"cannot write the checkpoint {path}: {exc.strerror}; the "
                              "previous one is intact") from None
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
        if path is not None:
            self._load()
            self.save()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
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
            self.next_writer_id = self.writer_ids_reserved = int(doc["writer_ids_reserved"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the id file {self.path} is malformed ({exc!r})") from None

    def save(self) -> None:
        """Persist the counters (atomically); a no-op without a path."""
        if self.path is None:
            return
        doc = {"incarnation": self.incarnation, "next_node_id": self.next_node_id,
               "writer_ids_reserved": self.writer_ids_reserved}
        _atomic_write(self.path, [json.dumps(doc).encode()])

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
