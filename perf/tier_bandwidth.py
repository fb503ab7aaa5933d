"""Sampling cold items from a node's disk tier vs the disk's own O_DIRECT reads.

For each item size (default 3 MiB in batches of 8 and 10 MiB in batches of 4,
the W2/W3 shapes of perf/sample_path.py) it starts a one-node LocalCluster
whose node has a small arena (a staging area for cold items plus room for a
few hot ones) and a disk tier in ``--dir``, fills a table of
``--table-bytes`` (nearly all of it demoted to disk; the hot fraction is
printed), and times ``learner.sample()`` back to back for ``--seconds``.
Every sampled batch is checked byte for byte (exit status 1 on a mismatch).

Baseline, same run, alternated with ours ``--runs`` times: the disk's own
bandwidth for the same reads, i.e. batches of the same number of random
slots of the same size read with O_DIRECT from the same tier file by the
same native batched reader (8 reads in flight), into physically contiguous
memory (transparent hugepages, ``hugepage_buffer``); the same
with one read in flight (``qd1``); and the same reads alternating between
two such buffers (``qd8_2buf``), as any reader that hands one batch out
while it fills the next must. Each row also gives the disk's read requests
per item (from /sys/dev/block/.../stat): a read into scattered 4 KiB pages
is split at the disk's segment limit into several requests, which costs
bandwidth (docs/performance.md).

``--slices T``: a table of slices instead (docs/semantics.md, "Slices"):
each SIZE is a step's size and each BATCH the slices a sample asks for; 4
envs of one writer append interleaved episodes of 4T steps, nearly all
demoted to disk, and a sample reads BATCH x T cold steps. Baselines: the
same reads slot by slot (``disk_o_direct_qd8``: B x T reads) and each
slice as one read of T slots (``disk_o_direct_qd8_runs``: B reads). Rows
add the node's read calls per cold slice (``node_reads_per_slice``, from
node_info ``disk_reads``; absent on builds before it). To compare builds,
run it with each build's package first on PYTHONPATH, alternating.

``--hot``: also sample a table that fits the arena (32 x 110 KB items) from a
node with a disk tier and from one without, alternated, to show that hot
sampling pays nothing for the tier.

Output: one JSON line per measurement on stdout, then a table; progress on
stderr. GB/s = 10^9 item bytes per second of wall time.

    cd /tmp && <venv>/bin/python <repo>/perf/tier_bandwidth.py --dir /tmp/tierbench
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import shutil
import statistics
import sys
import time

import common
import numpy as np
from common import JsonLines, apply_ucx_env, fmt, log

MiB = 1 << 20
ALIGN = 4096


def checked(bad: int, batches: int, size: int, what: str) -> list[dict]:
    """Say how the byte-for-byte checks of `batches` batches went; a
    mismatch row when `bad` of them held other bytes than their `what`'."""
    if bad:
        log(f"MISMATCH: {bad} batches held bytes other than their {what}'")
        return [{"size": size, "what": "mismatch"}]
    log(f"{batches} batches checked byte for byte")
    return []

def items(keys: np.ndarray, size: int) -> np.ndarray:
    """Rows whose bytes follow from their index (byte j: (idx + j) mod 251;
    the first 8 bytes hold the index)."""
    base = (np.arange(size) % 251).astype(np.uint16)
    shift = (keys % np.uint64(251)).astype(np.uint16)
    rows = ((base[None, :] + shift[:, None]) % 251).astype(np.uint8)
    rows[:, :8] = keys.view(np.uint8).reshape(-1, 8)
    return rows


def check(data: np.ndarray, idx: np.ndarray, size: int) -> bool:
    """Every byte of every sampled item as inserted (idx: what its key names)."""
    return bool(np.array_equal(data, items(idx, size)))


def stride_of(size: int) -> int:
    from distore_ucx.spec import TableSpec
    from distore_ucx.storage import tier

    return tier.stride_of(TableSpec.parse(((size,), "uint8")).slot_size)


def hugepage_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of private anonymous memory, 2 MiB aligned, transparent
    hugepages asked for (madvise) and faulted in address order: as
    physically contiguous as the kernel allows, the memory the disk reads
    best into (the node's DiskReader makes its bounce memory the same way)."""
    raw = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        raw.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(raw, np.uint8)
    start = (-whole.ctypes.data) % (2 << 20)
    buf = whole[start:start + nbytes]
    buf[:] = 0
    return buf


def block_stat_path(path: str) -> str | None:
    """/sys/dev/block/M:m/stat of the device holding `path`, or None."""
    dev = os.stat(path).st_dev
    stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat if os.path.exists(stat) else None


def block_stat(path: str | None) -> tuple[int, int] | None:
    """(read requests completed, sectors read) of a block device, or None."""
    if path is None:
        return None
    try:
        fields = open(path).read().split()
        return int(fields[0]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def timed(fn, seconds: float) -> tuple[int, float, list[float]]:
    """Call fn() back to back for `seconds`: (calls, wall s, per-call s)."""
    lat = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return len(lat), time.perf_counter() - t0, lat


def slices_run(args, size: int, batch: int, out: JsonLines) -> list[dict]:
    """One step size of a table of slices: fill, then alternate disk
    baselines (slot by slot, and one read a slice) and cold sampling."""
    import distore_ucx as ds
    from distore_ucx._native_loader import _native
    from distore_ucx.transport import rpc

    T, envs = args.slices, 4
    stride = stride_of(size)
    rows_per_batch = batch * T
    staging = 8 * rows_per_batch * stride
    hot_items = 128  # two writer batches: an insert needs room for its batch
    arena = staging + hot_items * stride + MiB
    length = 4 * T  # steps an episode
    n_items = args.table_bytes // size // (envs * length) * (envs * length)
    disk = (n_items + 2 * rows_per_batch) * stride + MiB
    tier_dir = os.path.join(args.dir, f"tier-slices-{size}")
    os.makedirs(tier_dir, exist_ok=True)
    rows = []
    with ds.LocalCluster(nodes=1, arena_bytes=arena, disk_bytes=disk, disk_staging=staging,
                         disk_dir=tier_dir, log_level="WARNING") as cluster:
        client = ds.connect(cluster.address)
        client.create_table("cold", capacity=n_items, spec=((size,), "uint8"), slice_len=T)
        log(f"{size} B steps, slices of {T}: filling {n_items} steps "
            f"({n_items * size / 1e9:.2f} GB), arena {arena} B of which {staging} B staging")
        t0 = time.perf_counter()
        key_to_idx = {}
        env = np.tile(np.arange(envs), 16)  # a vectorized actor: 16 steps of 4 envs a call
        with client.writer(max_items=len(env)) as writer:
            for start in range(0, n_items, len(env)):
                idx = np.arange(start, start + len(env), dtype=np.uint64)
                pos = (idx // np.uint64(envs)) % np.uint64(length)
                keys = writer.append("cold", items(idx, size), env=env,
                                     done=pos == np.uint64(length - 1))
                key_to_idx.update(zip(keys.tolist(), idx.tolist()))
        fill_s = time.perf_counter() - t0
        hot_fraction = 1 - client.table_info("cold")["cold"] / n_items
        client.close()
        log(f"filled in {fill_s:.1f} s, {100 * hot_fraction:.1f}% hot")
        reader = ds.connect(cluster.address)
        learner = reader.learner("cold", batch_size=batch)
        node = rpc.RpcClient(reader.nodes()[0]["address"], token=reader.token)

        def node_reads():
            return node.call("node_info").get("disk_reads")

        def verify(b) -> bool:
            idx = np.array([key_to_idx[int(k)] for k in b.step_keys.ravel()], np.uint64)
            return check(np.asarray(b.data).reshape(len(idx), size), idx, size)

        fd = os.open(cluster.disk_path(0), os.O_RDONLY | os.O_DIRECT)
        rng = np.random.default_rng(1)
        used = n_items - hot_items - T
        scratch = hugepage_buffer(rows_per_batch * stride)
        disk_stat = block_stat_path(args.dir)

        def raw_steps():  # B slices of T slots, slot by slot
            first = rng.integers(0, used, batch).astype(np.uint64)
            offsets = ALIGN + ((first[:, None] + np.arange(T, dtype=np.uint64)) *
                               np.uint64(stride)).ravel()
            assert (_native.disk_read_raw(fd, offsets, stride, 8, scratch) == 0).all()

        def raw_runs():  # each slice as one read of T slots
            first = rng.integers(0, used, batch).astype(np.uint64)
            offsets = ALIGN + first * np.uint64(stride)
            assert (_native.disk_read_raw(fd, offsets, T * stride, 8, scratch) == 0).all()

        def ours():
            ours.last = learner.sample()

        bad = 0
        learner.sample()  # warm: endpoints, mappings
        for run in range(args.runs):
            for what, fn in (("disk_o_direct_qd8", raw_steps),
                             ("disk_o_direct_qd8_runs", raw_runs),
                             ("cold_sample", ours)):
                before, reads0 = block_stat(disk_stat), node_reads()
                samples0 = reader.table_info("cold")["samples"]
                calls, wall, lat = timed(fn, args.seconds)
                after, reads1 = block_stat(disk_stat), node_reads()
                row = {"size": size, "batch": batch, "slice_len": T, "what": what, "run": run,
                       "gbps": calls * rows_per_batch * size / wall / 1e9,
                       "p50_ms": 1e3 * statistics.median(lat),
                       "hot_fraction": hot_fraction, "fill_s": fill_s}
                if what == "cold_sample" and reads0 is not None:
                    # every slice asked for (`samples` counts slices), those asked ahead too
                    slices = reader.table_info("cold")["samples"] - samples0
                    row["node_reads_per_slice"] = (reads1 - reads0) / max(1, slices)
                if before is not None and after is not None:
                    reads, sectors = after[0] - before[0], after[1] - before[1]
                    row["disk_requests_per_item"] = reads / max(1, calls * rows_per_batch)
                    row["disk_kib_per_request"] = sectors * 512 / 1024 / max(1, reads)
                out.write(row)
                rows.append(row)
            bad += not verify(ours.last)
        os.close(fd)
        for _ in range(10):
            bad += not verify(learner.sample())
        rows += checked(bad, args.runs + 10, size, "steps")
        node.close()
        learner.close()
        reader.close()
    shutil.rmtree(tier_dir, ignore_errors=True)
    return rows


def cold_run(args, size: int, batch: int, out: JsonLines) -> list[dict]:
    """One size: fill, then alternate disk baselines and cold sampling."""
    import distore_ucx as ds
    from distore_ucx._native_loader import _native

    stride = stride_of(size)
    # Two learners, each holding the cold items of 3 batches (the one read,
    # two asked ahead), and room for one more each while releases travel.
    staging = 8 * batch * stride
    hot_items = 4
    arena = staging + hot_items * stride + MiB
    n_items = args.table_bytes // size
    disk = (n_items + 2 * batch) * stride + MiB
    tier_dir = os.path.join(args.dir, f"tier-{size}")
    os.makedirs(tier_dir, exist_ok=True)
    rows = []
    with ds.LocalCluster(nodes=1, arena_bytes=arena, disk_bytes=disk, disk_staging=staging,
                         disk_dir=tier_dir, log_level="WARNING") as cluster:
        client = ds.connect(cluster.address)
        client.create_table("cold", capacity=n_items, spec=((size,), "uint8"))
        log(f"{size} B items: filling {n_items} items ({n_items * size / 1e9:.2f} GB), "
            f"arena {arena} B of which {staging} B staging")
        t0 = time.perf_counter()
        key_to_idx = {}
        with client.writer(max_items=max(1, 32 * MiB // size)) as writer:
            for start in range(0, n_items, 16):
                idx = np.arange(start, min(n_items, start + 16), dtype=np.uint64)
                keys = writer.insert("cold", items(idx, size))
                key_to_idx.update(zip(keys.tolist(), idx.tolist()))
        fill_s = time.perf_counter() - t0
        client.close()
        log(f"filled in {fill_s:.1f} s")
        reader = ds.connect(cluster.address)
        learner = reader.learner("cold", batch_size=batch)
        iterating = iter(reader.learner("cold", batch_size=batch, prefetch=2))

        def verify(b) -> bool:
            idx = np.array([key_to_idx[int(k)] for k in b.keys], np.uint64)
            return check(np.asarray(b.data), idx, size)

        fd = os.open(cluster.disk_path(0), os.O_RDONLY | os.O_DIRECT)
        rng = np.random.default_rng(1)
        used = n_items - hot_items

        # The disk's best: physically contiguous memory, which it reads in one
        # request per item (the node reads through such buffers too).
        scratch = hugepage_buffer(2 * batch * stride)  # reused like a ring
        halves = (scratch[:batch * stride], scratch[batch * stride:])
        disk_stat = block_stat_path(args.dir)

        turns = itertools.count()

        def raw(threads, buffers=1):
            offsets = ALIGN + rng.integers(0, used, batch).astype(np.uint64) * np.uint64(stride)
            st = _native.disk_read_raw(fd, offsets, stride, threads,
                                       halves[next(turns) % buffers])
            assert (st == 0).all(), st

        def ours():
            ours.last = learner.sample()

        def ours_iterating():
            ours_iterating.last = next(iterating)

        bad = 0
        learner.sample()  # warm: endpoints, mappings
        next(iterating)
        for run in range(args.runs):
            for what, fn in (("disk_o_direct_qd8", lambda: raw(8)),
                             ("disk_o_direct_qd1", lambda: raw(1)),
                             ("disk_o_direct_qd8_2buf", lambda: raw(8, 2)),
                             ("cold_sample", ours),
                             ("cold_iterate_prefetch2", ours_iterating)):
                before = block_stat(disk_stat)
                calls, wall, lat = timed(fn, args.seconds)
                after = block_stat(disk_stat)
                row = {"size": size, "batch": batch, "what": what, "run": run,
                       "gbps": calls * batch * size / wall / 1e9,
                       "p50_ms": 1e3 * statistics.median(lat),
                       "hot_fraction": hot_items / n_items, "fill_s": fill_s}
                if before is not None and after is not None:
                    # Read requests the disk completed per item read, and their
                    # size: how far the kernel split each item's read.
                    reads, sectors = after[0] - before[0], after[1] - before[1]
                    row["disk_requests_per_item"] = reads / max(1, calls * batch)
                    row["disk_kib_per_request"] = sectors * 512 / 1024 / max(1, reads)
                out.write(row)
                rows.append(row)
            bad += not verify(ours.last)  # the last batch of each run, byte for byte
            bad += not verify(ours_iterating.last)
        os.close(fd)
        for _ in range(20):  # and 20 more, untimed
            bad += not verify(learner.sample())
        rows += checked(bad, 2 * args.runs + 20, size, "items")
        learner.close()
        reader.close()
    shutil.rmtree(tier_dir, ignore_errors=True)
    return rows


def hot_run(args, out: JsonLines) -> list[dict]:
    """Hot sampling from nodes with and without a disk tier, alternated."""
    import distore_ucx as ds

    size, batch, n = 112_896, 32, 400
    rows = []
    tier_dir = os.path.join(args.dir, "tier-hot")
    os.makedirs(tier_dir, exist_ok=True)
    with ds.LocalCluster(nodes=1, arena_bytes=256 * MiB, log_level="WARNING") as plain, \
            ds.LocalCluster(nodes=1, arena_bytes=256 * MiB, disk_bytes=256 * MiB,
                            disk_dir=tier_dir, log_level="WARNING") as tiered:
        learners = {}
        for name, cluster in (("no_disk_tier", plain), ("with_disk_tier", tiered)):
            client = ds.connect(cluster.address)
            client.create_table("hot", capacity=n, spec=((size,), "uint8"))
            with client.writer(max_items=64) as writer:
                keys = writer.insert("hot", np.zeros((n, size), np.uint8))
            del keys
            learners[name] = client.learner("hot", batch_size=batch)
            learners[name].sample()
        for run in range(args.runs):
            for name, learner in learners.items():
                calls, wall, lat = timed(learner.sample, args.seconds)
                row = {"size": size, "batch": batch, "what": f"hot_sample_{name}", "run": run,
                       "gbps": calls * batch * size / wall / 1e9,
                       "p50_ms": 1e3 * statistics.median(lat)}
                out.write(row)
                rows.append(row)
        for learner in learners.values():
            learner.close()
    shutil.rmtree(tier_dir, ignore_errors=True)
    return rows


def capacity_run(args, out: JsonLines) -> list[dict]:
    """A table 4x the nodes' arenas: fill 1.5x its capacity (evicting),
    then sample with every item's bytes checked."""
    import distore_ucx as ds

    size, batch, arena, staging = 112_896, 32, 64 * MiB, 16 * MiB
    stride = stride_of(size)
    from distore_ucx.spec import TableSpec

    slot = TableSpec.parse(((size,), "uint8")).slot_size
    capacity = 4 * 2 * (arena // slot)
    total = capacity + capacity // 2
    tier_dir = os.path.join(args.dir, "tier-4x")
    os.makedirs(tier_dir, exist_ok=True)
    with ds.LocalCluster(nodes=2, arena_bytes=arena, disk_bytes=capacity * stride,
                         disk_staging=staging, disk_dir=tier_dir, log_level="WARNING") as c:
        client = ds.connect(c.address)
        client.create_table("big", capacity=capacity, spec=((size,), "uint8"))
        key_to_idx = {}
        t0 = time.perf_counter()
        with client.writer(max_items=64, max_in_flight=1) as writer:
            for start in range(0, total, 256):
                idx = np.arange(start, min(total, start + 256), dtype=np.uint64)
                keys = writer.insert("big", items(idx, size))
                key_to_idx.update(zip(keys.tolist(), idx.tolist()))
        fill_s = time.perf_counter() - t0
        info = client.table_info("big")
        learner = client.learner("big", batch_size=batch)
        bad = evicted = 0
        seen = set()
        t0 = time.perf_counter()
        for _ in range(args.check_batches):
            b = learner.sample()
            idx = np.array([key_to_idx[int(k)] for k in b.keys], np.uint64)
            bad += not check(np.asarray(b.data), idx, size)
            evicted += int((idx < total - capacity).sum())
            seen.update(idx.tolist())
        sample_s = time.perf_counter() - t0
        row = {"what": "table_4x_arenas", "size": size, "batch": batch,
               "arena_bytes_per_node": arena, "nodes": 2, "capacity": capacity,
               "inserted": total, "size_after": info["size"], "deletes": info["deletes"],
               "fill_s": fill_s, "fill_gbps": total * size / fill_s / 1e9,
               "batches_checked": args.check_batches, "items_checked": args.check_batches * batch,
               "distinct_items": len(seen), "bad_batches": bad, "evicted_sampled": evicted,
               "sample_gbps_checked": args.check_batches * batch * size / sample_s / 1e9}
        out.write(row)
        learner.close()
        client.close()
    shutil.rmtree(tier_dir, ignore_errors=True)
    ok = (bad == 0 and evicted == 0 and info["size"] == capacity
          and info["deletes"] == total - capacity)
    log(f"table 4x the arenas: {'OK' if ok else 'FAILED'} ({row})")
    return [row] + ([] if ok else [{"size": size, "what": "mismatch"}])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/distore-tier-bench",
                   help="where the tier files go (the disk under test)")
    p.add_argument("--sizes", default="3MiB:8,10MiB:4", help="SIZE:BATCH,...")
    p.add_argument("--table-bytes", default="768MiB", help="bytes of items per table (on disk)")
    p.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    p.add_argument("--runs", type=int, default=3, help="alternations of baseline and ours")
    p.add_argument("--tls", default="sm", help="UCX_TLS (the learner maps same-host arenas)")
    p.add_argument("--slices", type=int, default=0, metavar="T",
                   help="tables of slices of T steps (SIZE: a step, BATCH: slices a sample)")
    p.add_argument("--hot", action="store_true", help="also compare hot sampling")
    p.add_argument("--capacity", action="store_true",
                   help="also fill a table 4x the nodes' arenas and check sampled contents")
    p.add_argument("--check-batches", type=int, default=200, help="with --capacity")
    p.add_argument("--skip-cold", action="store_true", help="skip the cold bandwidth runs")
    p.add_argument("--json-out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    apply_ucx_env(args.tls)
    from distore_ucx.config import parse_size

    args.table_bytes = parse_size(args.table_bytes)
    rows = []
    with JsonLines(args.json_out) as out:
        for part in ([] if args.skip_cold else args.sizes.split(",")):
            size, batch = part.split(":")
            run = slices_run if args.slices else cold_run
            rows += run(args, parse_size(size), int(batch), out)
        if args.capacity:
            rows += capacity_run(args, out)
        if args.hot:
            rows += hot_run(args, out)
    bad = any(r["what"] == "mismatch" for r in rows)
    table = []
    by = {}
    for r in rows:
        if r["what"] not in ("mismatch", "table_4x_arenas"):
            by.setdefault((r["size"], r["batch"], r["what"]), []).append(r)
    for (size, batch, what), rs in by.items():
        med = statistics.median(r["gbps"] for r in rs)
        base = by.get((size, batch, "disk_o_direct_qd8")) if what.startswith("cold") else \
            by.get((size, batch, "hot_sample_no_disk_tier")) if what.startswith("hot") else None
        ratio = med / statistics.median(r["gbps"] for r in base) if base else None
        base2 = by.get((size, batch, "disk_o_direct_qd8_2buf")) if what.startswith("cold") \
            else None
        ratio2 = med / statistics.median(r["gbps"] for r in base2) if base2 else None
        table.append([f"{size / MiB:.2f} MiB" if size >= MiB else f"{size / 1e3:.0f} KB",
                      str(batch), what, " ".join(fmt(r["gbps"], ".2f") for r in rs),
                      fmt(med, ".2f"), fmt(statistics.median(r["p50_ms"] for r in rs), ".1f"),
                      fmt(ratio, ".2f"), fmt(ratio2, ".2f"),
                      fmt(statistics.median(r["disk_requests_per_item"] for r in rs), ".2f")
                      if all("disk_requests_per_item" in r for r in rs) else "-",
                      fmt(statistics.median(r["node_reads_per_slice"] for r in rs), ".2f")
                      if all("node_reads_per_slice" in r for r in rs) else "-"])
    common.print_table(["item", "batch", "what", "GB/s per run", "median", "p50 ms",
                        "vs baseline (qd8)", "vs qd8_2buf", "disk req/item",
                        "node reads/slice"], table)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
