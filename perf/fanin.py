"""Fan-in: many actor processes insert at a paced rate into one prioritized
table while one learner samples it; does the store keep every acknowledged
insert, and the learner its latency?

    cd /tmp && <venv>/bin/python <repo>/perf/fanin.py --actors 32
    cd /tmp && <venv>/bin/python <repo>/perf/fanin.py --actors 128 --seconds 20

A LocalCluster of `--nodes` storage nodes (a node per actor host is the
deployment this models: on one machine, the nodes share the actors' cores;
their arenas populated at start as `distore node` does, `--no-prefault` not)
holds one prioritized table large enough for everything the run inserts
(so nothing is evicted: every acknowledged insert must still be there).

- `--actors` processes (forked after the imports, so that starting 128 of
  them costs little) each open a writer and insert `--rate` items of
  `--item-bytes` a second on a schedule (a late tick catches up), flushing
  every `--flush-every` s. An item counts as acknowledged once a flush
  that covers it returned.
- One learner in this process samples batches of `--batch` at
  `--sample-rate` batches a second and updates their priorities, as a
  prioritized-replay learner does; each sample's latency is recorded.
- Every 0.5 s the control plane's node list is read: a node that leaves
  the live state (unresponsive, gone or dropped) is counted.

It prints one JSON line for the run and a short table: offered and
achieved inserts/s, items in the table against acknowledged inserts, node
drops (and unresponsive episodes), the longest heartbeat gap of each node,
learner p50/p99, the actors' peak RSS
and the control plane's and nodes' RSS, when all (and half) the actors
were ready, the longest flush, and the CPU the control plane and the nodes
(together) spent over the run per acknowledged item (and the actors in their
writers' insert() and flush() calls: what a writer takes from its environment),
and the insert batches each items_added of the nodes registered (from their
/metrics). Exit 1 when items are missing, a node was dropped, or the learner's
p99 exceeds `--max-p99-ms`.

`--probe S` adds what flushes of S s or more waited on, and the run's end
in steps of 0.2 s, to the JSON line (perf/flush_probe.py); with
`--close-together` no actor closes before every actor has finished its
last flush (closes and exits then overlap no other actor's flushes).
Only 127.0.0.1 is used (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
import urllib.request

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flush_probe  # noqa: E402
from common import cpu_seconds  # noqa: E402 - after the UCX settings
from soak import percentiles, rss_bytes  # noqa: E402

TABLE = "fanin"


def actor(index: int, address: str, args, start, ready, results, together) -> None:
    """One actor process: paced inserts for `args.seconds`; puts a result dict."""
    out = {"actor": index, "offered": 0, "acked": 0, "error": None, "rss_peak": None,
           "flush_max_s": 0.0, "cpu_s": 0.0}
    try:
        import distore_ucx as ds

        payload = np.full(args.item_bytes, index % 251, np.uint8)
        with ds.connect(address) as client, client.writer(max_items=256) as w:
            probe = flush_probe.Probe(client, w, args.probe) if args.probe is not None else None
            ready.put(index)
            if not start.wait(args.start_timeout):
                raise RuntimeError("the run never started")
            t0 = time.monotonic()
            done = 0
            next_flush = t0 + args.flush_every
            while True:
                now = time.monotonic()
                if now - t0 >= args.seconds:
                    break
                due = min(int((now - t0) * args.rate), int(args.seconds * args.rate))
                if due > done:
                    cpu = time.process_time()
                    for _ in range(due - done):
                        w.insert(TABLE, {"payload": payload}, priority=1.0)
                    out["cpu_s"] += time.process_time() - cpu
                out["offered"] = done = max(done, due)
                if now >= next_flush:
                    cpu = time.process_time()
                    if probe:
                        took = probe.flush(w, t0)
                    else:
                        t_flush = time.monotonic()
                        w.flush()
                        took = time.monotonic() - t_flush
                    out["cpu_s"] += time.process_time() - cpu
                    out["flush_max_s"] = max(out["flush_max_s"], took)
                    out["acked"] = done
                    next_flush = now + args.flush_every
                time.sleep(min(0.01, max(0.0, next_flush - time.monotonic())))
            cpu = time.process_time()
            w.flush()
            out["cpu_s"] += time.process_time() - cpu
            out["acked"] = done
            if probe:
                probe.done(out, t0, args.seconds)
            if together is not None:
                together.wait(args.seconds + 120)
        if probe:
            probe.closed(out)
    except Exception as exc:  # noqa: BLE001 - reported in the run's figures
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["rss_peak"] = rss_bytes(os.getpid(), "VmHWM")
    if args.probe is not None:
        flush_probe.Probe.last(out)
    results.put(out)


class Learner:
    """Samples on a schedule and updates priorities, on a thread."""

    def __init__(self, client, args):
        self.client, self.args = client, args
        self.latency: list[float] = []
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        a = self.args
        rng = np.random.default_rng(0)
        try:
            lrn = self.client.learner(TABLE, batch_size=a.batch)
            try:
                start, done = time.monotonic(), 0
                while not self.stop.is_set():
                    due = int((time.monotonic() - start) * a.sample_rate)
                    if due <= done:
                        self.stop.wait(max(0.0, min(0.05, (done + 1) / a.sample_rate
                                                    - (time.monotonic() - start))))
                        continue
                    t0 = time.perf_counter()
                    batch = lrn.sample(timeout=30)
                    self.latency.append(time.perf_counter() - t0)
                    lrn.update_priorities(batch.keys, rng.uniform(0.1, 2.0, len(batch)))
                    done += 1
            finally:
                lrn.close()
        except Exception as exc:  # noqa: BLE001 - reported in the run's figures
            self.error = f"{type(exc).__name__}: {exc}"[:300]


def watch_nodes(client, stop: threading.Event, seen: dict) -> None:
    """Count nodes leaving the live state (each node id once per episode)."""
    state: dict[int, str] = {}
    while not stop.wait(0.5):
        try:
            nodes = client.status()["nodes"]
        except Exception:  # noqa: BLE001 - a busy control plane: try again
            continue
        for n in nodes:
            now = n.get("state") or ("live" if n["alive"] else "gone")
            if state.get(n["node_id"], "live") == "live" and now != "live":
                seen[now] = seen.get(now, 0) + 1
            state[n["node_id"]] = now
        seen["node_ids"] = len(state)


def batches_per_registration(urls: dict) -> float | None:
    """Insert batches per items_added request over the nodes, from their
    /metrics counters (storage/registrations.py coalesces registrations)."""
    totals = {"distore_node_insert_batches_total": 0.0,
              "distore_node_registration_requests_total": 0.0}
    for role, url in urls.items():
        if not role.startswith("node"):
            continue
        with urllib.request.urlopen(url, timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in totals:
                    totals[name] += float(line.rsplit(" ", 1)[1])
    requests = totals["distore_node_registration_requests_total"]
    return round(totals["distore_node_insert_batches_total"] / requests, 2) if requests else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actors", type=int, default=32)
    ap.add_argument("--rate", type=float, default=150.0, help="items/s per actor")
    ap.add_argument("--item-bytes", type=int, default=3072)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--flush-every", type=float, default=0.1, help="s between an actor's flushes")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--arena", default="", help="each node's arena (default: room for the run)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sample-rate", type=float, default=20.0, help="learner batches/s")
    ap.add_argument("--tls", default="sm", help="UCX_TLS for every process (sm, tcp)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--no-prefault", action="store_true",
                    help="nodes take arena pages as items arrive (default: made at start, as "
                    "`distore node` does)")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="s the actors may take to connect")
    ap.add_argument("--max-p99-ms", type=float, default=50.0)
    ap.add_argument("--json-out", help="also write the JSON line here")
    ap.add_argument("--probe", type=float, metavar="S",
                    help="record what flushes of S s or more waited on, and the run's end "
                         "(perf/flush_probe.py): `probe` in the JSON line")
    ap.add_argument("--close-together", action="store_true",
                    help="actors close only once every actor has finished its last flush")
    args = ap.parse_args(argv)
    if args.actors <= 0 or args.rate <= 0 or args.seconds <= 0:
        ap.error("--actors, --rate and --seconds must be positive")
    os.environ["UCX_TLS"] = args.tls
    import distore_ucx as ds

    # UCX's Python side, loaded here once for the forked actors to share (a
    # writer loads it on first use; `import distore_ucx` alone does not).
    import distore_ucx.transport.runtime  # noqa: F401

    offered = int(args.actors * args.rate * args.seconds)
    spec = {"payload": ((args.item_bytes,), "uint8")}
    slot = ds.TableSpec.parse(spec).slot_size
    capacity = int(offered * 1.1) + 1024
    arena = args.arena or f"{int(capacity * slot / args.nodes * 1.1) // (1 << 20) + 16}MiB"
    print(f"fanin: {args.actors} actors x {args.rate:g} items/s of {args.item_bytes} B for "
          f"{args.seconds:g} s ({offered} items offered), {args.nodes} nodes x {arena}, "
          f"UCX_TLS={args.tls}, learner {args.sample_rate:g} x {args.batch}/s",
          file=sys.stderr, flush=True)
    cluster = ds.LocalCluster(nodes=args.nodes, arena_bytes=arena, env={"UCX_TLS": args.tls},
                              log_level="WARNING", heartbeat_timeout=args.heartbeat_timeout,
                              metrics=True, prefault=not args.no_prefault)
    ctx = mp.get_context("fork")  # the imports are shared: 128 starts cost little
    with cluster, ds.connect(cluster.address) as client:
        client.create_table(TABLE, capacity=capacity, spec=spec, sampler=ds.Prioritized(0.6),
                            remover=ds.Fifo(), rate_limiter=ds.MinSize(args.batch))
        start, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
        together = ctx.Barrier(args.actors) if args.close_together else None
        procs = [ctx.Process(target=actor, args=(i, cluster.address, args, start, ready,
                                                 results, together), daemon=True)
                 for i in range(args.actors)]
        t_up = time.monotonic()
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        for p in procs:
            p.start()
        # Actors connect before the clock starts, then wait on `start`.
        ready_s = []
        for _ in procs:
            ready.get(timeout=args.start_timeout)
            ready_s.append(time.monotonic() - t_up)
        print(f"fanin: {args.actors} actors connected in {ready_s[-1]:.1f} s (half in "
              f"{ready_s[len(ready_s) // 2]:.1f} s)", file=sys.stderr, flush=True)
        seen: dict = {}
        stop = threading.Event()
        learner = Learner(client, args)
        threads = [threading.Thread(target=learner.run, name="learner"),
                   threading.Thread(target=watch_nodes, args=(client, stop, seen),
                                    name="watch")]
        servers = cluster.pids()  # control, nodes
        cpu0 = [cpu_seconds(p) for p in servers]
        cpu_samples: list = []
        if args.probe is not None:
            threads.append(threading.Thread(target=flush_probe.sample_cpu,
                                            args=(servers, stop, cpu_samples), name="cpu"))
        start.set()
        t0 = time.monotonic()
        for th in threads:
            th.start()
        got = []
        while len(got) < args.actors:
            try:
                got.append(results.get(timeout=args.seconds + 120))
            except Exception:  # noqa: BLE001 - an actor that never reported
                break
        elapsed = time.monotonic() - t0
        cpu = [cpu_seconds(p) - c for p, c in zip(servers, cpu0)]
        learner.stop.set()
        stop.set()
        for th in threads:
            th.join(60)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        children_cpu = (children.ru_utime + children.ru_stime - children0.ru_utime
                        - children0.ru_stime)
        info = client.table_info(TABLE)
        status = client.status()
        per_request = batches_per_registration(cluster.metrics_urls())
        rss = {name: rss_bytes(pid) for pid, name in
               zip(cluster.pids(), ["control"] + [f"node{i}" for i in range(args.nodes)])}
    acked = sum(r["acked"] for r in got)
    errors = [r["error"] for r in got if r["error"]]
    lat = percentiles(learner.latency)
    peaks = [r["rss_peak"] for r in got if r["rss_peak"]]
    row = {
        "actors": args.actors, "rate": args.rate, "item_bytes": args.item_bytes,
        "seconds": args.seconds, "tls": args.tls, "nodes": args.nodes,
        "offered_per_s": round(offered / args.seconds, 1),
        "achieved_per_s": round(sum(r["offered"] for r in got) / args.seconds, 1),
        "acked": acked, "in_table": info["size"], "missing": acked - info["size"],
        "node_drops": seen.get("gone", 0) + seen.get("dropped", 0),
        "unresponsive": seen.get("unresponsive", 0),
        "node_ids": len(status["nodes"]),
        # The longest time between two heartbeats of each node, as the
        # control plane saw it (its own stalls excluded); None: not reported.
        "heartbeat_gap_max_s": {n["node_id"]: n.get("heartbeat_gap_max")
                                for n in status["nodes"]},
        "learner_batches": len(learner.latency), "learner": lat,
        "actor_rss_peak_mib": round(max(peaks) / 2**20, 1) if peaks else None,
        "actor_rss_mean_mib": round(float(np.mean(peaks)) / 2**20, 1) if peaks else None,
        "server_rss_mib": {k: round(v / 2**20, 1) if v else None for k, v in rss.items()},
        "actors_reported": len(got), "actor_errors": errors[:5], "n_actor_errors": len(errors),
        "learner_error": learner.error, "elapsed_s": round(elapsed, 1),
        "all_ready_s": round(ready_s[-1], 1), "half_ready_s": round(ready_s[len(ready_s) // 2], 1),
        "flush_max_s": round(max((r["flush_max_s"] for r in got), default=0.0), 2),
        # CPU seconds of each server process over the run, per acknowledged item.
        "control_cpu_us_per_item": round(1e6 * cpu[0] / max(acked, 1), 1),
        "node_cpu_us_per_item": round(1e6 * sum(cpu[1:]) / max(acked, 1), 1),
        # the actors' CPU in their writers' insert() and flush() calls (not
        # the pacing around them): what a writer takes from its environment
        "writer_cpu_us_per_item": round(1e6 * sum(r["cpu_s"] for r in got) / max(acked, 1), 1),
        # insert batches each items_added of the nodes registered (coalesced)
        "batches_per_registration": per_request,
    }
    if args.probe is not None:
        row["probe"] = flush_probe.summary(got, args.seconds, cpu_samples, children_cpu)
    line = json.dumps(row)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "a") as fh:
            fh.write(line + "\n")
    print(f"{'actors':>7} {'offered/s':>10} {'achieved/s':>10} {'acked':>8} {'in table':>8} "
          f"{'drops':>5} {'unresp':>6} {'p50 ms':>7} {'p99 ms':>7} {'actor MiB':>9} "
          f"{'ctl MiB':>7} {'node MiB':>8} {'ready s':>7} {'flush s':>7} {'ctl us/it':>9} "
          f"{'node us/it':>10} {'writer us/it':>12} {'batch/reg':>9}", file=sys.stderr)
    nodes_mib = [v for k, v in row["server_rss_mib"].items() if k != "control" and v]
    print(f"{args.actors:7d} {row['offered_per_s']:10.0f} {row['achieved_per_s']:10.0f} "
          f"{acked:8d} {info['size']:8d} {row['node_drops']:5d} {row['unresponsive']:6d} "
          f"{lat['p50_ms'] or 0:7.2f} {lat['p99_ms'] or 0:7.2f} "
          f"{row['actor_rss_peak_mib'] or 0:9.1f} {row['server_rss_mib']['control'] or 0:7.1f} "
          f"{max(nodes_mib, default=0):8.1f} {row['all_ready_s']:7.1f} {row['flush_max_s']:7.2f} "
          f"{row['control_cpu_us_per_item']:9.1f} {row['node_cpu_us_per_item']:10.1f} "
          f"{row['writer_cpu_us_per_item']:12.1f} {per_request or 0:9.2f}", file=sys.stderr,
          flush=True)
    bad = (row["missing"] != 0 or row["node_drops"] or errors or learner.error
           or (lat["p99_ms"] or 0) > args.max_p99_ms)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
