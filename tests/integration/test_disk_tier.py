"""The disk tier end to end: nodes with --disk demote to disk when their
arena is full, cold items are sampled in the same batch as hot ones with
every item's content checked, a node restarts with its tier file, a full
disk fails inserts clearly without losing anything, and a tier file that is
not valid is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import wait_for

import distore_ucx as ds
from distore_ucx.spec import TableSpec
from distore_ucx.storage.tier import HEADER_BYTES, stride_of

WIDTH = 64_000  # bytes of one item's payload: 64 KiB slots, 68 KiB on disk
SPEC = {"obs": ((WIDTH,), "uint8"), "idx": ((), "uint64")}
MiB = 1 << 20
SLOT = TableSpec.parse(SPEC).slot_size  # 64064 bytes in an arena
STRIDE = stride_of(SLOT)  # and on disk (with its checksum trailer)


def items(start: int, n: int) -> dict:
    """Items whose bytes follow from their index `idx` (any wrong or stale
    byte is seen by `check`)."""
    idx = np.arange(start, start + n, dtype=np.uint64)
    obs = ((idx[:, None] * np.uint64(7) + np.arange(WIDTH, dtype=np.uint64)) % 251)
    return {"obs": obs.astype(np.uint8), "idx": idx}


def check(batch, key_to_idx: dict) -> np.ndarray:
    """Every item of the batch is the one its key names, byte for byte, and
    every field one dense array (cold items included); their indexes."""
    for a in batch.data.values():
        assert a.flags.c_contiguous and np.ascontiguousarray(a).ctypes.data == a.ctypes.data
    idx = batch.data["idx"]
    assert [key_to_idx[int(k)] for k in batch.keys] == idx.tolist(), "an item under another key"
    want = ((idx[:, None] * np.uint64(7) + np.arange(WIDTH, dtype=np.uint64)) % 251)
    assert np.array_equal(batch.data["obs"], want.astype(np.uint8)), "wrong bytes"
    return idx


def insert(client, table: str, start: int, n: int, key_to_idx: dict, batch: int = 32,
           **writer_options):
    with client.writer(max_items=batch, **writer_options) as writer:
        keys = writer.insert(table, items(start, n))
    key_to_idx.update(zip(keys.tolist(), range(start, start + n)))
    return keys


def tier_cluster(make_cluster, tmp_path, nodes=2, arena="8MiB", disk="64MiB", staging="3MiB",
                 **kw):
    return make_cluster(nodes=nodes, arena_bytes=arena, disk_bytes=disk, disk_staging=staging,
                        disk_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)
def test_a_table_four_times_the_arenas_fills_samples_and_evicts(make_cluster, tmp_path, tls):
    cluster = tier_cluster(make_cluster, tmp_path)
    client = ds.connect(cluster.address)
    hot = 2 * ((8 * MiB - 3 * MiB) // SLOT)  # both arenas, less their staging areas
    capacity = 4 * 2 * (8 * MiB // SLOT)  # 4x the arenas
    client.create_table("t", capacity=capacity, spec=SPEC)
    key_to_idx: dict = {}
    total = capacity + capacity // 2
    # One batch in flight: batches are registered (and evicted) in index order.
    insert(client, "t", 0, total, key_to_idx, max_in_flight=1)
    info = client.table_info("t")
    assert info["size"] == capacity and info["deletes"] == total - capacity
    assert capacity > 3 * hot
    # All but the arenas' worth is on disk (demotions go 64 at a time per node).
    assert capacity - hot <= info["cold"] <= capacity - hot + 2 * 64
    learner = client.learner("t", batch_size=16)
    seen = set()
    for _ in range(60):
        idx = check(learner.sample(), key_to_idx)
        assert idx.min() >= total - capacity, "an evicted item was sampled"
        seen.update(idx.tolist())
    # Uniform over the table: most samples are cold (only `hot` items fit in DRAM).
    assert len(seen) > 500
    assert len([i for i in seen if i < total - hot]) > 0.5 * len(seen)
    # It asks 8 batches a request (sample_ahead), but with disk tiers the
    # control plane answers one: 60 taken, at most 2 more asked.
    assert learner.sample_ahead == 8
    samples = client.table_info("t")["samples"]
    assert 60 * 16 <= samples <= 62 * 16
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["mapped"], indirect=True)
def test_a_table_that_never_left_dram_samples_ahead_beside_a_cold_one(make_cluster, tmp_path,
                                                                      tls):
    # Disk tiers on every node, but only a table that has had items on disk
    # is held to one batch per request (staging areas are sized for that);
    # a hot table samples ahead as on nodes without tiers.
    cluster = tier_cluster(make_cluster, tmp_path)
    client = ds.connect(cluster.address)
    key_to_idx: dict = {}
    client.create_table("hot", capacity=40, spec=SPEC)
    insert(client, "hot", 0, 40, key_to_idx)
    client.create_table("cold", capacity=400, spec=SPEC)
    insert(client, "cold", 1000, 400, key_to_idx, max_in_flight=1)
    assert client.table_info("hot")["cold"] == 0 and client.table_info("cold")["cold"] > 0
    for name in ("hot", "cold"):
        learner = client.learner(name, batch_size=4, sample_ahead=4)
        for i in range(40):  # back to back (ahead only then); every 8th checked
            batch = learner.sample()
            if i % 8 == 7:
                check(batch, key_to_idx)
        asked = client.table_info(name)["samples"]
        ahead = learner._rpc.in_flight + len(learner._stream.received)  # requests asked ahead
        if name == "hot":  # 4 batches a request once sampling back to back
            assert learner.requests <= 15 and asked >= 40 * 4 and ahead <= 1
        else:  # one a request, and two asked ahead: the node reads one while
            # the other's reads finish (sample_stream.COLD_DEPTH)
            assert learner.requests >= 40 and asked <= 42 * 4 and ahead == 2
        learner.close()
        # Closing released every lease, those of the requests asked ahead
        # too (their staged copies go back to the nodes with them).
        assert client.status()["leases"] == 0
    client.close()


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
def test_tier_moves_under_concurrent_inserts_and_samples(make_cluster, tmp_path, tls):
    cluster = tier_cluster(make_cluster, tmp_path)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=600, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 200, key_to_idx)
    errors: list = []
    done = threading.Event()

    def write():
        try:
            with ds.connect(cluster.address) as c2:
                for r in range(12):
                    with c2.writer(max_items=16) as writer:
                        keys = writer.insert("t", items(1000 + r * 64, 64))
                    # published before any sample can name them
                    key_to_idx.update(zip(keys.tolist(), range(1000 + r * 64,
                                                               1000 + (r + 1) * 64)))
        except Exception as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    # Keys are known before their items are inserted? No: a sample may name a
    # key the writer thread has not published yet; such keys are checked below.
    learner = client.learner("t", batch_size=16)
    writer = threading.Thread(target=write)
    writer.start()
    batches = 0
    pending = []
    while not done.is_set() or batches < 20:
        batch = learner.sample()
        unknown = [k for k in batch.keys.tolist() if k not in key_to_idx]
        if unknown:
            pending.append((batch.keys.copy(), batch.data["idx"].copy(),
                            batch.data["obs"].copy()))
        else:
            check(batch, key_to_idx)
        batches += 1
    writer.join(60)
    assert not errors, errors
    for keys, idx, obs in pending:  # the writer's keys are all known now
        assert [key_to_idx[int(k)] for k in keys] == idx.tolist()
        want = ((idx[:, None] * np.uint64(7) + np.arange(WIDTH, dtype=np.uint64)) % 251)
        assert np.array_equal(obs, want.astype(np.uint8))
    info = client.table_info("t")
    assert info["size"] == 600 and info["inserts"] == 200 + 12 * 64
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_node_restarts_with_its_disk_tier(make_cluster, tmp_path, tls):
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=400, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 300, key_to_idx)
    path = cluster.disk_path(0)
    assert os.path.getsize(path) == 4096 + 64 * MiB
    cluster.kill_node(0)
    wait_for(lambda: client.table_info("t")["size"] == 0, 10, "the dead node's items to leave")
    # The same tier file: reused (its header is ours); its old items are not served.
    cluster.add_node(extra_args=["--disk", path, "--disk-size", "64MiB", "--disk-staging",
                                 "3MiB"])
    insert(client, "t", 5000, 300, key_to_idx)
    assert client.table_info("t")["size"] == 300
    learner = client.learner("t", batch_size=16)
    for _ in range(30):
        assert check(learner.sample(), key_to_idx).min() >= 5000
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_full_disk_fails_inserts_clearly_and_loses_nothing(make_cluster, tmp_path, tls):
    # Arena: 5 MiB of slots (81 items); disk: 2 MiB (32 items in 64 KiB slots).
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1, disk="2MiB")
    client = ds.connect(cluster.address)
    with pytest.warns(ds.CapacityWarning, match="arenas and disk tiers of the 1 live"):
        client.create_table("t", capacity=1000, spec=SPEC)
    key_to_idx: dict = {}
    with pytest.raises(ds.StorageFull, match="arena and disk tier both full") as info:
        insert(client, "t", 0, 400, key_to_idx, batch=8)
    stored = info.value.stored_keys
    size = client.table_info("t")["size"]
    room = 5 * MiB // SLOT + 2 * MiB // STRIDE
    assert room - 8 <= size <= room
    # Keys of batches acknowledged before the failure: every one still samples correctly.
    with ds.connect(cluster.address) as c2:
        assert c2.table_info("t")["size"] == size
    learner = client.learner("t", batch_size=16)
    seen = set()
    for _ in range(40):
        batch = learner.sample()
        idx = batch.data["idx"]
        want = ((idx[:, None] * np.uint64(7) + np.arange(WIDTH, dtype=np.uint64)) % 251)
        assert np.array_equal(batch.data["obs"], want.astype(np.uint8))
        seen.update(batch.keys.tolist())
    assert set(stored.tolist()) <= seen | set(stored.tolist())  # stored keys are real keys
    assert len(seen) > 0.8 * size  # cold and hot alike
    learner.close()
    client.close()


def _start_node(tmp_path, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, UCX_TLS="tcp")
    return subprocess.run(
        [sys.executable, "-m", "distore_ucx", "node", "--control", "127.0.0.1:1", "--arena",
         "4MiB", "--no-hugepages", "--metrics-port", "0", "--reconnect-timeout", "0",
         "--disk", path, "--disk-size", "4MiB"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


@pytest.mark.parametrize("damage", ["not ours", "corrupt", "truncated"])
def test_an_invalid_tier_file_is_refused_at_start(tmp_path, damage):
    path = str(tmp_path / "node.tier")
    from distore_ucx.storage.tier import DiskTier

    DiskTier(path, 4 * MiB, "n0", arena_id=1).close()
    if damage == "not ours":
        with open(path, "r+b") as fh:
            fh.write(b"NOTATIER")
    elif damage == "corrupt":
        with open(path, "r+b") as fh:
            fh.seek(24)
            fh.write(b"\x00\x00\x00\x01")
    else:
        os.truncate(path, 4096 + MiB)
    before = open(path, "rb").read()
    result = _start_node(tmp_path, path)
    assert result.returncode != 0
    said = result.stderr
    expect = {"not ours": "is not a distore tier file", "corrupt": "corrupt header",
              "truncated": "is truncated"}[damage]
    assert expect in said and path in said, said[-2000:]
    assert open(path, "rb").read() == before  # refused, never overwritten


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_cold_items_come_back_after_a_control_plane_restore(make_cluster, tmp_path, tls):
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1, checkpoint=str(tmp_path / "ckpt"),
                           checkpoint_interval=0, restore_grace=30)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=400, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 300, key_to_idx)  # 81 fit the arena: the rest is cold
    assert client.checkpoint()["items"] == 300
    cluster.kill_control()
    cluster.start_control(restore=True)
    wait_for(lambda: client.table_info("t")["size"] == 300, 20, "every item back",
             lambda: client.table_info("t"))
    assert client.table_info("t")["awaiting_restore"] == 0
    learner = client.learner("t", batch_size=16)
    seen = set()
    for _ in range(40):
        seen.update(check(learner.sample(timeout=10), key_to_idx).tolist())
    assert len([i for i in seen if i < 200]) > 50  # old (cold) items among them
    # The restored control plane knows the table holds cold items: one batch
    # a request however fast it is asked (staging areas are sized for that).
    asked = client.table_info("t")["samples"]
    for _ in range(24):
        learner.sample(timeout=10)
    assert client.table_info("t")["samples"] - asked <= 25 * 16
    learner.close()
    client.close()


def damage_tier(path: str, every: int, flip_at: int | None = None, keep: int | None = None):
    """Flip one payload byte of every `every`-th disk slot, or cut the file
    to its header and `keep` slots (a tier file damaged behind the node's back)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if keep is not None:
            os.ftruncate(fd, HEADER_BYTES + keep * STRIDE)
        else:
            slots = (os.fstat(fd).st_size - HEADER_BYTES) // STRIDE
            for k in range(0, slots, every):
                where = HEADER_BYTES + k * STRIDE + flip_at
                os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x10]), where)
        os.fsync(fd)
    finally:
        os.close(fd)


def wrong_items(batch, key_to_idx: dict) -> int:
    """Items of a batch that are not, byte for byte, what was inserted under their key."""
    idx = batch.data["idx"]
    named = np.array([key_to_idx.get(int(k), -1) for k in batch.keys])
    want = ((idx[:, None] * np.uint64(7) + np.arange(WIDTH, dtype=np.uint64)) % 251)
    bad = (named != idx.astype(np.int64)) | (batch.data["obs"] != want.astype(np.uint8)).any(1)
    return int(bad.sum())


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
def test_flipped_bytes_on_disk_are_never_sampled(make_cluster, tmp_path, tls):
    # Issue 33: bytes flipped in a tier file's payloads gave 957 of 1,200
    # sampled items wrong; every slot read from disk is checked now, and a
    # bad one is dropped and resampled.
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=400, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 400, key_to_idx, max_in_flight=1)
    cold = client.table_info("t")["cold"]
    assert cold > 250
    damage_tier(cluster.disk_path(0), every=3, flip_at=5000)
    learner = client.learner("t", batch_size=16)
    wrong = sum(wrong_items(learner.sample(), key_to_idx) for _ in range(75))  # 1,200 items
    assert wrong == 0
    info = client.table_info("t")
    assert 0 < 400 - info["size"] <= cold // 3 + 1  # the damaged ones left the table
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
def test_a_truncated_tier_file_loses_its_items_but_sampling_goes_on(make_cluster, tmp_path,
                                                                    tls):
    # Issue 33: a truncated tier file reported items lost, then cold
    # sampling failed ("staging area full") for over 45 s.
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=400, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 400, key_to_idx, max_in_flight=1)
    cold = client.table_info("t")["cold"]
    damage_tier(cluster.disk_path(0), every=0, keep=cold // 2)  # half the cold items gone
    learner = client.learner("t", batch_size=16)
    worst = 0.0
    for _ in range(60):
        t0 = time.monotonic()
        assert wrong_items(learner.sample(timeout=10.0), key_to_idx) == 0
        worst = max(worst, time.monotonic() - t0)
    print(f"slowest sample after the truncation: {worst:.3f} s")
    assert worst < 5.0
    assert client.table_info("t")["size"] < 400 - cold // 4  # the cut ones left the table
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_staging_area_too_small_for_a_sample_is_a_typed_error_saying_what_to_do(
        make_cluster, tmp_path, tls):
    # Issue 33: a full staging area surfaced as a bare RuntimeError.
    # Room for what a learner of one-item batches holds (3 batches: the one
    # it reads and two asked ahead, docs/operations.md), far from a batch of 32.
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1, staging=f"{3 * STRIDE}B")
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=300, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, 300, key_to_idx, max_in_flight=1)
    learner = client.learner("t", batch_size=32)
    with pytest.raises(ds.StagingFull, match="raise --disk-staging"):
        for _ in range(5):
            learner.sample(timeout=5.0)
    learner.close()
    # Its leases (and the staged copies under them) go back as the control
    # plane handles the release: wait for that, not for the 5 s stage wait.
    wait_for(lambda: client.status()["leases"] == 0, 10, "the closed learner's leases to go",
             lambda: client.status()["leases"])
    with client.learner("t", batch_size=1) as small:  # it fits: served
        for _ in range(5):
            assert wrong_items(small.sample(timeout=5.0), key_to_idx) == 0
    client.close()


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
def test_evicted_cold_items_read_ahead_are_never_handed_out(make_cluster, tmp_path, tls):
    # A learner's prefetch thread reads batches ahead, their cold items from
    # copies their node staged for them; then inserts evict every item and
    # flush() returns. The staged copies are marked retired with the items'
    # slots, so the hand-out re-check resamples them: no batch handed out
    # after the flush holds an evicted item.
    cluster = tier_cluster(make_cluster, tmp_path, nodes=1)
    client = ds.connect(cluster.address)
    capacity = 200  # 3x what the arena holds hot: most items cold
    client.create_table("t", capacity=capacity, spec=SPEC)
    key_to_idx: dict = {}
    insert(client, "t", 0, capacity, key_to_idx, max_in_flight=1)
    assert client.table_info("t")["cold"] > capacity // 2
    # 3 batches of 8 cold items ahead fit the 3 MiB staging area.
    learner = client.learner("t", batch_size=8, prefetch=2)
    it = iter(learner)
    for _ in range(3):
        check(next(it), key_to_idx)
    queue = learner._prefetcher._state
    deadline = time.monotonic() + 20
    while len(queue.items) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(queue.items) >= 1, "the prefetch thread did not read ahead"
    insert(client, "t", capacity, capacity, key_to_idx, max_in_flight=1)  # evicts all of them
    returned = 0
    for _ in range(12):
        idx = check(next(it), key_to_idx)
        returned += int((idx < capacity).sum())
    assert returned == 0, f"{returned} evicted items were handed out after the evicting flush"
    learner.close()
    client.close()
