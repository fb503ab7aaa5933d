"""The node's pull of a writer's staged batch into arena slots (native/pull.cc,
native/staging.cc).

In one process: the 'writer' staging buffer and the arena both live here, and
the node side reads them by pid (process_vm_readv), as it does a same-host
writer's when mapping is off, or from a read-only mapping of the buffer's
sealed memfd, as it does when the writer handed it over.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from distore_ucx._native_loader import _native
from distore_ucx.errors import OutOfBoundsError
from distore_ucx.storage.arena import Arena
from distore_ucx.storage.pulls import Source
from distore_ucx.transport import UcxRuntime

ITEM, SLOT = 1000, 1024


@pytest.fixture(scope="module")
def runtime():
    with UcxRuntime() as rt:
        yield rt


@pytest.fixture
def staged(runtime):
    region = _native.MemoryRegion.write_protected(runtime.region_owner, 1 << 16)
    rows = np.random.default_rng(0).integers(0, 256, (8, ITEM), dtype=np.uint8)
    region.view()[: rows.size] = rows.ravel()
    return region, rows


def pull(arena, region, pid, slots, offsets, lengths=None):
    n = len(slots)
    src = Source("self", "cma", region.address, region.size, pid=pid)
    keys = np.arange(100, 100 + n, dtype=np.uint64)
    gens = arena.next_generations(n)
    lengths = np.full(n, ITEM, np.uint64) if lengths is None else lengths
    statuses = arena.pull(src, slots, keys, gens, np.uint64(region.address) + offsets, lengths,
                          5.0)
    return statuses, keys, gens


def headers(arena, slots):
    view = arena.region.view()
    return np.stack([view[s : s + 16].view(np.uint64) for s in slots.astype(np.int64)])


def test_items_land_after_the_header_and_the_header_comes_last(runtime, staged):
    import os

    region, rows = staged
    arena = Arena(runtime, 1 << 20)
    slots = np.arange(8, dtype=np.uint64)[::-1] * np.uint64(SLOT)  # any order
    statuses, keys, gens = pull(arena, region, os.getpid(), slots,
                                np.arange(8, dtype=np.uint64) * np.uint64(ITEM))
    assert not statuses.any()
    view = arena.region.view()
    for i, s in enumerate(slots.astype(np.int64)):
        assert np.array_equal(view[s + 16 : s + 16 + ITEM], rows[i])
    assert np.array_equal(headers(arena, slots), np.stack([keys, gens], axis=1))
    assert (np.diff(gens) == 1).all() and (arena.next_generations(1) > gens.max()).all()


def test_a_source_range_outside_the_buffer_is_refused_before_any_write(runtime, staged):
    import os

    region, _ = staged
    arena = Arena(runtime, 1 << 20)
    arena.region.view()[:SLOT] = 7
    slots = np.zeros(1, np.uint64)
    with pytest.raises(OutOfBoundsError, match="staging buffer"):
        pull(arena, region, os.getpid(), slots, np.array([region.size - 10], np.uint64))
    with pytest.raises(OutOfBoundsError, match="arena"):
        pull(arena, region, os.getpid(), np.array([(1 << 20) - 100], np.uint64),
             np.zeros(1, np.uint64))
    assert (arena.region.view()[:SLOT] == 7).all()  # not even the header was touched


def test_a_dead_writer_fails_the_read_and_leaves_headers_invalid(runtime, staged):
    region, _ = staged
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped: its pid names no process now
    arena = Arena(runtime, 1 << 20)
    arena.region.view()[: 4 * SLOT] = 9
    slots = np.arange(4, dtype=np.uint64) * np.uint64(SLOT)
    statuses, _, _ = pull(arena, region, dead.pid, slots,
                          np.arange(4, dtype=np.uint64) * np.uint64(ITEM))
    assert (statuses != 0).all()
    assert (headers(arena, slots) == 0).all()  # invalid: (key 0, generation 0)


# -- the same-host mapped path: a writer's sealed staging memfd, mapped read-only

def pull_mapped(arena, region, mapping, slots, offsets, pool=None):
    n = len(slots)
    src = Source("self", "mapped", region.address, mapping.size, mapping=mapping)
    keys = np.arange(200, 200 + n, dtype=np.uint64)
    gens = arena.next_generations(n)
    statuses = arena.pull_mapped(src, slots, keys, gens, offsets, np.full(n, ITEM, np.uint64),
                                 pool)
    return statuses, keys, gens


@pytest.mark.parametrize("helpers", [0, 1])
def test_mapped_items_land_after_the_header_and_the_header_comes_last(runtime, staged,
                                                                       helpers):
    region, rows = staged
    mapping = _native.StagingMap(region.share_fd, region.size, "self")
    arena = Arena(runtime, 1 << 20)
    slots = np.arange(8, dtype=np.uint64)[::-1] * np.uint64(SLOT)
    pool = _native.CopyPool(helpers) if helpers else None
    import distore_ucx.storage.arena as arena_mod

    # A tiny threshold so that the pool splits even this small batch.
    old, arena_mod.PARALLEL_COPY_BYTES = arena_mod.PARALLEL_COPY_BYTES, 1
    try:
        statuses, keys, gens = pull_mapped(arena, region, mapping, slots,
                                           np.arange(8, dtype=np.uint64) * np.uint64(ITEM), pool)
    finally:
        arena_mod.PARALLEL_COPY_BYTES = old
    assert not statuses.any()
    view = arena.region.view()
    for i, s in enumerate(slots.astype(np.int64)):
        assert np.array_equal(view[s + 16 : s + 16 + ITEM], rows[i])
    assert np.array_equal(headers(arena, slots), np.stack([keys, gens], axis=1))


def test_a_mapped_range_outside_the_staging_buffer_is_refused_before_any_write(runtime, staged):
    region, _ = staged
    mapping = _native.StagingMap(region.share_fd, region.size, "self")
    arena = Arena(runtime, 1 << 20)
    arena.region.view()[:SLOT] = 7
    for offset in (region.size - 10, 2**63):
        with pytest.raises(OutOfBoundsError, match="staging buffer"):
            pull_mapped(arena, region, mapping, np.zeros(1, np.uint64),
                        np.array([offset], np.uint64))
    with pytest.raises(OutOfBoundsError, match="arena"):
        pull_mapped(arena, region, mapping, np.array([(1 << 20) - 100], np.uint64),
                    np.zeros(1, np.uint64))
    assert (arena.region.view()[:SLOT] == 7).all()  # not even the header was touched


def test_only_a_memfd_sealed_against_shrinking_and_writes_is_mapped(runtime):
    import os

    from distore_ucx.errors import InvalidArgument

    fd = os.memfd_create("plain", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 16)
    try:
        with pytest.raises(InvalidArgument, match="sealed"):
            _native.StagingMap(fd, 1 << 16, "w")  # could shrink: a read could SIGBUS
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
        with pytest.raises(OutOfBoundsError, match="smaller"):
            _native.StagingMap(fd, 1 << 17, "w")
        assert _native.StagingMap(fd, 1 << 16, "w").size == 1 << 16
    finally:
        os.close(fd)
    with open("/proc/self/exe", "rb") as exe, pytest.raises(InvalidArgument, match="memfd"):
        _native.StagingMap(exe.fileno(), 4096, "w")  # not a memfd at all


def test_mapping_a_staging_buffer_allocates_no_page_the_writer_left_unwritten(runtime):
    # A writer of small items writes a few KB of its 8 MiB buffers: mapping
    # one with its pages populated allocated (and zeroed) the other 8 MiB on
    # every hand-off (8 GiB on a node for 256 writers, 15 ms a hand-off).
    import os

    region = _native.MemoryRegion.write_protected(runtime.region_owner, 8 << 20)
    if region.page_kind == "hugetlb":
        pytest.skip("the staging buffer has reserved hugepages here (those are populated)")
    region.view()[:21000] = 7
    written = os.fstat(region.share_fd).st_blocks
    mapping = _native.StagingMap(region.share_fd, region.size, "w")
    assert os.fstat(region.share_fd).st_blocks == written < (8 << 20) // 512
    assert bytes(memoryview_at(mapping.address, 21000)) == b"\7" * 21000


def memoryview_at(address: int, n: int):
    import ctypes

    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")


def test_a_mapping_outlives_its_writer(runtime):
    """The writer's region (its mapping and fd) goes away, as when it dies:
    the node's mapping still holds the pages and the copy completes."""
    region = _native.MemoryRegion.write_protected(runtime.region_owner, 1 << 16)
    rows = np.random.default_rng(1).integers(0, 256, (4, ITEM), dtype=np.uint8)
    region.view()[: rows.size] = rows.ravel()
    mapping = _native.StagingMap(region.share_fd, region.size, "w")
    address, size = region.address, region.size
    del region  # unmapped and its fd closed
    arena = Arena(runtime, 1 << 20)
    slots = np.arange(4, dtype=np.uint64) * np.uint64(SLOT)
    src = Source("w", "mapped", address, size, mapping=mapping)
    statuses = arena.pull_mapped(src, slots, np.arange(1, 5, dtype=np.uint64),
                                 arena.next_generations(4),
                                 np.arange(4, dtype=np.uint64) * np.uint64(ITEM),
                                 np.full(4, ITEM, np.uint64))
    assert not statuses.any()
    view = arena.region.view()
    for i, s in enumerate(slots.astype(np.int64)):
        assert np.array_equal(view[s + 16 : s + 16 + ITEM], rows[i])
