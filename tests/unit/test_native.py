"""The native core: memory registration, remote keys, the batched gather."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from distore_ucx import errors
from distore_ucx._native_loader import _native
from distore_ucx.transport import UcxRuntime

TLS = ["tcp", "sm"]


@pytest.fixture(params=TLS)
def runtime(request):
    with UcxRuntime(config={"TLS": request.param}) as rt:
        yield rt


@pytest.fixture
def remote(runtime):
    """A 4 MiB remote-readable region with a known pattern, and its key."""
    region = runtime.map_region(4 << 20, remote_read=True)
    region.view()[:] = np.random.default_rng(1).integers(0, 256, region.size, dtype=np.uint8)
    ep = runtime.endpoint(runtime.address, "self")
    key = _native.RemoteKey(ep, region.pack_rkey(), region.address, region.size, "self")
    return region, key


def test_map_and_unmap_many_regions(runtime):
    for size in (1, 4096, 1 << 20, (1 << 20) + 3):
        region = runtime.map_region(size, remote_read=True)
        assert region.size == size
        assert region.address % 4096 == 0
        view = region.view()
        view[:] = 7
        assert view.sum() == 7 * size
        del view, region


def test_zero_size_region_is_a_clear_error(runtime):
    with pytest.raises(errors.InvalidArgument, match="size must be > 0"):
        runtime.map_region(0)


def test_local_only_region_has_no_remote_key(runtime):
    region = runtime.map_region(4096)
    assert not region.remote_read
    with pytest.raises(errors.Unsupported, match="not mapped for remote access"):
        region.pack_rkey()


def test_remote_key_round_trip(runtime, remote):
    region, key = remote
    assert key.remote_base == region.address and key.remote_size == region.size
    dest = runtime.map_region(4096)
    st = _native.gather(
        runtime.worker, [key], np.zeros(1, np.uint32), np.array([region.address], np.uint64),
        np.array([4096], np.uint64), dest, np.zeros(1, np.uint64),
    )
    assert st.tolist() == [0]
    assert np.array_equal(dest.view(), region.view()[:4096])


def test_gather_random_offsets_and_sizes(runtime, remote):
    region, key = remote
    rng = np.random.default_rng(7)
    src = region.view()
    for _ in range(20):
        n = int(rng.integers(1, 64))
        sizes = rng.integers(1, 64 << 10, n).astype(np.uint64)
        offsets = np.array([rng.integers(0, region.size - s + 1) for s in sizes], np.uint64)
        dest_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        dest = runtime.map_region(int(sizes.sum()))
        st = _native.gather(
            runtime.worker, [key], np.zeros(n, np.uint32), region.address + offsets, sizes,
            dest, dest_off,
        )
        assert (st == 0).all()
        got = dest.view()
        for o, s, d in zip(offsets, sizes, dest_off):
            assert np.array_equal(got[d : d + s], src[o : o + s])


def assert_dense(out, src, n, dest_at, fields, slots, rows) -> None:
    """Each slot of `src` at `slots` is in its row of `out`: its 16-byte
    header in the (n, 16) header array at 0, each field (offset in the
    slot, length) in its own [n, length] array at `dest_at`."""
    header = out[:n * 16].reshape(n, 16)
    arrays = [out[at:at + n * length].reshape(n, length)
              for at, (_, length) in zip(dest_at, fields)]
    for slot, r in zip(slots, rows):
        o, r = int(slot), int(r)
        assert np.array_equal(header[r], src[o:o + 16])
        for (s, length), a in zip(fields, arrays):
            assert np.array_equal(a[r], src[o + s:o + s + length])


@pytest.mark.parametrize("staged", [False, True], ids=["get-per-part", "staged"])
def test_gather_dense_scatters_each_item_into_a_structure_of_arrays(runtime, remote, staged):
    # Slots of 4096 bytes: a 16-byte header, a 1000-byte field, a gap, a
    # 3072-byte field. Each item lands in its row of the header array and of
    # each field's own dense array, read a part per get or whole into a
    # staging region first.
    region, key = remote
    src = region.view()
    n, item = 6, 4096
    fields = [(16, 1000), (1024, 3072)]
    dest_at = [128, 128 + 6016]  # each array 64-byte aligned after the (6, 16) headers
    layout = _native.BatchLayout(n, 0, np.array([16, 1024], np.uint64),
                                 np.array([1000, 3072], np.uint64), np.array(dest_at, np.uint64))
    assert layout.read_length == item
    dest = runtime.map_region(layout.nbytes)
    staging = runtime.map_region(n * item) if staged else None
    slots = np.array([9, 2, 700, 5, 1000, 3], np.uint64) * np.uint64(item)
    rows = np.array([5, 4, 3, 2, 1, 0], np.uint64)
    st = _native.gather_dense(runtime.worker, [key], np.zeros(n, np.uint32),
                              region.address + slots, rows, layout, dest, staging)
    assert st.tolist() == [0] * n
    assert_dense(dest.view(), src, n, dest_at, fields, slots, rows)
    with pytest.raises(errors.OutOfBoundsError, match="row 6 of a batch of 6"):
        _native.gather_dense(runtime.worker, [key], np.zeros(1, np.uint32),
                             np.array([region.address], np.uint64), np.array([6], np.uint64),
                             layout, dest)
    with pytest.raises(errors.OutOfBoundsError, match="outside the peer's registered region"):
        _native.gather_dense(runtime.worker, [key], np.zeros(1, np.uint32),
                             np.array([region.address + region.size - 2048], np.uint64),
                             np.zeros(1, np.uint64), layout, dest, staging)
    if staged:
        with pytest.raises(errors.OutOfBoundsError, match="staging buffer holds 4096 bytes"):
            _native.gather_dense(runtime.worker, [key], np.zeros(2, np.uint32),
                                 region.address + slots[:2], rows[:2], layout, dest,
                                 runtime.map_region(item))


def test_gather_dense_reads_a_run_of_following_slots_with_one_get(runtime, remote):
    # Slots 4160 bytes apart (a 4096-byte read, padded as an arena pads
    # them): rows 0-3 are slots 10-13 (one run), rows 4-5 slots 20 and 22
    # (no run), rows 6-7 slots 30-31 (a run). Three runs and two lone slots:
    # five gets, each item in its row as if read alone.
    region, key = remote
    src = region.view()
    stride, n = 4160, 8
    fields = [(16, 1000), (1024, 3072)]
    dest_at = [128, 128 + 8064]
    layout = _native.BatchLayout(n, 0, np.array([16, 1024], np.uint64),
                                 np.array([1000, 3072], np.uint64), np.array(dest_at, np.uint64))
    dest = runtime.map_region(layout.nbytes)
    staging = runtime.map_region((n - 1) * stride + layout.read_length)
    slots = np.array([10, 11, 12, 13, 20, 22, 30, 31], np.uint64) * np.uint64(stride)
    rows = np.arange(n, dtype=np.uint64)
    reads = np.zeros(1, np.uint64)
    st = _native.gather_dense(runtime.worker, [key], np.zeros(n, np.uint32),
                              region.address + slots, rows, layout, dest, staging,
                              slot_stride=stride, reads=reads)
    assert st.tolist() == [0] * n
    assert int(reads[0]) == 4  # 10-13, 20, 22, 30-31
    assert_dense(dest.view(), src, n, dest_at, fields, slots, rows)
    # Without the stride: a get a slot.
    reads[0] = 0
    _native.gather_dense(runtime.worker, [key], np.zeros(n, np.uint32), region.address + slots,
                         rows, layout, dest, staging, reads=reads)
    assert int(reads[0]) == n
    with pytest.raises(errors.OutOfBoundsError, match="staging buffer holds"):
        _native.gather_dense(runtime.worker, [key], np.zeros(n, np.uint32),
                             region.address + slots, rows, layout, dest,
                             runtime.map_region(n * layout.read_length), slot_stride=stride)
    with pytest.raises(errors.InvalidArgument, match="shorter than the 4096 read"):
        _native.gather_dense(runtime.worker, [key], np.zeros(n, np.uint32),
                             region.address + slots, rows, layout, dest, staging,
                             slot_stride=4000)


def test_out_of_range_address_raises_and_names_the_peer(runtime, remote):
    region, key = remote
    dest = runtime.map_region(4096)
    with pytest.raises(errors.OutOfBoundsError, match="outside the peer's registered region") as ei:
        _native.gather(
            runtime.worker, [key], np.zeros(1, np.uint32),
            np.array([region.address + region.size - 10], np.uint64),
            np.array([100], np.uint64), dest, np.zeros(1, np.uint64),
        )
    assert ei.value.peer == "self"
    assert ei.value.status_name == "DISTORE_OUT_OF_BOUNDS"
    with pytest.raises(errors.OutOfBoundsError):
        _native.gather(
            runtime.worker, [key], np.zeros(1, np.uint32), np.array([8], np.uint64),
            np.array([100], np.uint64), dest, np.zeros(1, np.uint64),
        )


def test_destination_overflow_is_refused(runtime, remote):
    region, key = remote
    dest = runtime.map_region(100)
    with pytest.raises(errors.OutOfBoundsError, match="destination"):
        _native.gather(
            runtime.worker, [key], np.zeros(1, np.uint32), np.array([region.address], np.uint64),
            np.array([64], np.uint64), dest, np.array([64], np.uint64),
        )


def test_bad_key_index_and_shapes(runtime, remote):
    region, key = remote
    dest = runtime.map_region(4096)
    with pytest.raises(errors.InvalidArgument, match="remote key index"):
        _native.gather(
            runtime.worker, [key], np.ones(1, np.uint32), np.array([region.address], np.uint64),
            np.array([8], np.uint64), dest, np.zeros(1, np.uint64),
        )
    with pytest.raises(errors.InvalidArgument, match="same length"):
        _native.gather(
            runtime.worker, [key], np.zeros(2, np.uint32), np.array([region.address], np.uint64),
            np.array([8], np.uint64), dest, np.zeros(1, np.uint64),
        )


def test_garbage_remote_key_is_an_exception_not_a_crash(runtime):
    ep = runtime.endpoint(runtime.address, "self")
    region = runtime.map_region(4096, remote_read=True)
    good = region.pack_rkey()
    corrupt = good[:-1] + bytes([good[-1] ^ 0xFF])
    for bad in (b"\x00\x01garbage" * 4, corrupt, good[:-3], good + b"x"):
        with pytest.raises(errors.InvalidArgument, match="remote key rejected") as ei:
            _native.RemoteKey(ep, bad, region.address, 4096, "self")
        assert ei.value.peer == "self"
    with pytest.raises(errors.UcxError, match="empty remote key"):
        _native.RemoteKey(ep, b"", 0, 4096, "self")


def test_empty_batch_is_fine(runtime, remote):
    _, key = remote
    dest = runtime.map_region(64)
    empty = np.zeros(0, np.uint64)
    st = _native.gather(runtime.worker, [key], np.zeros(0, np.uint32), empty, empty, dest, empty)
    assert len(st) == 0


def test_interpreter_exit_with_live_objects_does_not_crash(tmp_path):
    # Regions, keys and endpoints left for the interpreter to tear down must
    # go in the right order (key, endpoint, memory, worker, context).
    script = textwrap.dedent(
        """
        import numpy as np
        from distore_ucx._native_loader import _native
        from distore_ucx.transport import UcxRuntime
        rt = UcxRuntime(config={"TLS": "tcp"})
        region = rt.map_region(1 << 20, remote_read=True)
        ep = rt.endpoint(rt.address, "self")
        key = _native.RemoteKey(ep, region.pack_rkey(), region.address, region.size, "self")
        dest = rt.map_region(4096)
        st = _native.gather(rt.worker, [key], np.zeros(1, np.uint32),
                            np.array([region.address], np.uint64), np.array([64], np.uint64),
                            dest, np.zeros(1, np.uint64))
        assert st[0] == 0
        rt.close()
        print("done")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout
    assert "double free" not in out.stderr and "inuse" not in out.stderr
