"""What metrics cost the sample and insert paths, as CPU, in one run.

Throughput A/B runs (replay_bench with and without --metrics) could not
settle a 3% question on this shared 2-core host: runs without metrics alone
varied several-fold. CPU time is far steadier than wall-clock rates, so this script
measures the two parts of the cost as CPU and sets them against the CPU the
same paths spend per batch, all in one run:

recording
    Every process records its metrics unconditionally (counters and one
    histogram observation per batch, nothing per item). The exact calls the
    learner, writer, storage node and control plane make per batch are timed
    in a loop (ns per batch), and divided by the CPU each of those processes
    spends per batch on the real path, measured on a LocalCluster in the
    same run (/proc CPU of each process over a timed loop of learner.sample()
    and writer.insert()+flush()).
serving
    What a Prometheus scrape costs each process: CPU per scrape of a control
    plane with --items items in 16 tables and of an idle storage node
    (/metrics fetched --scrapes times), as a share of one core at
    Prometheus' default 15 s scrape interval.

    cd /tmp && <venv>/bin/python <repo>/perf/metrics_cost.py

Target (issue #15): metrics on costs the sample and insert paths <= 3%.
Prints JSON lines and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
from common import cpu_seconds


def recording_ns(loops: int) -> dict:
    """ns per batch of each role's metric calls (the calls the code makes)."""
    from distore_ucx import metrics

    def per(fn) -> float:
        fn(10)  # warm
        t0 = time.perf_counter()
        fn(loops)
        return (time.perf_counter() - t0) / loops * 1e9

    def learner(n):
        st = metrics.LearnerStats()
        for _ in range(n):  # client/learner/learner.py: fetched + gather.observe + batches
            t0 = time.perf_counter()
            st.fetched("mapped", 32, 32 * 110_000)
            st.gather.observe(time.perf_counter() - t0)
            st.batches += 1

    def writer(n):
        st = metrics.WriterStats()
        for _ in range(n):  # client/writer/in_flight.py InFlight._stored
            t0 = time.perf_counter()
            st.batches, st.items = st.batches + 1, st.items + 64
            st.bytes += 64 * 16384
            st.latency.observe(time.perf_counter() - t0)

    def node(n):
        st = metrics.NodeStats()
        for _ in range(n):  # node.py, once per insert batch
            t0 = time.perf_counter()
            st.inserted(64, 64 * 16384, time.perf_counter() - t0)

    def control(n):
        st = metrics.TableStats()
        for _ in range(n):  # control/sampling.py op_sample
            t0 = time.perf_counter()
            st.decision.observe(time.perf_counter() - t0)

    def bare(n):  # the loop and two perf_counter calls alone, subtracted
        for _ in range(n):
            t0 = time.perf_counter()
            time.perf_counter() - t0

    base = per(bare)
    return {role: max(0.0, per(fn) - base) for role, fn in
            (("learner", learner), ("writer", writer), ("node", node), ("control", control))}


def path_cpu(args) -> dict:
    """CPU µs per batch of each process on the real paths (LocalCluster)."""
    import distore_ucx as ds

    out = {}
    spec = {"x": ((args.item_bytes,), "uint8")}
    with ds.LocalCluster(nodes=2, arena_bytes=args.arena, env={"UCX_TLS": args.tls},
                         log_level="WARNING") as cluster, ds.connect(cluster.address) as c:
        c.create_table("t", capacity=args.capacity, spec=spec)
        pids = {"control": cluster.control.pid,
                "nodes": [p.pid for p in cluster.nodes]}
        data = np.random.default_rng(0).integers(0, 255, (args.insert_batch, args.item_bytes),
                                                 dtype=np.uint8)
        with c.writer(max_items=args.insert_batch) as w:
            for _ in range(args.capacity // args.insert_batch + 1):  # fill
                w.insert("t", {"x": data})
            w.flush()
            n = 0
            cpu0 = _cpus(pids)
            me0, t0 = time.process_time(), time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                w.insert("t", {"x": data})
                w.flush()
                n += 1
            cpu1 = _cpus(pids)
            out["insert"] = {"batches": n, "writer_us": (time.process_time() - me0) / n * 1e6,
                             "node_us": (cpu1["nodes"] - cpu0["nodes"]) / n * 1e6,
                             "control_us": (cpu1["control"] - cpu0["control"]) / n * 1e6}
        lrn = c.learner("t", batch_size=args.batch)
        for _ in range(20):
            lrn.sample()
        n = 0
        cpu0 = _cpus(pids)
        me0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            lrn.sample()
            n += 1
        cpu1 = _cpus(pids)
        out["sample"] = {"batches": n, "learner_us": (time.process_time() - me0) / n * 1e6,
                         "control_us": (cpu1["control"] - cpu0["control"]) / n * 1e6,
                         "path": ",".join(sorted(set(lrn.paths.values())))}
        lrn.close()
    return out


def _cpus(pids: dict) -> dict:
    return {"control": cpu_seconds(pids["control"]),
            "nodes": sum(cpu_seconds(p) for p in pids["nodes"])}


def scrape_cpu(items: int, scrapes: int) -> dict:
    """CPU ms per scrape of a filled control plane (metrics_scrape.py's child)
    and of an idle storage node."""
    import multiprocessing as mp

    from metrics_scrape import _wait_ready, serve_plane

    import distore_ucx as ds

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve_plane, args=(16, items, queue, stop), daemon=True)
    proc.start()
    try:
        info = _wait_ready(proc, queue, 300.0)
        control = _cpu_per_fetch(proc.pid, f"http://127.0.0.1:{info['port']}/metrics", scrapes)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    with ds.LocalCluster(nodes=1, arena_bytes=64 << 20, metrics=True,
                         log_level="WARNING") as cluster:
        url = cluster.metrics_urls()["node0"]
        node = _cpu_per_fetch(cluster.nodes[0].pid, url, scrapes)
    return {"control_ms": control * 1e3, "node_ms": node * 1e3}


def _cpu_per_fetch(pid: int, url: str, n: int) -> float:
    for _ in range(3):
        urllib.request.urlopen(url, timeout=30).read()
    idle0, t_idle = cpu_seconds(pid), time.monotonic()
    time.sleep(1.0)
    idle_rate = (cpu_seconds(pid) - idle0) / (time.monotonic() - t_idle)
    c0, t0 = cpu_seconds(pid), time.monotonic()
    for _ in range(n):
        urllib.request.urlopen(url, timeout=30).read()
    return max(0.0, cpu_seconds(pid) - c0 - idle_rate * (time.monotonic() - t0)) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm")
    p.add_argument("--item-bytes", type=int, default=3072, help="3 KB: the most batches/s")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--insert-batch", type=int, default=256)
    p.add_argument("--capacity", type=int, default=20_000)
    p.add_argument("--arena", default="256MiB")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--items", type=int, default=1_000_000, help="items in the scraped plane")
    p.add_argument("--scrapes", type=int, default=30)
    p.add_argument("--interval", type=float, default=15.0, help="scrape interval to cost")
    p.add_argument("--loops", type=int, default=200_000)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    os.environ["UCX_TLS"] = args.tls

    rec = recording_ns(args.loops)
    cpu = path_cpu(args)
    scr = scrape_cpu(args.items, args.scrapes)
    rows = [
        {"part": "recording", "path": "sample", "process": "learner",
         "metrics_us": rec["learner"] / 1e3, "path_us": cpu["sample"]["learner_us"]},
        {"part": "recording", "path": "sample", "process": "control",
         "metrics_us": rec["control"] / 1e3, "path_us": cpu["sample"]["control_us"]},
        {"part": "recording", "path": "insert", "process": "writer",
         "metrics_us": rec["writer"] / 1e3, "path_us": cpu["insert"]["writer_us"]},
        {"part": "recording", "path": "insert", "process": "node",
         "metrics_us": rec["node"] / 1e3, "path_us": cpu["insert"]["node_us"]},
    ]
    for r in rows:
        r["unit"] = "per batch"
        r["share"] = r["metrics_us"] / r["path_us"] if r["path_us"] > 0 else None
    for who, ms in (("control", scr["control_ms"]), ("node", scr["node_ms"])):
        rows.append({"part": "serving", "path": f"scrape every {args.interval:g} s",
                     "process": who, "metrics_us": ms * 1e3, "unit": "per scrape",
                     "path_us": args.interval * 1e6, "share": ms / 1e3 / args.interval})
    meta = {"tls": args.tls, "item_bytes": args.item_bytes, "batch": args.batch,
            "insert_batch": args.insert_batch, "sample_batches": cpu["sample"]["batches"],
            "insert_batches": cpu["insert"]["batches"], "read_path": cpu["sample"]["path"],
            "scraped_items": args.items}
    lines = [json.dumps(dict(r, **meta)) for r in rows]
    for line in lines:
        print(line, flush=True)
    print(f"\n{'part':<10} {'path':<20} {'process':<8} {'metrics us':>11} {'unit':<11} "
          f"{'path us':>11} {'share':>7}")
    for r in rows:
        print(f"{r['part']:<10} {r['path']:<20} {r['process']:<8} {r['metrics_us']:>11.2f} "
              f"{r['unit']:<11} {r['path_us']:>11.1f} {r['share']:>7.2%}")
    worst = max(r["share"] for r in rows if r["share"] is not None)
    print(f"\nlargest share: {worst:.2%} (target <= 3%)")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.writelines(line + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
