"""Where an item's bytes are, as both the control plane and the storage
nodes read an item's location: the facts of the slot layout they share.

A cold item (one a node demoted to its disk tier, storage/tier.py) has the
top bit of its `offset` set (COLD); the rest is its disk slot. A disk slot,
and the copy of it staged in the arena for a sample, takes `stride_of` its
slot size: the slot and its checksum trailer (TRAILER bytes: CRC-32C and its
complement, checked on every read from disk) rounded up to the disk's 4 KiB
alignment. The control
plane counts room and staging space with it (control/room.py); the node
lays out its tier file and staging area with it.

Below control/, storage/ and client/: none of them imports another, and
this module imports nothing of theirs (no native code either).
"""

from __future__ import annotations

import numpy as np

COLD = np.uint64(1 << 63)  # the top bit of a cold item's offset
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
TRAILER = 8  # a disk slot's checksum trailer (native/checksum.cc)


def stride_of(slot_size: int) -> int:
    """Bytes a slot takes on disk and in the staging area: slot_size and its
    checksum trailer (TRAILER bytes) rounded up to 4 KiB."""
    return (slot_size + TRAILER + ALIGN - 1) // ALIGN * ALIGN


def is_cold(offsets: np.ndarray) -> np.ndarray:
    """Which offsets name disk slots."""
    return (np.asarray(offsets, np.uint64) & COLD) != 0
