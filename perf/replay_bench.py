"""The field's replay workloads against a live store: achieved vs demanded sample rate.

For each workload of perf/workloads.toml (DQN, PPO, R2D2, IMPALA on Atari; SAC on
MuJoCo; QMIX, MASAC on SMAC; DQN on GoBigger), with its real item size:

1. Scale the capacity to the ``--memory`` budget: capacity x slot size <= --memory,
   split over ``--nodes`` storage nodes of a fresh LocalCluster (or a running store
   at ``--address``: tables named bench-<id>-<pid>, left in place, since tables
   cannot be dropped).
2. Make the table the workload's buffer asks for: "priority" is ds.Prioritized(alpha)
   with a learner using beta and calling update_priorities after every batch (|TD|-like
   random values); "use-count" is ds.Uniform() with max_times_sampled from the file
   and no rate limiter beyond the default (the use count itself bounds the sample rate
   to inserts x max_times_sampled, which is the control those algorithms want);
   "none" is ds.Uniform(). Remover: ds.Fifo().
3. Fill "priority" and "none" tables to capacity first, flat out (a replay buffer in
   steady state is full; sampling a small, cache-resident table would flatter us).
   "use-count" tables start empty: in steady state they hold only what has not been
   used up.
4. For ``--seconds``, ``--writers`` writer processes (spawned) insert real-size items
   at the workload's insert rate (together; ``--max``: flat out) while one learner, in
   this process, samples batches as fast as it can.

Per workload it reports achieved sample items/s and GB/s (10^9 B/s, sampled bytes over
wall time), batch latency p50/p99 (learner.sample(); on use-count tables this includes
waiting for new items, which is the point), achieved insert rate, the CPU use of each
process (control plane, each node, each writer, the learner; % of one core, from
/proc/PID/stat), and ratio = achieved / demanded samples/s. The baseline measured in
the same run is the workload's demand and the achieved insert rate against the paced
target. Output: one JSON line per workload on stdout, a table, and with ``--plot`` a
PNG of achieved against demanded samples/s per workload. Progress goes to stderr.

    cd /tmp && <venv>/bin/python <repo>/perf/replay_bench.py \\
        --json-out /tmp/replay.jsonl --plot /tmp/replay.png

Every process it starts is stopped when it ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time

import common
import numpy as np
from common import JsonLines, apply_ucx_env, cpu_seconds, fmt, log

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILE = os.path.join(HERE, "workloads.toml")
GiB, MiB = 1 << 30, 1 << 20
# The writer sends messages of at most 1024 items and of its default batch bytes (8 MiB,
# grown to 8 items of up to 32 MiB for large items: default_batch_bytes) and places them
# round robin over the nodes; chunks of exactly one message keep the nodes evenly filled
# (chunks of 1398 would go out as 1024 + 374, always the 1024 to the same node).
WRITER_MAX_ITEMS = 1024
PACE_SLICE_S = 0.05  # a paced writer sends what 50 ms of its rate asks for at once
WRITER_START_TIMEOUT_S = 120.0
BUFFERS = ("priority", "use-count", "none")
REQUIRED = ("id", "capacity", "buffer", "item_bytes", "inserts_per_s", "samples_per_s",
            "batch_size")


# --------------------------------------------------------------------------- workloads


def load_workloads(path: str) -> list[dict]:
    """The [[workload]] tables of a TOML file, checked for the fields the bench needs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            sys.exit("reading workloads.toml needs Python 3.11+ or `pip install tomli`")
    with open(path, "rb") as f:
        workloads = tomllib.load(f).get("workload", [])
    for w in workloads:
        missing = [k for k in REQUIRED if k not in w]
        if missing:
            sys.exit(f"{path}: workload {w.get('id', '?')} lacks {', '.join(missing)}")
        if w["buffer"] not in BUFFERS:
            sys.exit(f"{path}: workload {w['id']}: buffer must be one of {BUFFERS}")
        if w["buffer"] == "use-count" and int(w.get("max_times_sampled", 0)) < 1:
            sys.exit(f"{path}: use-count workload {w['id']} needs max_times_sampled >= 1")
    return workloads


def slot_bytes(item_bytes: int) -> int:
    """Arena bytes one item of `item_bytes` takes (header and alignment included)."""
    from distore_ucx import TableSpec

    return TableSpec.parse(((item_bytes,), "uint8")).slot_size


def writer_chunk(item_bytes: int) -> int:
    """Items of one default writer's batch: what a flat-out writer inserts per flush."""
    from distore_ucx.client.writer.writer import default_batch_bytes

    return max(1, min(WRITER_MAX_ITEMS, default_batch_bytes(item_bytes) // item_bytes))


def plan(w: dict, memory: int, nodes: int) -> dict:
    """Capacity scaled to the memory budget, and the arena each node needs for it."""
    slot = slot_bytes(w["item_bytes"])
    capacity = max(w["batch_size"], min(int(w["capacity"]), memory // slot))
    # Slack: writes go round robin in messages of up to a writer's batch, so nodes differ by a
    # few messages; evicted slots under lease (the learner's ring) are not reused yet.
    message = writer_chunk(w["item_bytes"]) * slot
    slack = 4 * max(message, slot) + 4 * w["batch_size"] * slot
    arena = math.ceil(capacity * slot / nodes) + slack
    return {"capacity": capacity, "slot": slot, "arena": arena}


# --------------------------------------------------------------------------- writers


def writer_main(address, table, item_bytes, rate, prioritized, seed, ready, go, stop,
                counter, errors) -> None:
    """A writer process: insert real-size items at `rate` items/s (0: flat out) until
    `stop`; every chunk is flushed (acknowledged) before it is counted."""
    import distore_ucx as ds

    try:
        rng = np.random.default_rng(seed)
        if rate > 0:
            chunk = max(1, round(rate * PACE_SLICE_S))
        else:
            chunk = writer_chunk(item_bytes)
        data = rng.integers(0, 256, (chunk, item_bytes), dtype=np.uint8)
        with ds.connect(address) as client:
            writer = client.writer(timeout=30.0, max_items=WRITER_MAX_ITEMS)
            client.spec(table)
            ready.set()
            go.wait()
            start, sent = time.monotonic(), 0
            while not stop.is_set():
                if rate > 0:
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        stop.wait(ahead)
                        continue
                prio = rng.uniform(0.1, 2.0, chunk) if prioritized else 1.0
                writer.insert(table, data, priority=prio)
                writer.flush()
                sent += chunk
                with counter.get_lock():
                    counter.value += chunk
            writer.close()
    except Exception as exc:  # noqa: BLE001 - any failure is reported by the parent
        errors.put(f"writer (pid {os.getpid()}) failed: {type(exc).__name__}: {exc}")
        ready.set()


def prefill(client, table: str, item_bytes: int, count: int, prioritized: bool,
            seed: int) -> dict:
    """Insert `count` items flat out from this process; returns the time and rate."""
    if count <= 0:
        return {"prefill_items": 0, "prefill_s": 0.0, "prefill_gb_per_s": None}
    rng = np.random.default_rng(seed)
    chunk = min(count, writer_chunk(item_bytes))
    data = rng.integers(0, 256, (chunk, item_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    with client.writer(max_items=WRITER_MAX_ITEMS) as writer:
        done = 0
        while done < count:
            n = min(chunk, count - done)
            prio = rng.uniform(0.1, 2.0, n) if prioritized else 1.0
            writer.insert(table, data[:n], priority=prio)
            done += n
    dt = time.perf_counter() - t0
    return {"prefill_items": count, "prefill_s": round(dt, 3),
            "prefill_gb_per_s": round(count * item_bytes / dt / 1e9, 3)}


def stop_writers(procs: list, stop) -> None:
    """Ask writers to stop, join them, and kill any that do not exit."""
    stop.set()
    for p in procs:
        p.join(15)
    for p in procs:
        if p.is_alive():
            log(f"writer pid {p.pid} did not stop; killing it")
            p.kill()
            p.join(5)


# --------------------------------------------------------------------------- one workload


def run_workload(w: dict, args, cluster=None) -> dict:
    """Run one workload against `cluster` (a started LocalCluster) or args.address."""
    import distore_ucx as ds

    address = cluster.address if cluster is not None else args.address
    p = plan(w, args.memory, args.nodes)
    item, batch, buffer = w["item_bytes"], w["batch_size"], w["buffer"]
    prioritized = buffer == "priority"
    table = w["id"] if cluster is not None else f"bench-{w['id']}-{os.getpid()}"
    mts = int(w.get("max_times_sampled", 0)) if buffer == "use-count" else 0
    rate = 0.0 if args.max else float(w["inserts_per_s"])
    ctx = mp.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    counter, errors = ctx.Value("q", 0), ctx.Queue()
    procs: list = []
    problems: list[str] = []
    with ds.connect(address) as client:
        client.create_table(
            table, capacity=p["capacity"], spec=((item,), "uint8"),
            sampler=ds.Prioritized(args.alpha) if prioritized else ds.Uniform(),
            remover=ds.Fifo(), max_times_sampled=mts)
        fill = prefill(client, table, item, 0 if buffer == "use-count" else p["capacity"],
                       prioritized, args.seed)
        if fill["prefill_items"]:
            log(f"[{w['id']}] prefilled {fill['prefill_items']} items in "
                f"{fill['prefill_s']:.1f} s ({fill['prefill_gb_per_s']} GB/s)")
        try:
            readies = []
            for i in range(args.writers):
                ready = ctx.Event()
                proc = ctx.Process(
                    target=writer_main, daemon=True,
                    args=(address, table, item, rate / args.writers, prioritized,
                          args.seed + 1 + i, ready, go, stop, counter, errors))
                proc.start()
                procs.append(proc)
                readies.append(ready)
            for ready in readies:
                if not ready.wait(WRITER_START_TIMEOUT_S):
                    raise RuntimeError(f"a writer did not connect within "
                                       f"{WRITER_START_TIMEOUT_S:.0f} s")
            learner = client.learner(table, batch_size=batch,
                                     beta=args.beta if prioritized else None)
            if buffer != "use-count":
                learner.sample(timeout=30)  # connect to every node before timing
            rng = np.random.default_rng(args.seed)
            pids = _pids(cluster, procs)
            cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            ins0 = counter.value
            lat: list[float] = []
            items = updates = 0
            t0 = time.perf_counter()
            deadline, next_report = t0 + args.seconds, t0 + 1.0
            go.set()
            while True:
                now = time.perf_counter()
                if now >= deadline:
                    break
                try:
                    b = learner.sample(timeout=max(0.05, deadline - now))
                except (ds.NoData, ds.RateLimiterTimeout):
                    break  # the window ended while waiting for items
                lat.append(time.perf_counter() - now)
                items += len(b)
                if prioritized:
                    # |TD error|-like: heavy-tailed, positive.
                    learner.update_priorities(b.keys, np.abs(rng.standard_normal(len(b)))
                                              + 1e-3)
                    updates += len(b)
                if now >= next_report:
                    log(f"[{w['id']} {now - t0:4.1f}s] sampled {items / (now - t0):8.0f} "
                        f"items/s, inserted {(counter.value - ins0) / (now - t0):7.1f} items/s")
                    next_report += 1.0
            wall = time.perf_counter() - t0
            inserted = counter.value - ins0
            cpu1 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            stop_writers(procs, stop)
            info = client.table_info(table)
            missing = learner.priority_updates_missing
            learner.close()
        finally:
            stop_writers(procs, stop)
            while not errors.empty():
                problems.append(errors.get())
    cpu = {k: (None if cpu0[k] is None or cpu1[k] is None
               else round(100 * (cpu1[k] - cpu0[k]) / wall, 1)) for k in pids}
    lat_ms = np.array(lat) * 1e3 if lat else np.array([np.nan])
    achieved = items / wall
    row = {
        "workload": w["id"],
        "algorithm": w.get("algorithm"),
        "buffer": buffer,
        "sampler": f"prioritized({args.alpha})" if prioritized else "uniform",
        "max_times_sampled": mts,
        "tls": os.environ.get("UCX_TLS"),
        "item_bytes": item,
        "batch_size": batch,
        "capacity_demanded": int(w["capacity"]),
        "capacity": p["capacity"],
        "memory_bytes": p["capacity"] * p["slot"],
        "nodes": args.nodes if cluster is not None else None,
        "seconds": round(wall, 3),
        "demanded_samples_per_s": w["samples_per_s"],
        "sample_items_per_s": round(achieved, 1),
        "sample_gb_per_s": round(achieved * item / 1e9, 4),
        "ratio": round(achieved / w["samples_per_s"], 3),
        "batches": len(lat),
        "batch_p50_ms": round(float(np.percentile(lat_ms, 50)), 3),
        "batch_p99_ms": round(float(np.percentile(lat_ms, 99)), 3),
        "demanded_inserts_per_s": w["inserts_per_s"],
        "insert_paced": not args.max,
        "insert_items_per_s": round(inserted / wall, 1),
        "insert_ratio": round(inserted / wall / w["inserts_per_s"], 3),
        "priority_updates": updates,
        "priority_updates_missing": missing,
        "table_size_end": info["size"],
        "cpu_pct": cpu,
        **fill,
        "problems": problems,
    }
    return row


def _pids(cluster, writers: list) -> dict[str, int]:
    pids: dict[str, int] = {}
    if cluster is not None:
        pids["control"] = cluster.control.pid
        for i, n in enumerate(cluster.nodes):
            pids[f"node{i}"] = n.pid
    for i, w in enumerate(writers):
        pids[f"writer{i}"] = w.pid
    pids["learner"] = os.getpid()
    return pids


def run(w: dict, args) -> dict:
    """One workload in a fresh LocalCluster sized for it (or against --address)."""
    import distore_ucx as ds

    p = plan(w, args.memory, args.nodes)
    log(f"[{w['id']}] {w['buffer']}, {w['item_bytes']} B items, batch {w['batch_size']}, "
        f"capacity {p['capacity']} of {w['capacity']} "
        f"({p['capacity'] * p['slot'] / MiB:.0f} MiB), "
        f"{'flat out' if args.max else str(w['inserts_per_s']) + ' inserts/s'}, "
        f"demand {w['samples_per_s']} samples/s")
    if args.address:
        return run_workload(w, args)
    with ds.LocalCluster(nodes=args.nodes, arena_bytes=p["arena"], log_level="WARNING",
                         env={"UCX_TLS": args.tls}, metrics=args.metrics) as cluster:
        if not args.metrics:
            return run_workload(w, args, cluster)
        with Scraper(cluster, args.scrape_interval) as scraper:
            row = run_workload(w, args, cluster)
        row.update(metrics=True, scrapes=scraper.scrapes, scrape_ms_max=scraper.slowest_ms)
        return row


class Scraper:
    """--metrics: a separate process (as Prometheus is) fetches every /metrics
    of the cluster, and this process's learner registry (served here, over
    HTTP, as a user would serve it), every `interval` s (15x Prometheus'
    default rate), parsing each with prometheus_client."""

    def __init__(self, cluster, interval: float):
        import distore_ucx as ds

        self.cluster, self.interval = cluster, interval
        self.scrapes, self.slowest_ms = 0, 0.0
        self._server = ds.metrics.serve(0, "127.0.0.1")  # the learner's side
        ctx = mp.get_context("spawn")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        urls = [*cluster.metrics_urls().values(), self._server.url]
        self._proc = ctx.Process(target=scrape_main, args=(urls, interval, self._stop,
                                                           self._out), daemon=True)

    def __enter__(self):
        self._proc.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            self.scrapes, self.slowest_ms = self._out.get(timeout=30)
        except Exception as exc:  # noqa: BLE001 - the figures are extras; the run stands
            log(f"scraper: no figures ({exc!r})")
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        self._server.close()


def scrape_main(urls, interval, stop, out) -> None:
    """The scraper process: fetch and parse every URL every `interval` s."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    scrapes, slowest = 0, 0.0
    while not stop.wait(interval):
        for url in urls:
            t = time.perf_counter()
            try:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
            except OSError:
                continue  # a process that is stopping
            slowest = max(slowest, (time.perf_counter() - t) * 1e3)
            list(text_string_to_metric_families(text))
            scrapes += 1
    out.put((scrapes, round(slowest, 1)))


# --------------------------------------------------------------------------- output


def _cpu(row: dict, prefix: str) -> str:
    vals = [v for k, v in row["cpu_pct"].items() if k.startswith(prefix) and v is not None]
    return fmt(sum(vals), ".0f") if vals else "-"


# What each column of the short table means (printed under it: replay.txt).
LEGEND = (
    ("workload", "the survey's workload (perf/workloads.toml)"),
    ("buffer", "priority: prioritized, use-count: max_times_sampled, none: uniform"),
    ("batch", "items per learner.sample()"),
    ("item_B", "bytes per item"),
    ("capacity", "table capacity in items (scaled to --memory)"),
    ("demand/s", "sampled items/s the workload needs (survey)"),
    ("got/s", "sampled items/s achieved, the learner flat out"),
    ("ratio", "got/s over demand/s (>= 1: it keeps up)"),
    ("GB/s", "sampled bytes/s, in 1e9"),
    ("p50_ms", "one learner.sample() batch, median"),
    ("p99_ms", "one learner.sample() batch, 99th percentile"),
    ("ins/s", "items inserted/s, achieved"),
    ("ins_goal/s", "insert rate the writers were paced to (max: flat out, --max)"),
    ("cpu%control", "the control plane's CPU, % of one core"),
    ("cpu%nodes", "the storage nodes' CPU, summed, % of one core"),
    ("cpu%writers", "the writer processes' CPU, summed, % of one core"),
    ("cpu%learner", "the learner's CPU (this process), % of one core"),
)


def print_table(rows: list[dict]) -> None:
    """The short table: one line per workload, and what its columns mean."""
    head = [name for name, _ in LEGEND]
    lines = [[r["workload"], r["buffer"], str(r["batch_size"]), str(r["item_bytes"]),
              str(r["capacity"]), fmt(r["demanded_samples_per_s"], "g"),
              fmt(r["sample_items_per_s"], ".0f"), fmt(r["ratio"], ".2f"),
              fmt(r["sample_gb_per_s"], ".3f"), fmt(r["batch_p50_ms"], ".2f"),
              fmt(r["batch_p99_ms"], ".2f"), fmt(r["insert_items_per_s"], ".1f"),
              fmt(r["demanded_inserts_per_s"], "g") if r["insert_paced"] else "max",
              _cpu(r, "control"), _cpu(r, "node"), _cpu(r, "writer"), _cpu(r, "learner")]
             for r in rows]
    common.print_table(head, lines)
    print("\ncolumns:")
    width = max(len(name) for name, _ in LEGEND)
    for name, meaning in LEGEND:
        print(f"  {name:<{width}}  {meaning}")


def plot(rows: list[dict], path: str) -> None:
    """Bars of demanded and achieved samples/s per workload (log scale), ratio on top."""
    plt = common.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    x = np.arange(len(rows))
    demand = [r["demanded_samples_per_s"] for r in rows]
    got = [max(r["sample_items_per_s"], 1e-1) for r in rows]
    ax.bar(x - 0.2, demand, 0.4, label="demanded (survey)", color="#bbbbbb")
    ax.bar(x + 0.2, got, 0.4, label="achieved", color="#3070b0")
    for xi, g, r in zip(x, got, rows):
        ax.annotate(f"{r['ratio']:.2f}x", (xi + 0.2, g), ha="center", va="bottom",
                    fontsize="small")
    ax.set_yscale("log")
    ax.set_xticks(x, [r["workload"] for r in rows], rotation=20)
    ax.set_ylabel("sampled items / s")
    tls = rows[0].get("tls") if rows else None
    ax.set_title(f"replay workloads: achieved vs demanded sample rate (UCX_TLS={tls})")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    common.save_figure(plt, fig, path)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """Options; --quick only changes the defaults of --seconds and --memory."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="all",
                   help="comma-separated workload ids (default: all in the file)")
    p.add_argument("--file", default=DEFAULT_FILE, help="workloads TOML (default: beside me)")
    p.add_argument("--memory", default=None,
                   help="memory budget for each table's items, e.g. 2GiB (default 2GiB; "
                        "--quick 128MiB)")
    p.add_argument("--nodes", type=int, default=2, help="storage nodes (default 2)")
    p.add_argument("--seconds", type=float, default=None,
                   help="timed window per workload (default 10; --quick 2)")
    p.add_argument("--writers", type=int, default=1,
                   help="writer processes sharing the insert rate (default 1)")
    p.add_argument("--max", action="store_true", help="writers insert flat out, not paced")
    p.add_argument("--tls", default=os.environ.get("UCX_TLS", "sm"),
                   help="UCX_TLS for every process (default: $UCX_TLS or sm)")
    p.add_argument("--address", help="use the running store at HOST:PORT, not a LocalCluster")
    p.add_argument("--alpha", type=float, default=0.6, help="prioritized alpha (default 0.6)")
    p.add_argument("--beta", type=float, default=0.4, help="learner beta (default 0.4)")
    p.add_argument("--quick", action="store_true", help="short run: 2 s, 128 MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", action="store_true",
                   help="every process serves /metrics, scraped every --scrape-interval s "
                        "(the cost of metrics: compare with a run without)")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes with --metrics (default 1)")
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="write a PNG of achieved vs demanded (needs matplotlib)")
    args = p.parse_args(argv)
    from distore_ucx.config import parse_size

    args.memory = parse_size(args.memory or ("128MiB" if args.quick else "2GiB"))
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 10.0
    if args.seconds <= 0 or args.nodes < 1 or args.writers < 1:
        p.error("--seconds, --nodes and --writers must be positive")
    return args


def main(argv=None) -> int:
    """Run the selected workloads; exit status 1 if any had a problem."""
    args = parse_args(argv)
    apply_ucx_env(args.tls)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # everything is on this host
    workloads = load_workloads(args.file)
    if args.workloads != "all":
        want = [s.strip() for s in args.workloads.split(",") if s.strip()]
        known = {w["id"]: w for w in workloads}
        unknown = [s for s in want if s not in known]
        if unknown:
            log(f"unknown workloads {unknown}; known: {sorted(known)}")
            return 2
        workloads = [known[s] for s in want]
    rows: list[dict] = []
    failed = False
    with JsonLines(args.json_out) as out:
        for w in workloads:
            row = run(w, args)
            if row["problems"] or row["batches"] == 0:
                failed = True
                log(f"[{w['id']}] problems: {row['problems'] or 'no batch sampled'}")
            rows.append(row)
            out.write(row)
    print()
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
