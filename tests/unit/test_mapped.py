"""Same-host mapping: sealed arenas, the fd handshake, the mapped gather."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import threading

import numpy as np
import pytest

from distore_ucx import errors
from distore_ucx._native_loader import _native
from distore_ucx.transport import UcxRuntime
from distore_ucx.transport.local_map import LocalMapServer, receive_arena

SIZE = 4 << 20
ARENA_ID = 0x1234_5678


@pytest.fixture
def runtime():
    with UcxRuntime(progress_thread=False, config={"TLS": "tcp"}) as rt:
        yield rt


@pytest.fixture
def region(runtime):
    r = _native.MemoryRegion.write_protected(runtime.region_owner, SIZE, False)
    r.view()[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    return r


def serve(region, token=None, high_water=None):
    return LocalMapServer(region.share_fd, region.size, ARENA_ID, region.page_kind, token,
                          "test-node", high_water=high_water).start()


def test_sealed_arena_fd_cannot_be_mapped_or_made_writable(region):
    fd = region.share_fd
    assert fd >= 0
    with pytest.raises(PermissionError):
        mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(OSError):
        os.ftruncate(fd, SIZE * 2)
    # A read-only mapping works, and mprotect cannot make it writable.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, SIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        assert libc.mprotect(addr, SIZE, mmap.PROT_READ | mmap.PROT_WRITE) == -1
        assert ctypes.get_errno() in (13, 1)  # EACCES / EPERM
        assert ctypes.string_at(addr + 5, 3) == bytes([5, 6, 7])
    finally:
        libc.munmap(addr, SIZE)


def test_unprotected_regions_have_no_fd_to_share(runtime):
    assert runtime.map_region(1 << 20, remote_read=True).share_fd == -1


def test_fd_is_granted_after_the_handshake_and_maps_the_same_bytes(region):
    server = serve(region, high_water=lambda: 1 << 20)
    try:
        fd, size, kind, high = receive_arena(server.name, ARENA_ID, None, "test-node")
        try:
            arena = _native.MappedArena(fd, size, "test-node", high)
        finally:
            os.close(fd)
        assert size == SIZE and kind == region.page_kind and high == 1 << 20
        assert arena.populated >= 1 << 20
        assert bytes(np.frombuffer(ctypes.string_at(arena.address + 300, 4), np.uint8)) == \
            bytes(region.view()[300:304])
        # Bytes written by the owner after mapping are seen at once.
        region.view()[100:108] = 0xAB
        assert ctypes.string_at(arena.address + 100, 8) == b"\xab" * 8
        assert server.granted == 1
    finally:
        server.close()


def test_fd_is_refused_without_the_token_or_for_another_arena(region):
    token = b"0123456789abcdef0123456789abcdef"
    server = serve(region, token=token)
    try:
        with pytest.raises(errors.ConnectionFailed, match="requires a token"):
            receive_arena(server.name, ARENA_ID, None, "test-node")
        with pytest.raises(errors.ConnectionFailed, match="wrong token"):
            receive_arena(server.name, ARENA_ID, b"x" * 32, "test-node")
        with pytest.raises(errors.ConnectionFailed, match="restarted"):
            receive_arena(server.name, ARENA_ID + 1, token, "test-node")
        # Garbage and a silent peer cost nothing lasting: the server still grants.
        for junk in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100, b""):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect("\0" + server.name[1:])
                s.sendall(junk)
        fd, _, _, _ = receive_arena(server.name, ARENA_ID, token, "test-node")
        os.close(fd)
        assert server.granted == 1 and server.refused >= 3
    finally:
        server.close()


def mapped(region):
    server = serve(region)
    try:
        fd, size, _, high = receive_arena(server.name, ARENA_ID, None, "test-node")
    finally:
        server.close()
    try:
        return _native.MappedArena(fd, size, "test-node", high)
    finally:
        os.close(fd)


@pytest.mark.parametrize("helpers,item", [(0, 4096), (1, 4096), (1, 1 << 20), (3, 300_000)])
def test_mapped_gather_copies_every_item(runtime, region, helpers, item):
    arena = mapped(region)
    n = min(8, SIZE // item)
    rng = np.random.default_rng(helpers)
    slots = rng.permutation(SIZE // item)[:n].astype(np.uint64)
    dest = runtime.map_region(n * item)
    st = _native.mapped_gather([arena], np.zeros(n, np.uint32), slots * np.uint64(item),
                               np.full(n, item, np.uint64), dest,
                               np.arange(n, dtype=np.uint64) * np.uint64(item),
                               _native.CopyPool(helpers), 1)
    assert not st.any()
    src = region.view()
    got = dest.view()[: n * item].reshape(n, item)
    for i, s in enumerate(slots):
        assert np.array_equal(got[i], src[int(s) * item:(int(s) + 1) * item])


def dense_layout(rows, fields):
    """A BatchLayout of `rows` items whose fields are (src, length) spans of a
    slot: header array first, then each field's array, 64-byte aligned."""
    at, dest = -(-rows * 16 // 64) * 64, []
    for _, length in fields:
        dest.append(at)
        at += -(-rows * length // 64) * 64
    layout = _native.BatchLayout(rows, 0, np.array([f[0] for f in fields], np.uint64),
                                 np.array([f[1] for f in fields], np.uint64),
                                 np.array(dest, np.uint64))
    assert layout.nbytes <= at
    return layout, dest


def test_mapped_gather_located_takes_the_control_planes_records(runtime, region):
    # Records as protocol.ITEM_LOCATION: node 3 is mapped (lut -> arena 0),
    # node 5 is not. Slot headers here are the arena's own bytes, so an item
    # asks for its slot's real (key, generation) to be good, anything else
    # to be stale; items of node 5 are left untouched for the UCX path.
    # Each item is scattered: header to its row of the header array, its two
    # fields (with a gap between them in the slot) to their own dense arrays.
    from distore_ucx.protocol import ITEM_LOCATION

    arena = mapped(region)
    item = 4096
    fields = [(16, 1000), (1024, 3072)]
    src = region.view()
    offsets = np.array([0, 3, 7, 11, 2], np.uint64) * np.uint64(item)
    recs = np.zeros(5, ITEM_LOCATION)
    recs["node"] = [3, 3, 5, 3, 9]
    recs["offset"] = offsets
    for i, off in enumerate(offsets):
        head = src[int(off):int(off) + 16].view(np.uint64)
        recs["key"][i], recs["generation"][i] = head[0], head[1]
    recs["generation"][3] += np.uint64(1)  # the slot was reused since
    lut = np.full(10, -1, np.int64)
    lut[3] = 0
    rows = np.array([4, 0, 1, 2, 3], np.uint64)  # row of the batch each item lands in
    layout, dest_at = dense_layout(5, fields)
    dest = runtime.map_region(layout.nbytes)
    out = dest.view()
    out[:] = 0xEE
    st = _native.mapped_gather_located([arena], lut, recs.tobytes(), rows, layout, dest,
                                       _native.CopyPool(1), 1)
    assert st.tolist() == [0, 0, _native.STATUS_NOT_MAPPED, _native.STATUS_STALE,
                           _native.STATUS_NOT_MAPPED]
    header = out[:5 * 16].reshape(5, 16)
    arrays = [out[at:at + 5 * n].reshape(5, n) for at, (_, n) in zip(dest_at, fields)]
    for i in (0, 1, 3):
        r, off = int(rows[i]), int(offsets[i])
        assert np.array_equal(header[r], src[off:off + 16])
        for (s, n), a in zip(fields, arrays):
            assert np.array_equal(a[r], src[off + s:off + s + n])
    for i in (2, 4):  # nodes 5 and 9: not copied
        r = int(rows[i])
        assert (header[r] == 0xEE).all() and all((a[r] == 0xEE).all() for a in arrays)
    with pytest.raises(errors.InvalidArgument, match="32 bytes each"):
        _native.mapped_gather_located([arena], lut, recs.tobytes()[:-1], rows, layout, dest,
                                       None)
    with pytest.raises(errors.InvalidArgument, match="one row per item"):
        _native.mapped_gather_located([arena], lut, recs.tobytes(), rows[:4], layout, dest, None)
    with pytest.raises(errors.OutOfBoundsError, match="row 5 of a batch of 5"):
        _native.mapped_gather_located([arena], lut, recs.tobytes(), rows + np.uint64(1),
                                      layout, dest, None)
    recs["offset"][0] = SIZE - item // 2
    with pytest.raises(errors.OutOfBoundsError, match="outside the mapped arena"):
        _native.mapped_gather_located([arena], lut, recs.tobytes(), rows, layout, dest, None)
    small = runtime.map_region(4096)
    with pytest.raises(errors.OutOfBoundsError, match="the local buffer has"):
        _native.mapped_gather_located([arena], lut, recs.tobytes(), rows, layout, small, None)


def _last_level_cache() -> int:
    """The largest cache of level 2 or more that sysfs lists for CPU 0 (0: none)."""
    best = 0
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{base}/level") as lv, open(f"{base}/size") as sz:
                level, size = int(lv.read()), sz.read().strip()
        except (OSError, ValueError):
            continue
        if level >= 2:
            unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KM")) * unit)
    return best


def test_batches_stream_from_a_quarter_of_the_last_level_cache():
    assert _native.mapped_batch_stream_min() == max(1 << 20, _last_level_cache() // 4)


@pytest.mark.parametrize("side", ["below", "above"])
def test_batches_on_either_side_of_the_streaming_threshold_copy_every_byte(runtime, region,
                                                                           side):
    # Plain stores below the threshold, non-temporal ones from it up: the
    # same bytes. Items repeat slots (the arena is smaller than the batch).
    from distore_ucx.protocol import ITEM_LOCATION

    arena = mapped(region)
    item = 110 << 10  # W1's
    threshold = _native.mapped_batch_stream_min()
    n = threshold // item + 1 if side == "above" else max(1, threshold // item - 1)
    slots = SIZE // item
    offsets = (np.arange(n, dtype=np.uint64) % np.uint64(slots)) * np.uint64(item)
    src = region.view()
    recs = np.zeros(n, ITEM_LOCATION)
    recs["offset"] = offsets
    for i, off in enumerate(offsets):
        head = src[int(off):int(off) + 16].view(np.uint64)
        recs["key"][i], recs["generation"][i] = head[0], head[1]
    layout, (at,) = dense_layout(n, [(16, item - 16)])
    assert (n * (item - 16) >= threshold) == (side == "above")
    dest = runtime.map_region(layout.nbytes)
    st = _native.mapped_gather_located([arena], np.zeros(1, np.int64), recs.tobytes(),
                                       np.arange(n, dtype=np.uint64), layout, dest,
                                       _native.CopyPool(1), 1 << 20)
    assert (st == 0).all()
    got = dest.view()[at:at + n * (item - 16)].reshape(n, item - 16)
    for i in range(n):
        off = int(offsets[i])
        assert np.array_equal(got[i], src[off + 16:off + item])


def test_batch_layout_refuses_overlapping_arrays():
    with pytest.raises(errors.InvalidArgument, match="overlap"):
        _native.BatchLayout(4, 0, np.array([16], np.uint64), np.array([8], np.uint64),
                            np.array([32], np.uint64))  # the header array ends at 64
    with pytest.raises(errors.InvalidArgument, match="slot header"):
        _native.BatchLayout(4, 0, np.array([8], np.uint64), np.array([8], np.uint64),
                            np.array([64], np.uint64))


def test_mapped_gather_refuses_out_of_bounds_items(runtime, region):
    arena = mapped(region)
    dest = runtime.map_region(1 << 16)
    one = np.zeros(1, np.uint32)
    with pytest.raises(errors.OutOfBoundsError, match="outside the mapped arena"):
        _native.mapped_gather([arena], one, np.array([SIZE - 100], np.uint64),
                              np.array([4096], np.uint64), dest, np.zeros(1, np.uint64), None)
    with pytest.raises(errors.OutOfBoundsError, match="destination"):
        _native.mapped_gather([arena], one, np.zeros(1, np.uint64),
                              np.array([4096], np.uint64), dest,
                              np.array([1 << 16], np.uint64), None)
    with pytest.raises(errors.InvalidArgument, match="arena index"):
        _native.mapped_gather([arena], np.ones(1, np.uint32), np.zeros(1, np.uint64),
                              np.array([4096], np.uint64), dest, np.zeros(1, np.uint64), None)


def test_seqlock_rewrites_during_copies_are_never_accepted(runtime, region):
    # A writer rewrites one slot again and again in seqlock order (invalid
    # header, payload of its generation's byte, header); the reader copies it
    # flat out. Every copy accepted must be whole: its payload all equal to
    # the low byte of the generation in its header.
    slot, item = 0, 256 << 10
    arena = mapped(region)
    view = region.view()
    stop = threading.Event()

    def write():
        gen = 1
        while not stop.is_set():
            view[slot:slot + 16] = 0
            view[slot + 16:slot + item] = gen & 0xFF
            view[slot:slot + 16] = np.array([7, gen], np.uint64).view(np.uint8)
            gen += 1
            if gen % 4 == 0:
                stop.wait(0.0003)  # leave windows where the slot is whole

    view[slot:slot + 16] = np.array([7, 0], np.uint64).view(np.uint8)
    view[slot + 16:slot + item] = 0
    dest = runtime.map_region(item)
    out = dest.view()[:item]
    writer = threading.Thread(target=write)
    writer.start()
    accepted = torn = bad = 0
    try:
        for _ in range(6000):
            st = _native.mapped_gather([arena], np.zeros(1, np.uint32),
                                       np.array([slot], np.uint64), np.array([item], np.uint64),
                                       dest, np.zeros(1, np.uint64), None)
            key, gen = out[:16].view(np.uint64)
            if st[0] == _native.STATUS_TORN or key != 7:
                torn += 1
                continue
            accepted += 1
            bad += int((out[16:] != (gen & 0xFF)).any())
    finally:
        stop.set()
        writer.join()
    assert accepted > 0
    assert bad == 0, f"{bad} torn copies accepted ({accepted} accepted, {torn} refused)"


def test_seqlock_rewrites_during_dense_copies_are_never_accepted(runtime, region):
    # As above, through the learner's call: the slot is scattered into a
    # header array and two field arrays. A copy accepted (status 0: header
    # unchanged and the generation asked for) must be whole: both fields all
    # equal to the low byte of that generation.
    from distore_ucx.protocol import ITEM_LOCATION

    slot, item = 0, 256 << 10
    fields = [(16, 100 << 10), ((100 << 10) + 64, item - (100 << 10) - 64)]
    arena = mapped(region)
    view = region.view()
    stop = threading.Event()

    def write():
        gen = 1
        while not stop.is_set():
            view[slot:slot + 16] = 0
            view[slot + 16:slot + item] = gen & 0xFF
            view[slot:slot + 16] = np.array([7, gen], np.uint64).view(np.uint8)
            gen += 1
            if gen % 4 == 0:
                stop.wait(0.0003)  # leave windows where the slot is whole

    view[slot:slot + 16] = np.array([7, 0], np.uint64).view(np.uint8)
    view[slot + 16:slot + item] = 0
    layout, dest_at = dense_layout(1, fields)
    dest = runtime.map_region(layout.nbytes)
    out = dest.view()
    lut = np.zeros(1, np.int64)
    rec = np.zeros(1, ITEM_LOCATION)
    rec["key"] = 7
    writer = threading.Thread(target=write)
    writer.start()
    accepted = refused = bad = 0
    try:
        for _ in range(6000):
            gen = int(view[slot + 8:slot + 16].view(np.uint64)[0])  # the one to ask for
            rec["generation"] = gen
            st = _native.mapped_gather_located([arena], lut, rec.tobytes(),
                                               np.zeros(1, np.uint64), layout, dest, None)
            if st[0] != 0:
                refused += 1
                continue
            accepted += 1
            assert out[:16].view(np.uint64).tolist() == [7, gen]
            for at, (_, n) in zip(dest_at, fields):
                bad += int((out[at:at + n] != (gen & 0xFF)).any())
    finally:
        stop.set()
        writer.join()
    assert accepted > 0
    assert bad == 0, f"{bad} torn copies accepted ({accepted} accepted, {refused} refused)"


def test_copy_pool_threads_sleep_when_idle():
    import time

    import psutil

    pool = _native.CopyPool(3)
    assert pool.helpers == 3
    proc = psutil.Process()
    t0 = proc.cpu_times()
    time.sleep(0.5)
    t1 = proc.cpu_times()
    assert (t1.user + t1.system) - (t0.user + t0.system) < 0.05
    del pool


def test_copy_pool_serves_two_threads_at_once(runtime, region):
    """A storage node pulls on its event loop and on a worker thread with one
    pool: concurrent batches must all complete and copy right (two callers
    once overwrote each other's batch and both waited forever)."""
    import threading

    arena = mapped(region)
    pool = _native.CopyPool(2)
    item, n = 64 << 10, 16
    errors, done = [], []

    def loop(seed):
        rng = np.random.default_rng(seed)
        dest = runtime.map_region(n * item)
        try:
            for _ in range(200):
                slots = rng.permutation(SIZE // item)[:n].astype(np.uint64)
                st = _native.mapped_gather([arena], np.zeros(n, np.uint32),
                                           slots * np.uint64(item), np.full(n, item, np.uint64),
                                           dest, np.arange(n, dtype=np.uint64) * np.uint64(item),
                                           pool, 1)
                assert not st.any()
                got = dest.view()[: n * item].reshape(n, item)
                src = region.view()
                for i in (0, n - 1):
                    s = int(slots[i])
                    assert np.array_equal(got[i], src[s * item:(s + 1) * item])
            done.append(seed)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(seed,), daemon=True) for seed in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(done) == [1, 2, 3], "a caller of the copy pool never returned (deadlock)"
