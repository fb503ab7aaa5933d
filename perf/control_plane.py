"""Control-plane speed: the native sum tree, remote priority updates, and the
CPU the control plane spends deciding a sample.

Measures, in one run:

sum_tree_updates
    `SumTree.set` of batches of 1024 random leaves of a 10^6-leaf tree, and
    `TableCore.update_priorities` (by key: hash lookup + tree update) on a
    prioritized table of 10^6 items. Baseline: a numpy scatter of the same
    values into a flat array (no tree), the floor of any update.
full_fifo
    `TableCore.insert` in batches of 4096 into a full table of 2^20 items
    with a FIFO remover (each insert evicts the oldest; evicted ids are
    reused by the next batch, as the item store does), prioritized and
    uniform samplers, for --seconds-full s: inserts/s. Baseline: the same
    inserts into a table with room (no eviction), in the same run.
sample_256
    `TableCore.sample(256)` from 10^6 prioritized items: latency p50/p99.
    Baseline: numpy inverse-CDF sampling (cumsum + searchsorted) over the
    same weights, which is O(n) per batch.
remote_updates
    `learner.update_priorities` of 1024 and of 32 keys a call, back to back,
    through a live LocalCluster (control plane in another process): keys/s
    until every update is applied (`flush_priorities`); and the control
    connection's round trip (`table_info`) p50. Baseline, with
    --reverb-python (a Python that has dm-reverb): DeepMind Reverb's
    `mutate_priorities` of as many keys, 1024 and 32 a call, on a Reverb
    server in another process, in the same run (perf/reverb_updates.py).
decide_32
    CPU time (process_time) the control plane's own sample path spends on a
    batch of 32 (selection, leases, reply encoding), in-process.
checkpoint
    A prioritized table of --checkpoint-items items (10^6): the snapshot the
    event loop takes (`Table.image`), writing the file (fsync + rename),
    reading and rebuilding it, and the control plane's work when nodes
    re-send every item in batches of 65,536. Baseline: `np.save` + fsync of
    the same arrays (the floor of writing those bytes).
memory (--only memory; not in the default run)
    The control plane's memory per item (issue #16): for each size in
    --memory-items and each table kind (prioritized sampler + FIFO remover,
    uniform sampler + FIFO remover), a fresh subprocess builds a real
    `Table` of that capacity, inserts that many items through `Table.add` in
    batches of 4096 (as the server does), and reports the RSS it grew by
    per item (and the peak); then inserts as many again into the full
    table (each insert evicts the oldest item, a running buffer's steady
    state) and reports the RSS growth per item once more. Split by
    structure: numpy columns of the ItemStore, and the native TableCore's
    own count of its vectors. Then `Table.sample(256)`, the reply's
    locations and `unlease`: p50/p99 (the server's sample path, without
    the network).
    Baseline: the same p50 at the smallest size, in the same run.
sample_e2e (--only sample_e2e; not in the default run)
    What a learner sees: `learner.sample()` of batch 256 (prefetch off: one
    control-plane round trip and one read of the items per batch) from a
    prioritized table of each size in --e2e-items (10^3 and 10^7), one
    storage node, 8-byte items, through a LocalCluster. p50/p99. Baseline:
    the p50 at the smallest size, in the same run.

Prints JSON lines and a table.

    cd /tmp && <venv>/bin/python <repo>/perf/control_plane.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

N = 1_000_000


def stats(samples_s: list[float]) -> dict:
    a = np.array(samples_s) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 2),
            "p99_us": round(float(np.percentile(a, 99)), 2)}


def bench_updates(args, out):
    from distore_ucx import _tables
    from distore_ucx.selectors import KINDS

    rng = np.random.default_rng(0)
    tree = _tables.SumTree(N)
    tree.set(np.arange(N, dtype=np.int64), rng.uniform(0.1, 2, N))
    batches = [rng.integers(0, N, 1024) for _ in range(args.batches)]
    values = [rng.uniform(0.1, 2, 1024) for _ in range(args.batches)]
    t = time.perf_counter()
    for idx, v in zip(batches, values):
        tree.set(idx, v)
    tree_rate = len(batches) * 1024 / (time.perf_counter() - t)

    core = _tables.TableCore(KINDS.index("prioritized"), 0.6, KINDS.index("fifo"), 1.0, N, 0, 1)
    keys = np.arange(N, dtype=np.uint64)
    core.insert(np.arange(N, dtype=np.int64), keys, rng.uniform(0.1, 2, N))
    kb = [keys[b] for b in batches]
    t = time.perf_counter()
    for k, v in zip(kb, values):
        core.update_priorities(k, v)
    core_rate = len(batches) * 1024 / (time.perf_counter() - t)

    flat = np.zeros(N)
    t = time.perf_counter()
    for idx, v in zip(batches, values):
        flat[idx] = v
    numpy_rate = len(batches) * 1024 / (time.perf_counter() - t)
    row = {"bench": "sum_tree_updates", "items": N, "batch": 1024,
           "sum_tree_per_s": round(tree_rate), "table_core_per_s": round(core_rate),
           "numpy_scatter_per_s": round(numpy_rate)}
    out.append(row)
    print(json.dumps(row), flush=True)
    return core, rng


def bench_full_fifo(args, out):
    from distore_ucx import _tables
    from distore_ucx.selectors import KINDS

    n, b = 1 << 20, 4096
    for sampler in ("prioritized", "uniform"):
        rates = {}
        for full in (False, True):
            t = _tables.TableCore(KINDS.index(sampler), 0.6, KINDS.index("fifo"), 1.0,
                                  n if full else 1 << 31, 0, 7)
            ids = np.arange(n, dtype=np.int64)
            for i in range(0, n, b):
                t.insert(ids[i:i + b], ids[i:i + b].astype(np.uint64),
                         np.random.default_rng(i).random(b) + 0.1)
            nxt, key, done = np.arange(n, n + b, dtype=np.int64), n, 0
            prios = np.random.default_rng(1).random(b) + 0.1
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds_full:
                keys = np.arange(key, key + b, dtype=np.uint64)
                evicted = t.insert(nxt, keys, prios)
                key += b
                done += b
                # full: the evicted ids come back; with room: fresh ids
                nxt = (np.asarray(evicted, np.int64) if full
                       else np.arange(key, key + b, dtype=np.int64))
            rates[full] = done / (time.perf_counter() - t0)
        row = {"bench": "full_fifo", "sampler": sampler, "items": n, "batch": b,
               "full_per_s": round(rates[True]), "with_room_per_s": round(rates[False])}
        out.append(row)
        print(json.dumps(row), flush=True)


def bench_sample(args, core, rng, out):
    lat = []
    for _ in range(args.iters):
        t = time.perf_counter()
        core.sample(256)
        lat.append(time.perf_counter() - t)
    w = rng.uniform(0.1, 2, N) ** 0.6
    base = []
    for _ in range(max(20, args.iters // 50)):
        t = time.perf_counter()
        c = np.cumsum(w)
        np.searchsorted(c, rng.uniform(0, c[-1], 256))
        base.append(time.perf_counter() - t)
    row = {"bench": "sample_256", "items": N, **stats(lat),
           "numpy_cdf_p50_us": stats(base)["p50_us"]}
    out.append(row)
    print(json.dumps(row), flush=True)


def bench_decide(args, out):
    from distore_ucx import protocol
    from distore_ucx.control.leases import Leases
    from distore_ucx.control.tables import Table
    from distore_ucx.selectors import Prioritized, Uniform
    from distore_ucx.spec import TableSpec

    spec = TableSpec.parse(((112896,), "uint8"))
    for sampler in (Uniform(), Prioritized(0.6)):
        table = Table.make("t", N, spec, sampler=sampler, seed=3)
        k = np.arange(N, dtype=np.uint64)
        table.add(1, k, k * np.uint64(spec.slot_size), k, np.ones(N))
        leases = Leases(30.0)
        prev: list[int] = []
        cpu = []
        for _ in range(args.iters):
            t = time.process_time_ns()
            for lease in leases.take(prev)[0]:
                table.unlease(lease.recs)
            recs, probs, _ = table.sample(32)
            lid = leases.grant("t", recs)
            protocol.encode(protocol.reply(
                7, lease=lid, table_size=table.size, items=table.locations(recs),
                probabilities=probs))
            prev = [lid]
            cpu.append((time.process_time_ns() - t) / 1e9)
        row = {"bench": "decide_32", "sampler": sampler.kind, "items": N, **stats(cpu)}
        out.append(row)
        print(json.dumps(row), flush=True)


def bench_remote(args, out):
    import distore_ucx as ds

    n = args.remote_items
    with ds.LocalCluster(nodes=1, arena_bytes=max(64 << 20, n * 64 * 2),
                         log_level="WARNING") as cluster, ds.connect(cluster.address) as client:
        client.create_table("p", capacity=n, spec=((8,), "uint8"),
                            sampler=ds.Prioritized(0.6))
        with client.writer(max_items=4096) as w:
            keys = np.concatenate([
                w.insert("p", np.zeros((4096, 8), np.uint8)) for _ in range(n // 4096)
            ])
        learner = client.learner("p", batch_size=32)
        rng = np.random.default_rng(1)
        # A build before updates were not waited for has no flush_priorities:
        # each update_priorities call waited for its reply there.
        flush = getattr(learner, "flush_priorities", lambda: None)
        for per_call in (1024, 32):
            calls = args.batches * 1024 // per_call
            batches = [keys[rng.integers(0, len(keys), per_call)] for _ in range(calls)]
            prios = rng.uniform(0.1, 2, per_call)
            learner.update_priorities(batches[0], prios)
            flush()
            lat = []
            t0 = time.perf_counter()
            for b in batches:
                t = time.perf_counter()
                learner.update_priorities(b, prios)
                lat.append(time.perf_counter() - t)
            flush()  # the rate counts every update applied
            rate = calls * per_call / (time.perf_counter() - t0)
            row = {"bench": "remote_updates", "items": len(keys), "batch": per_call,
                   "keys_per_s": round(rate), **stats(lat)}
            out.append(row)
            print(json.dumps(row), flush=True)
        rtt = []
        for _ in range(200):
            t = time.perf_counter()
            client.call("table_info", name="p")
            rtt.append(time.perf_counter() - t)
    row = {"bench": "control_rtt", "p50_us": stats(rtt)["p50_us"]}
    out.append(row)
    print(json.dumps(row), flush=True)
    if args.reverb_python:
        bench_reverb(args, out)


def bench_reverb(args, out):
    """Reverb's updates of as many keys, 1024 and 32 a call, in a child
    process under --reverb-python (perf/reverb_updates.py); each row gets
    the store's rate of the same size beside it."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reverb_updates.py")
    done = subprocess.run([args.reverb_python, script, "--items", str(args.remote_items),
                           "--batches", str(args.batches)], stdout=subprocess.PIPE, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"perf/reverb_updates.py under {args.reverb_python} failed (exit "
                         f"{done.returncode}; its errors are above): does that Python have "
                         "dm-reverb? (pip install dm-reverb==0.14.0 tensorflow==2.15.0)")
    ours = {r["batch"]: r["keys_per_s"] for r in out if r["bench"] == "remote_updates"}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        row["ours_keys_per_s"] = ours.get(row["batch"])
        if row["ours_keys_per_s"]:
            row["ours_vs_reverb"] = round(row["ours_keys_per_s"] / row["keys_per_s"], 2)
        out.append(row)
        print(json.dumps(row), flush=True)


def bench_checkpoint(args, out):
    import os
    import tempfile

    from distore_ucx.control import checkpoint
    from distore_ucx.control.tables import Table
    from distore_ucx.selectors import Prioritized
    from distore_ucx.spec import TableSpec

    n = args.checkpoint_items
    spec = TableSpec.parse(((112896,), "uint8"))
    rng = np.random.default_rng(4)
    table = Table.make("t", n, spec, sampler=Prioritized(0.6), seed=3)
    keys = rng.permutation(np.arange(n, dtype=np.uint64) + (np.uint64(1) << np.uint64(40)))
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(spec.slot_size)
    table.add(1, keys, offsets, offsets, rng.uniform(0.1, 2, n))
    table.unlease(table.sample(min(n, 100_000))[0])  # some use counts
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as folder:
        path = os.path.join(folder, "ckpt")
        t = time.perf_counter()
        image = checkpoint.Image([table.image()])
        snapshot = time.perf_counter() - t
        t = time.perf_counter()
        size = checkpoint.write(path, image)
        write = time.perf_counter() - t
        t = time.perf_counter()
        back = checkpoint.read(path)
        restored = Table.from_image(back.tables[0], seed=3)
        read = time.perf_counter() - t
        t = time.perf_counter()
        step = 1 << 16
        for i in range(0, n, step):
            restored.restore_items(1, keys[i:i + step], offsets[i:i + step],
                                   offsets[i:i + step], np.ones(len(keys[i:i + step])))
        resend = time.perf_counter() - t
        assert restored.size == n and restored.end_restore() == 0
        t = time.perf_counter()
        with open(os.path.join(folder, "base.npy"), "wb") as fh:
            for a in (image.tables[0].keys, image.tables[0].priorities,
                      image.tables[0].times_sampled, image.tables[0].sequences):
                np.save(fh, a)
            fh.flush()
            os.fsync(fh.fileno())
        baseline = time.perf_counter() - t
    row = {"bench": "checkpoint", "items": n, "file_bytes": size,
           "bytes_per_item": round(size / n, 1), "snapshot_s": round(snapshot, 3),
           "write_s": round(write, 3), "read_rebuild_s": round(read, 3),
           "resend_s": round(resend, 3), "np_save_s": round(baseline, 3)}
    out.append(row)
    print(json.dumps(row), flush=True)


def _rss_kib(field: str = "VmRSS") -> int:
    """This process's resident memory (or another /proc/self/status field), KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _resident_bytes(a: np.ndarray) -> int:
    """Bytes of `a` in memory now (pages written at least once), by mincore(2)."""
    import ctypes
    import mmap

    if a.nbytes == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    length = a.ctypes.data + a.nbytes - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return int(a.nbytes)
    return sum(v & 1 for v in vec) * page


def memory_child(n: int, kind: str, iters: int) -> dict:
    """One size, one table kind, in this (fresh) process: bytes per item."""
    from distore_ucx.control.tables import Table
    from distore_ucx.selectors import Fifo, Prioritized, Uniform
    from distore_ucx.spec import TableSpec

    spec = TableSpec.parse(((8,), "uint8"))
    sampler = Prioritized(0.6) if kind == "prioritized" else Uniform()
    step = 4096
    rng = np.random.default_rng(5)
    # The inputs are made before the first reading, so that only the
    # table's own memory is counted.
    keys = np.arange(n, dtype=np.uint64) + (np.uint64(7) << np.uint64(40))
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(spec.slot_size)
    prios = rng.uniform(0.1, 2, n)
    # A second n keys, inserted into the full table: every insert evicts the
    # oldest item (the FIFO remover), the steady state of a running buffer.
    keys2 = keys + np.uint64(n)
    before = _rss_kib()
    table = Table.make("t", n, spec, sampler=sampler, remover=Fifo(), seed=3)

    def fill(with_keys) -> float:
        """Insert n items with these keys in the server's batches; seconds."""
        t = time.perf_counter()
        for i in range(0, n, step):
            table.add(1, with_keys[i:i + step], offsets[i:i + step], offsets[i:i + step],
                      prios[i:i + step])
        assert table.size == n
        return time.perf_counter() - t

    fill_s = fill(keys)
    after = _rss_kib()
    evict_s = fill(keys2)
    after_evicting = _rss_kib()
    s = table.store
    parts = {f"store.{name}": _resident_bytes(col) for name, col in s.cols.items()}
    parts.update({f"store.{k}": int(v) for k, v in getattr(s, "extra_nbytes", dict)().items()})
    usage = getattr(table.core, "memory_usage", None)
    if usage is not None:
        parts.update({f"core.{k}": int(v) for k, v in usage().items()})
    lat = []
    for _ in range(iters):
        t = time.perf_counter()
        recs, _, _ = table.sample(256)
        if hasattr(table, "locations"):
            table.locations(recs)  # the reply's items, as the server gathers them
        else:
            s.location[recs]
        table.unlease(recs)
        lat.append(time.perf_counter() - t)
    return {"bench": "memory", "kind": kind, "items": n,
            "bytes_per_item": round((after - before) * 1024 / n, 1),
            "bytes_per_item_after_evicting": round((after_evicting - before) * 1024 / n, 1),
            "peak_bytes_per_item": round((_rss_kib("VmHWM") - before) * 1024 / n, 1),
            "parts_bytes_per_item": {k: round(v / n, 2) for k, v in parts.items()},
            "fill_s": round(fill_s, 2), "evicting_fill_s": round(evict_s, 2),
            "sample_256": stats(lat)}


def bench_memory(args, out):
    """Control-plane bytes per item at each size, one fresh process each."""
    import subprocess

    rows = []
    for kind in ("prioritized", "uniform"):
        for n in args.memory_items:
            proc = subprocess.run(
                [sys.executable, __file__, "--memory-child", str(n), kind,
                 "--iters", str(args.iters)],
                capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {kind} {n} failed:\n{proc.stderr}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            first = next((r for r in rows if r["kind"] == kind), row)
            row["sample_p50_vs_smallest"] = round(
                row["sample_256"]["p50_us"] / first["sample_256"]["p50_us"], 2)
            rows.append(row)
            out.append(row)
            print(json.dumps(row), flush=True)


def bench_sample_e2e(args, out):
    """learner.sample(256) p50/p99 through a LocalCluster at each size."""
    import distore_ucx as ds

    first = None
    for n in args.e2e_items:
        slot = ds.TableSpec.parse(((8,), "uint8")).slot_size
        with ds.LocalCluster(nodes=1, arena_bytes=max(64 << 20, n * slot + (64 << 20)),
                             log_level="WARNING") as cluster, \
                ds.connect(cluster.address) as client:
            client.create_table("p", capacity=n, spec=((8,), "uint8"),
                                sampler=ds.Prioritized(0.6))
            step = min(n, 1 << 16)
            t = time.perf_counter()
            with client.writer(max_items=step) as w:
                for _ in range(n // step):
                    w.insert("p", np.zeros((step, 8), np.uint8))
            fill_s = time.perf_counter() - t
            learner = client.learner("p", batch_size=256, prefetch=0)
            for _ in range(50):
                learner.sample()
            lat = []
            for _ in range(args.e2e_iters):
                t = time.perf_counter()
                learner.sample()
                lat.append(time.perf_counter() - t)
            learner.close()
        row = {"bench": "sample_e2e", "items": n, "batch": 256, **stats(lat),
               "fill_s": round(fill_s, 1)}
        first = first or row
        row["p50_vs_smallest"] = round(row["p50_us"] / first["p50_us"], 2)
        out.append(row)
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=2000, help="update batches of 1024")
    p.add_argument("--iters", type=int, default=5000, help="sample batches")
    p.add_argument("--remote-items", type=int, default=262_144,
                   help="items in the remote-update table")
    p.add_argument("--checkpoint-items", type=int, default=N,
                   help="items in the checkpointed table")
    p.add_argument("--checkpoint-dir", default=None,
                   help="folder (on the disk to measure) for the checkpoint file")
    p.add_argument("--memory-items", type=int, nargs="+",
                   default=[1_000, 100_000, 1_000_000, 10_000_000],
                   help="table sizes for --only memory (one fresh process each)")
    p.add_argument("--e2e-items", type=int, nargs="+", default=[1_000, 10_000_000],
                   help="table sizes for --only sample_e2e")
    p.add_argument("--e2e-iters", type=int, default=2000, help="learner samples a size")
    p.add_argument("--memory-child", nargs=2, metavar=("N", "KIND"), help=argparse.SUPPRESS)
    p.add_argument("--seconds-full", type=float, default=2.0,
                   help="seconds of inserts into a full FIFO table (full_fifo)")
    p.add_argument("--only", choices=("updates", "full_fifo", "decide", "remote", "checkpoint",
                                      "memory", "sample_e2e"),
                   help="run one group (updates includes sample_256)")
    p.add_argument("--reverb-python", metavar="PYTHON",
                   help="remote group: also time Reverb's updates under this Python, which "
                        "has dm-reverb (perf/reverb_updates.py)")
    p.add_argument("--json-out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    if args.memory_child:
        n, kind = args.memory_child
        print(json.dumps(memory_child(int(n), kind, args.iters)), flush=True)
        return 0
    out: list[dict] = []
    if args.only == "memory":
        bench_memory(args, out)
    if args.only == "sample_e2e":
        bench_sample_e2e(args, out)
    if args.only in (None, "updates"):
        core, rng = bench_updates(args, out)
        bench_sample(args, core, rng, out)
    if args.only in (None, "full_fifo"):
        bench_full_fifo(args, out)
    if args.only in (None, "decide"):
        bench_decide(args, out)
    if args.only in (None, "remote"):
        bench_remote(args, out)
    if args.only in (None, "checkpoint"):
        bench_checkpoint(args, out)
    print("\nbench              figure                              baseline (same run)",
          file=sys.stdout)
    for r in out:
        if r["bench"] == "sum_tree_updates":
            print(f"sum_tree_updates   tree {r['sum_tree_per_s'] / 1e6:6.2f} M/s, by key "
                  f"{r['table_core_per_s'] / 1e6:6.2f} M/s   numpy scatter "
                  f"{r['numpy_scatter_per_s'] / 1e6:6.2f} M/s")
        elif r["bench"] == "sample_256":
            print(f"sample_256         p50 {r['p50_us']:7.1f} us, p99 {r['p99_us']:7.1f} us"
                  f"        numpy CDF p50 {r['numpy_cdf_p50_us']:9.1f} us")
        elif r["bench"] == "full_fifo":
            print(f"full_fifo {r['sampler']:<9}{r['full_per_s'] / 1e6:6.2f} M inserts/s (each "
                  f"evicts)         with room {r['with_room_per_s'] / 1e6:6.2f} M/s")
        elif r["bench"] == "decide_32":
            print(f"decide_32 {r['sampler']:<9}p50 {r['p50_us']:7.1f} us CPU, p99 "
                  f"{r['p99_us']:7.1f} us")
        elif r["bench"] == "memory":
            print(f"memory {r['kind']:<11} {r['items']:>9,} items  {r['bytes_per_item']:6.1f} "
                  f"B/item (peak {r['peak_bytes_per_item']:6.1f}, after evicting "
                  f"{r['bytes_per_item_after_evicting']:6.1f}), sample_256 p50 "
                  f"{r['sample_256']['p50_us']:6.1f} us   x{r['sample_p50_vs_smallest']:.2f} "
                  f"of the smallest")
        elif r["bench"] == "sample_e2e":
            print(f"sample_e2e {r['items']:>11,} items  learner.sample(256) p50 "
                  f"{r['p50_us']:7.1f} us, p99 {r['p99_us']:7.1f} us   x{r['p50_vs_smallest']:.2f}"
                  f" of the smallest")
        elif r["bench"] == "checkpoint":
            per = 1e6 / r["items"]
            print(f"checkpoint {r['items'] / 1e6:g} M  snapshot {r['snapshot_s'] * per:.2f} s/M, "
                  f"write {r['write_s'] * per:.2f} s/M ({r['bytes_per_item']:.0f} B/item), "
                  f"read {r['read_rebuild_s'] * per:.2f} s/M, re-send {r['resend_s'] * per:.2f}"
                  f" s/M   np.save {r['np_save_s'] * per:.2f} s/M")
        elif r["bench"] == "reverb_updates":
            print(f"reverb_updates {r['batch']:>5} keys a call  {r['keys_per_s'] / 1e6:6.2f} M "
                  f"keys/s (a call p50 {r['p50_us']:.0f} us; each waits)   ours "
                  f"x{r.get('ours_vs_reverb', float('nan')):.2f}")
        elif r["bench"] == "control_rtt":
            print(f"control RTT p50 {r['p50_us']:.0f} us")
        else:
            print(f"remote_updates {r['batch']:>5} keys a call  {r['keys_per_s'] / 1e6:6.2f} M "
                  f"keys/s (a call p50 {r['p50_us']:.0f} us; all applied)")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
