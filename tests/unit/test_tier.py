"""The disk tier: its file (header checks), its batched slot I/O, the
staging area, and the control plane's demotion choices and moves."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx._native_loader import _native
from distore_ucx.control.tables import Table
from distore_ucx.control.tiers import Demotions, apply_moves, pick_demotions
from distore_ucx.errors import StorageFull
from distore_ucx.slot_format import COLD, is_cold, stride_of
from distore_ucx.spec import TableSpec
from distore_ucx.storage.tier import (
    BOUNCE_CHUNK,
    HEADER_BYTES,
    DiskTier,
    StagingArea,
    TierFileError,
    bounce_reads,
)
from distore_ucx.table_definition import TableDefinition
from distore_ucx.transport import UcxRuntime

MiB = 1 << 20


def test_a_new_tier_file_is_preallocated_with_a_header(tmp_path):
    path = str(tmp_path / "t.tier")
    tier = DiskTier(path, 4 * MiB, "n0", arena_id=7)
    tier.close()
    assert os.path.getsize(path) == HEADER_BYTES + 4 * MiB
    with open(path, "rb") as fh:
        assert fh.read(8) == b"DSTIER\x00\x01"
    DiskTier(path, 4 * MiB, "n1", arena_id=8).close()  # our own file: reused


def test_a_file_that_is_not_a_tier_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"precious user data" * 1000)
    with pytest.raises(TierFileError, match="not a distore tier file.*left untouched"):
        DiskTier(str(path), 4 * MiB, "n0", arena_id=1)
    assert path.read_bytes() == b"precious user data" * 1000


def test_a_corrupt_header_is_refused(tmp_path):
    path = str(tmp_path / "t.tier")
    DiskTier(path, 4 * MiB, "n0", arena_id=1).close()
    with open(path, "r+b") as fh:
        fh.seek(20)
        fh.write(b"\xff\xff")
    with pytest.raises(TierFileError, match="corrupt header.*remove it"):
        DiskTier(path, 4 * MiB, "n0", arena_id=1)


def test_a_truncated_file_is_refused(tmp_path):
    path = str(tmp_path / "t.tier")
    DiskTier(path, 4 * MiB, "n0", arena_id=1).close()
    os.truncate(path, HEADER_BYTES + MiB)
    with pytest.raises(TierFileError, match="truncated.*header says"):
        DiskTier(path, 4 * MiB, "n0", arena_id=1)
    os.truncate(path, 100)
    with pytest.raises(TierFileError, match="truncated"):
        DiskTier(path, 4 * MiB, "n0", arena_id=1)


def test_one_tier_file_serves_one_node_at_a_time(tmp_path):
    path = str(tmp_path / "t.tier")
    first = DiskTier(path, 4 * MiB, "n0", arena_id=1)
    try:
        with pytest.raises(TierFileError, match="in use by another storage node"):
            DiskTier(path, 4 * MiB, "n1", arena_id=2)
    finally:
        first.close()


def test_disk_slots_are_allocated_until_full_then_reused(tmp_path):
    tier = DiskTier(str(tmp_path / "t.tier"), MiB, "n0", arena_id=1)
    try:
        assert stride_of(5000) == 8192 and tier.room("t", 5000) == 128
        a = tier.allocate("t", 5000, 100)
        assert (a % 4096 == 0).all() and len(np.unique(a)) == 100
        with pytest.raises(StorageFull, match="arena and disk tier both full.*--disk-size"):
            tier.allocate("t", 5000, 29)
        tier.commit("t", a, a + np.uint64(1), a + np.uint64(2), np.ones(100))
        tier.free("t", a[:10] | COLD)
        assert tier.room("t", 5000) == 38
        keys, offsets, _, _ = tier.live("t")
        assert len(keys) == 90 and is_cold(offsets).all()
    finally:
        tier.close()


def test_staging_area_spans_free_extents_and_merges_them_back():
    area = StagingArea(10 * 4096)
    first, ex1 = area.take(4, 4096)
    second, ex2 = area.take(4, 4096)
    assert area.take(3, 4096) is None  # 2 pages left
    assert area.give(ex1[0])
    offsets, extents = area.take(5, 4096)  # 4 freed pages at the bottom + 1 at the top
    assert len(extents) == 2 and len(set(offsets.tolist()) & set(second.tolist())) == 0
    for start in ex2 + extents:
        assert area.give(start)
    assert area.used_bytes == 0 and area.take(10, 4096) is not None
    assert not area.give(12345)


def test_a_batch_that_fits_one_free_extent_is_staged_in_it_whole():
    # A cold slice read as one run lands in one piece: a batch is spread over
    # extents only when no single one holds it.
    area = StagingArea(12 * 4096)
    _, low = area.take(2, 4096)
    area.take(3, 4096)
    _, mid = area.take(4, 4096)
    assert area.give(low[0]) and area.give(mid[0])  # free: pages 0-1, 5-8, 9-11
    offsets, extents = area.take(3, 4096)  # not pages 0-1 and 5: pages 5-7
    assert extents == [5 * 4096] and offsets.tolist() == [5 * 4096, 6 * 4096, 7 * 4096]
    offsets, extents = area.take(4, 4096)  # no extent holds 4 (0-1, 8-11 merged: 4!)
    assert offsets.tolist() == [8 * 4096 + i * 4096 for i in range(4)]
    offsets, extents = area.take(2, 4096)
    assert offsets.tolist() == [0, 4096]


def test_disk_slots_freed_in_any_order_are_handed_out_ascending(tmp_path):
    # Items written in order (a slice's steps) then follow each other on disk
    # wherever the free slots do.
    tier = DiskTier(str(tmp_path / "t.tier"), MiB, "n0", arena_id=1)
    try:
        a = tier.allocate("t", 5000, 16)
        tier.commit("t", a, a, a, np.ones(16))
        tier.free("t", a[[9, 3, 8, 4, 7, 5, 6]])
        tier.free("t", a[[12, 11, 10]])
        got = tier.allocate("t", 5000, 12)
        assert (np.diff(got.astype(np.int64)) > 0).all()
        assert got[:7].tolist() == a[3:10].tolist()
    finally:
        tier.close()


@pytest.fixture
def arena():
    with UcxRuntime(config={"TLS": "tcp"}) as rt:
        region = rt.map_region(4 * MiB, remote_read=True)
        yield region
        del region


@pytest.mark.parametrize("bounce_chunk", [0, 4 * MiB, 4096],
                         ids=["direct", "bounce", "bounce_in_4k_chunks"])
def test_slots_written_to_disk_read_back_with_new_headers(tmp_path, arena, bounce_chunk,
                                                          monkeypatch):
    tier = DiskTier(str(tmp_path / "t.tier"), 4 * MiB, "n0", arena_id=1)
    if bounce_chunk:  # read through hugepage buffers, a slot in one chunk or in two
        tier.bounce = True
        monkeypatch.setattr("distore_ucx.storage.tier.BOUNCE_CHUNK", bounce_chunk)
    try:
        slot = 5000
        view = arena.view()
        rng = np.random.default_rng(3)
        view[: 8 * slot] = rng.integers(0, 256, 8 * slot, dtype=np.uint8)
        src = np.arange(8, dtype=np.uint64) * np.uint64(slot)
        keys = np.arange(100, 108, dtype=np.uint64)
        gens = np.arange(500, 508, dtype=np.uint64)
        disk = tier.allocate("t", slot, 8)
        assert (tier.write(arena, src, slot, disk, keys, gens) == 0).all()
        # Read back into the upper half, 4 KiB aligned, one stride apart.
        dest = np.uint64(2 * MiB) + np.arange(8, dtype=np.uint64) * np.uint64(stride_of(slot))
        statuses = tier.read(disk | COLD, slot, arena, dest, keys, gens)
        assert (statuses == 0).all()
        for i in range(8):
            got = view[int(dest[i]): int(dest[i]) + slot]
            header = got[:16].view(np.uint64)
            assert header[0] == keys[i] and header[1] == gens[i]
            assert np.array_equal(got[16:], view[i * slot + 16: (i + 1) * slot])
        # Asking for another generation (an older location) is refused, header zeroed.
        wrong = gens.copy()
        wrong[3] += 1
        statuses = tier.read(disk, slot, arena, dest, keys, wrong)
        assert statuses[3] == _native.STATUS_STALE and (np.delete(statuses, 3) == 0).all()
        assert (view[int(dest[3]): int(dest[3]) + 16] == 0).all()
        # A slot overwritten on disk behind our back is caught by its checksum.
        fd = os.open(tier.path, os.O_WRONLY)
        os.pwrite(fd, b"\x01" * 16, HEADER_BYTES + int(disk[5]))
        os.close(fd)
        statuses = tier.read(disk, slot, arena, dest, keys, gens)
        assert statuses[5] == _native.STATUS_CORRUPT
        # So is one flipped bit of a payload, in any slot of the batch (issue
        # 33: 957 of 1,200 sampled items were wrong with payloads flipped).
        fd = os.open(tier.path, os.O_RDWR)
        for i, at in ((1, 16), (2, slot - 1), (6, 4000)):
            where = HEADER_BYTES + int(disk[i]) + at
            byte = os.pread(fd, 1, where)[0]
            os.pwrite(fd, bytes([byte ^ 0x04]), where)
        os.close(fd)
        statuses = tier.read(disk, slot, arena, dest, keys, gens)
        bad = np.isin(np.arange(8), [1, 2, 5, 6])
        assert (statuses[bad] == _native.STATUS_CORRUPT).all() and (statuses[~bad] == 0).all()
        for i in np.flatnonzero(bad):  # no reader can take them for their items
            assert (view[int(dest[i]): int(dest[i]) + 16] == 0).all()
        # Reading past the end of a truncated file is an I/O error, not data.
        os.truncate(tier.path, HEADER_BYTES + int(disk[0]) + 4096)
        statuses = tier.read(disk[:2], slot, arena, dest[:2], keys[:2], gens[:2])
        assert statuses[0] == 5  # EIO: the slot ends past the end of the file
    finally:
        tier.close()


def test_reads_go_through_hugepage_buffers_unless_the_arena_is_contiguous(monkeypatch):
    monkeypatch.delenv("DISTORE_DISK_BOUNCE", raising=False)
    assert bounce_reads(contiguous=False) is True  # 4 KiB or shared-memory THP arenas
    assert bounce_reads(contiguous=True) is False  # reserved hugepages: read straight in
    monkeypatch.setenv("DISTORE_DISK_BOUNCE", "0")
    assert bounce_reads(contiguous=False) is False
    monkeypatch.setenv("DISTORE_DISK_BOUNCE", "1")
    assert bounce_reads(contiguous=True) is True
    monkeypatch.setenv("DISTORE_DISK_BOUNCE", "sometimes")
    with pytest.raises(ds.ConfigError, match="DISTORE_DISK_BOUNCE"):
        bounce_reads(contiguous=False)


def test_a_disk_reader_chunk_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 4096"):
        _native.DiskReader(4, 1000)


@pytest.mark.parametrize("chunk", [0, 8192], ids=["direct", "bounce"])
def test_batches_read_from_several_threads_at_once_all_come_back_whole(tmp_path, arena, chunk):
    # The node's two disk threads share one reader: their batches queue
    # behind each other and each call returns its own batch, complete.
    tier = DiskTier(str(tmp_path / "t.tier"), 2 * MiB, "n0", arena_id=1)
    reader = _native.DiskReader(3, chunk)
    try:
        slot, n = 20_000, 16  # 5 pages on disk: 3 chunks of 8 KiB through the bounce memory
        stride = stride_of(slot)
        view = arena.view()
        view[: n * slot] = np.random.default_rng(5).integers(0, 256, n * slot, dtype=np.uint8)
        want = view[: n * slot].reshape(n, slot).copy()
        keys = np.arange(1, n + 1, dtype=np.uint64)
        gens = keys + np.uint64(50)
        disk = tier.allocate("t", slot, n)
        assert (tier.write(arena, np.arange(n, dtype=np.uint64) * np.uint64(slot), slot, disk,
                           keys, gens) == 0).all()
        data = (disk & ~COLD) + np.uint64(HEADER_BYTES)
        base = 2 * MiB - 4 * n * stride  # four destinations, one per caller
        errors = []

        def read(caller: int) -> None:
            order = np.random.default_rng(caller).permutation(n)
            dest = np.uint64(base + caller * n * stride) + np.arange(n, dtype=np.uint64) * \
                np.uint64(stride)
            for _ in range(20):
                got = reader.read(tier.fd, data[order], stride, arena, dest, keys[order],
                                  gens[order])
                if not (got == 0).all():
                    errors.append(got)
                    return
                for row, item in enumerate(order):
                    start = int(dest[row])
                    slot_bytes = view[start + 16: start + slot]
                    if not np.array_equal(slot_bytes, want[item, 16:]):
                        errors.append(f"caller {caller}: item {item} wrong")
                        return

        threads = [threading.Thread(target=read, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert reader.threads == 3 and reader.chunk == chunk
    finally:
        reader = None  # its threads end
        tier.close()


SPEC = TableSpec.parse(((8,), "uint8"))


def fill(table, n, node=1, priorities=None):
    keys = np.arange(1, n + 1, dtype=np.uint64)
    prios = np.ones(n) if priorities is None else priorities
    table.add(node, keys, keys * np.uint64(64), keys + np.uint64(1000), prios)
    return keys


def test_demotion_picks_the_oldest_unleased_hot_items_of_the_node():
    t = Table.make("t", 100, SPEC)
    fill(t, 10)
    t.add(2, np.array([50], np.uint64), np.array([0], np.uint64), np.array([1], np.uint64),
          np.ones(1))
    recs = t.core.lookup(np.array([1, 2], np.uint64))
    t.lease(recs)  # the two oldest are leased: skipped
    keys, offsets, gens = pick_demotions(t, 1, 3)
    assert sorted(keys.tolist()) == [3, 4, 5]
    assert (offsets == keys * np.uint64(64)).all() and (gens == keys + np.uint64(1000)).all()


def test_prioritized_tables_demote_the_lowest_priorities():
    t = Table.make("t", 100, SPEC, sampler=ds.Prioritized(1.0))
    fill(t, 10, priorities=np.array([5, 1, 9, 0.5, 7, 3, 8, 2, 6, 4], float))
    keys, _, _ = pick_demotions(t, 1, 3)
    assert sorted(keys.tolist()) == [2, 4, 8]


def test_a_move_is_taken_only_while_the_record_is_unchanged_and_unleased():
    t = Table.make("t", 100, SPEC)
    keys = fill(t, 6)
    old = keys * np.uint64(64)
    gens = keys + np.uint64(1000)
    t.lease(t.core.lookup(keys[1:2]))  # sampled meanwhile: stays in DRAM
    t.update_priorities(keys[:1], np.array([3.0]))  # a priority change is no move
    gens[2] += 1  # the node copied another generation than the table knows
    new = (np.arange(6, dtype=np.uint64) * np.uint64(4096)) | COLD
    taken = apply_moves(t, 1, keys, old, gens, new, np.arange(6, dtype=np.uint64) + 9000)
    assert taken.tolist() == [True, False, False, True, True, True]
    s = t.store
    recs = t.core.lookup(keys)
    assert is_cold(s.offset[recs]).tolist() == taken.tolist()
    assert s.generation[recs[0]] == 9000
    # The sampler's view is unchanged: every item is still there.
    assert t.size == 6
    # A key evicted meanwhile is not taken either.
    t2 = Table.make("t2", 100, SPEC)
    assert not apply_moves(t2, 1, keys[:1], old[:1], gens[:1], new[:1], new[:1]).any()


def test_a_failed_disk_write_is_a_status_per_slot_not_data(tmp_path, arena):
    tier = DiskTier(str(tmp_path / "t.tier"), MiB, "n0", arena_id=1)
    try:
        disk = tier.allocate("t", 5000, 2)
        good_fd = tier.fd
        tier.fd = os.open(tier.path, os.O_RDONLY)  # writes fail: EBADF
        try:
            statuses = tier.write(arena, np.array([0, 8192], np.uint64), 5000, disk,
                                  np.array([1, 2], np.uint64), np.array([3, 4], np.uint64))
        finally:
            os.close(tier.fd)
            tier.fd = good_fd
        assert (statuses == 9).all()  # EBADF, reported per slot
        # Nothing was written: reading the slots back finds no such items.
        dest = np.array([2 * MiB, 2 * MiB + 8192], np.uint64)
        back = tier.read(disk, 5000, arena, dest, np.array([1, 2], np.uint64),
                         np.array([3, 4], np.uint64))
        assert np.isin(back, [_native.STATUS_STALE, _native.STATUS_CORRUPT]).all()
    finally:
        tier.close()


def test_demotions_hand_out_one_scans_candidates_in_order_and_recheck_them():
    """One scan serves many requests, oldest first; a candidate evicted (its
    record reused by a newer item), leased or moved since the scan is
    skipped; the next scan comes when the candidates run out."""
    t = Table.make("t", 10_000, SPEC)
    keys = fill(t, 10_000)
    d = Demotions()
    got, _, _ = d.pick(t, 1, 64)
    assert got.tolist() == list(range(1, 65)) and d.scans == 1
    # Since the scan: 70 new items evict keys 1-70 (FIFO) and reuse their
    # records; 71 is leased; 72 moved to disk.
    new = np.arange(20_001, 20_071, dtype=np.uint64)
    t.add(1, new, new * np.uint64(64), new, np.ones(70))
    assert len(t.core.lookup(keys[:70])[t.core.lookup(keys[:70]) >= 0]) == 0
    t.lease(t.core.lookup(keys[70:71]))
    t.store.offset[t.core.lookup(keys[71:72])] |= COLD
    got, offsets, _ = d.pick(t, 1, 10)
    assert got.tolist() == list(range(73, 83)) and d.scans == 1
    assert (offsets == got * np.uint64(64)).all()
    t.store.offset[t.core.lookup(got)] |= COLD  # the node moved them
    # The scan kept max(16 x 64, 4096, 10_000 // 64) = 4096 candidates: asking
    # for more than are left scans again, once, and goes on in order.
    got, _, _ = d.pick(t, 1, 5000)
    assert d.scans == 2 and len(got) == 5000
    assert (np.diff(got.astype(np.int64)) > 0).all() and got[0] == 83
    # Another node's items are never named; a node that left is forgotten.
    assert len(d.pick(t, 2, 10)[0]) == 0
    d.forget(node_id=1)
    d.pick(t, 1, 1)
    assert d.scans == 4


def test_demotions_of_prioritized_tables_go_lowest_priority_first():
    t = Table.make("t", 10_000, SPEC, sampler=ds.Prioritized(1.0))
    prios = np.random.default_rng(0).random(5000) + 0.01
    keys = fill(t, 5000, priorities=prios)
    d = Demotions()
    got = np.concatenate([d.pick(t, 1, 100)[0] for _ in range(5)])
    assert got.tolist() == keys[np.argsort(prios, kind="stable")[:500]].tolist()


def test_a_disk_size_the_disk_cannot_hold_leaves_no_file_behind(tmp_path):
    path = tmp_path / "t.tier"
    with pytest.raises(TierFileError, match="cannot preallocate.*smaller --disk-size"):
        DiskTier(str(path), 1 << 60, "n0", arena_id=1)  # an exabyte: refused
    assert not path.exists()
    # A tier file that was there before is the operator's: refused, not removed.
    DiskTier(str(path), 4 * MiB, "n0", arena_id=1).close()
    with pytest.raises(TierFileError, match="cannot preallocate"):
        DiskTier(str(path), 1 << 60, "n0", arena_id=1)
    assert path.exists()


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit, as the standard defines it."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_slot_checksum_is_crc32c_at_every_length_and_split():
    assert _native.crc32c(b"123456789") == 0xE3069283  # the standard check value
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    # Short lengths take one stream, long ones three combined (12 KiB and up).
    for n in (0, 1, 7, 8, 9, 63, 4095, 12_287, 12_288, 12_289, 12_295, 40_000):
        assert _native.crc32c(data[:n]) == crc32c_reference(data[:n]), n
    # Continued from an earlier CRC: the same as one pass over both.
    whole = _native.crc32c(data)
    for cut in (1, 5000, 20_000, 39_999):
        assert _native.crc32c(data[cut:], _native.crc32c(data[:cut])) == whole, cut


# -- runs: slots that follow each other on disk, read together ---------------


@pytest.fixture
def on_disk(tmp_path, arena):
    """8 slots of 20,000 bytes (5 pages on disk) written in a row, and what
    they hold: (tier, disk offsets, keys, generations, wanted bytes)."""
    tier = DiskTier(str(tmp_path / "t.tier"), 2 * MiB, "n0", arena_id=1)
    slot, n = 20_000, 8
    view = arena.view()
    view[: n * slot] = np.random.default_rng(11).integers(0, 256, n * slot, dtype=np.uint8)
    want = view[: n * slot].reshape(n, slot)[:, 16:].copy()
    keys = np.arange(1, n + 1, dtype=np.uint64)
    gens = keys + np.uint64(70)
    disk = tier.allocate("t", slot, n)
    assert (np.diff(disk.astype(np.int64)) == stride_of(slot)).all()  # one run on disk
    assert (tier.write(arena, np.arange(n, dtype=np.uint64) * np.uint64(slot), slot, disk, keys,
                       gens) == 0).all()
    yield tier, (disk & ~COLD) + np.uint64(HEADER_BYTES), keys, gens, want
    tier.close()


def read_run(reader, tier, arena, data, keys, gens, dest):
    """Statuses of one batch through `reader`, and the read calls it took."""
    before = reader.reads
    statuses = reader.read(tier.fd, data, stride_of(20_000), arena, dest, keys, gens)
    return statuses, reader.reads - before


def staged(arena, dest, rows) -> np.ndarray:
    view = arena.view()
    return np.stack([view[int(d) + 16: int(d) + 20_000] for d in dest[rows]])


@pytest.mark.parametrize("chunk", [0, BOUNCE_CHUNK], ids=["direct", "bounce"])
def test_a_run_of_slots_is_read_with_one_read(on_disk, arena, chunk):
    tier, data, keys, gens, want = on_disk
    stride = stride_of(20_000)
    reader = _native.DiskReader(3, chunk)
    dest = np.uint64(MiB) + np.arange(8, dtype=np.uint64) * np.uint64(stride)
    statuses, reads = read_run(reader, tier, arena, data, keys, gens, dest)
    assert (statuses == 0).all() and reads == 1
    assert np.array_equal(staged(arena, dest, slice(None)), want)
    # Out of disk order the batch is as many runs as it has breaks: 0-2, 5-6, 3.
    order = np.array([0, 1, 2, 5, 6, 3])
    statuses, reads = read_run(reader, tier, arena, data[order], keys[order], gens[order],
                               dest[:6])
    assert (statuses == 0).all() and reads == 3
    assert np.array_equal(staged(arena, dest[:6], slice(None)), want[order])


@pytest.mark.parametrize("chunk", [0, 8192], ids=["direct", "bounce"])
def test_a_corrupt_slot_inside_a_run_fails_alone(on_disk, arena, chunk):
    tier, data, keys, gens, want = on_disk
    stride = stride_of(20_000)
    reader = _native.DiskReader(3, chunk)
    dest = np.uint64(MiB) + np.arange(8, dtype=np.uint64) * np.uint64(stride)
    fd = os.open(tier.path, os.O_RDWR)
    try:  # one flipped bit in slot 3 (through 8 KiB chunks: one shared with slot 2)
        where = int(data[3]) + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x10]), where)
    finally:
        os.close(fd)
    wrong = gens.copy()
    wrong[6] += 1  # and slot 6 asked for with an older generation
    statuses, reads = read_run(reader, tier, arena, data, keys, wrong, dest)
    assert statuses[3] == _native.STATUS_CORRUPT and statuses[6] == _native.STATUS_STALE
    ok = ~np.isin(np.arange(8), [3, 6])
    assert (statuses[ok] == 0).all()
    assert np.array_equal(staged(arena, dest, ok), want[ok])
    view = arena.view()
    for i in (3, 6):  # no reader can take them for their items
        assert (view[int(dest[i]): int(dest[i]) + 16] == 0).all()
    assert reads == (1 if chunk == 0 else -(-8 * stride // chunk))  # no read again


@pytest.mark.parametrize("chunk", [0, 8192], ids=["direct", "bounce"])
def test_an_io_error_inside_a_run_fails_only_the_slots_it_is_in(on_disk, arena, chunk):
    tier, data, keys, gens, want = on_disk
    stride = stride_of(20_000)
    reader = _native.DiskReader(2, chunk)
    dest = np.uint64(MiB) + np.arange(8, dtype=np.uint64) * np.uint64(stride)
    os.truncate(tier.path, int(data[5]) + 4096)  # the file ends inside slot 5
    statuses, reads = read_run(reader, tier, arena, data, keys, gens, dest)
    assert (statuses[:5] == 0).all() and (statuses[5:] == 5).all()  # EIO past the end
    assert np.array_equal(staged(arena, dest, slice(0, 5)), want[:5])
    assert reads > 1  # the failed read again, slot by slot


def test_a_run_through_the_bounce_memory_is_read_a_chunk_at_a_time(on_disk, arena):
    # 8 slots of 5 pages, 40 pages, in chunks of 3 pages: 14 reads (one slot
    # at a time took 8 x 2); slots cut by chunk boundaries come back whole.
    tier, data, keys, gens, want = on_disk
    stride = stride_of(20_000)
    reader = _native.DiskReader(4, 3 * 4096)
    dest = np.uint64(MiB) + np.arange(8, dtype=np.uint64) * np.uint64(stride)
    statuses, reads = read_run(reader, tier, arena, data, keys, gens, dest)
    assert (statuses == 0).all() and reads == 14
    assert np.array_equal(staged(arena, dest, slice(None)), want)


@pytest.mark.parametrize("chunk", [0, BOUNCE_CHUNK], ids=["direct", "bounce"])
def test_a_run_whose_destinations_are_apart_is_still_one_read(on_disk, arena, chunk):
    # Straight into dest that is one preadv of the run's pieces (slots 0-1,
    # 2-4, 5, 6-7 each in a row), through the bounce memory one pread.
    tier, data, keys, gens, want = on_disk
    stride = stride_of(20_000)
    rows = np.array([0, 1, 3, 4, 5, 7, 9, 10])  # places in the arena's upper half
    dest = np.uint64(MiB) + rows.astype(np.uint64) * np.uint64(stride)
    reader = _native.DiskReader(3, chunk)
    statuses, reads = read_run(reader, tier, arena, data, keys, gens, dest)
    assert (statuses == 0).all() and reads == 1
    assert np.array_equal(staged(arena, dest, slice(None)), want)


def test_a_slice_tables_demotions_go_to_disk_by_episode_and_position():
    # Four envs' steps arrive interleaved (one step of each per batch); the
    # oldest 16 go to disk grouped by episode, in position order, so each
    # episode's steps follow each other on disk.
    t = Table(TableDefinition.make("s", 100, SPEC, slice_len=4), seed=1)
    for p in range(6):
        keys = np.arange(4, dtype=np.uint64) + np.uint64(10 * p + 1)
        t.add(1, keys, keys * np.uint64(64), keys, np.ones(4),
              (np.arange(4, dtype=np.uint64) + np.uint64(100), np.full(4, p, np.uint32),
               np.zeros(4, np.uint8)))
    for picked in (Demotions().pick(t, 1, 16)[0], pick_demotions(t, 1, 16)[0]):
        recs = t.core.lookup(picked)
        assert t.slices.episode(recs).tolist() == np.repeat([100, 101, 102, 103], 4).tolist()
        assert t.slices.position(recs).tolist() == [0, 1, 2, 3] * 4
