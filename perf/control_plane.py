"""Control-plane speed: the native sum tree, remote priority updates, and the
CPU the control plane spends deciding a sample.

Measures, in one run:

sum_tree_updates
    `SumTree.set` of batches of 1024 random leaves of a 10^6-leaf tree, and
    `TableCore.update_priorities` (by key: hash lookup + tree update) on a
    prioritized table of 10^6 items. Baseline: a numpy scatter of the same
    values into a flat array (no tree), the floor of any update.
sample_256
    `TableCore.sample(256)` from 10^6 prioritized items: latency p50/p99.
    Baseline: numpy inverse-CDF sampling (cumsum + searchsorted) over the
    same weights, which is O(n) per batch.
remote_updates
    `learner.update_priorities` in batches of 1024 through a live
    LocalCluster (control plane in another process): keys/s.
decide_32
    CPU time (process_time) the control plane's own sample path spends on a
    batch of 32 (selection, leases, reply encoding), in-process.

Prints JSON lines and a table.

    cd /tmp && PYTHONPATH=<repo> <venv>/bin/python <repo>/perf/control_plane.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

N = 1_000_000


def stats(samples_s: list[float]) -> dict:
    a = np.array(samples_s) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 2),
            "p99_us": round(float(np.percentile(a, 99)), 2)}


def bench_updates(args, out):
    from distore_ucx._native_loader import _native

    rng = np.random.default_rng(0)
    tree = _native.SumTree(N)
    tree.set(np.arange(N, dtype=np.int64), rng.uniform(0.1, 2, N))
    batches = [rng.integers(0, N, 1024) for _ in range(args.batches)]
    values = [rng.uniform(0.1, 2, 1024) for _ in range(args.batches)]
    t = time.perf_counter()
    for idx, v in zip(batches, values):
        tree.set(idx, v)
    tree_rate = len(batches) * 1024 / (time.perf_counter() - t)

    core = _native.TableCore("prioritized", 0.6, "fifo", 1.0, N, 0, 1)
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
    from distore_ucx.control.selectors import Prioritized, Uniform
    from distore_ucx.control.tables import Table
    from distore_ucx.spec import TableSpec

    spec = TableSpec.parse(((112896,), "uint8"))
    for sampler in (Uniform(), Prioritized(0.6)):
        table = Table("t", N, spec, sampler=sampler, seed=3)
        k = np.arange(N, dtype=np.uint64)
        table.add(1, k, k * np.uint64(spec.slot_size), k, np.ones(N))
        leases = Leases(30.0)
        prev: list[int] = []
        cpu = []
        for _ in range(args.iters):
            t = time.process_time_ns()
            for lease in leases.take(prev):
                table.unlease(lease.recs)
            recs, probs, _ = table.sample(32)
            lid = leases.grant("t", recs)
            protocol.encode(protocol.reply(
                7, lease=lid, table_size=table.size, items=table.store.location[recs],
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
        batches = [keys[rng.integers(0, len(keys), 1024)] for _ in range(args.batches)]
        prios = rng.uniform(0.1, 2, 1024)
        learner.update_priorities(batches[0], prios)
        lat = []
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            learner.update_priorities(b, prios)
            lat.append(time.perf_counter() - t)
        rate = len(batches) * 1024 / (time.perf_counter() - t0)
        rtt = []
        for _ in range(200):
            t = time.perf_counter()
            client.call("table_info", name="p")
            rtt.append(time.perf_counter() - t)
    row = {"bench": "remote_updates", "items": len(keys), "batch": 1024,
           "keys_per_s": round(rate), **stats(lat),
           "control_rtt_p50_us": stats(rtt)["p50_us"]}
    out.append(row)
    print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=2000, help="update batches of 1024")
    p.add_argument("--iters", type=int, default=5000, help="sample batches")
    p.add_argument("--remote-items", type=int, default=262_144,
                   help="items in the remote-update table")
    p.add_argument("--json-out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    out: list[dict] = []
    core, rng = bench_updates(args, out)
    bench_sample(args, core, rng, out)
    bench_decide(args, out)
    bench_remote(args, out)
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
        elif r["bench"] == "decide_32":
            print(f"decide_32 {r['sampler']:<9}p50 {r['p50_us']:7.1f} us CPU, p99 "
                  f"{r['p99_us']:7.1f} us")
        else:
            print(f"remote_updates     {r['keys_per_s'] / 1e6:6.2f} M keys/s (batch p50 "
                  f"{r['p50_us']:.0f} us)    control RTT p50 {r['control_rtt_p50_us']:.0f} us")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
