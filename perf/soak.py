"""Endurance: insert and sample at a steady rate for a long time, and fail if
rates sag or any process's memory keeps growing.

    cd /tmp && <venv>/bin/python <repo>/perf/soak.py                      # 1 hour
    cd /tmp && <venv>/bin/python <repo>/perf/soak.py --seconds 120 --warmup 30 \
        --interval 10 --window 30                                        # CI's smoke

A LocalCluster of `--nodes` storage nodes holds one prioritized table whose
capacity is a fraction of what the run inserts, so the remover evicts all the
time and slots are reused. In this process, on threads:

- a writer inserts `--insert-rate` items a second, one item per `insert()`
  call as actors do, flushing every 10 ms (the rate is a schedule: a late
  tick catches up, so a healthy store delivers exactly the rate asked);
- a learner samples `--sample-rate` batches of `--batch` a second, checks
  every item's bytes (its payload is a function of its key), and updates the
  priorities of what it sampled, as a prioritized-replay learner does;
  `--iterate` takes the batches from the learner's iterator instead (a
  prefetch thread reads ahead; each batch's headers are read again as it
  is taken, so that none holds an item evicted meanwhile).

Every `--interval` seconds (default 60) it prints one line and one JSON line:
insert and sample rates, sample and flush latency p50/p99/max, and the RSS of
every process (control plane, each node, this client). At the end it prints a
summary table and, with matplotlib installed (`pip install '.[bench]'` from a checkout),
writes a plot of rates, latencies and RSS over time (`--plot`).

It exits 1 when, after the first `--warmup` seconds (default 600):

- the insert or sample rate over a trailing `--window` (default 300 s) is
  more than 10% below the first such window after the warm-up
  (`--max-rate-drop`): a thread that falls behind and catches up within a
  window is not a drop, one that stays behind is;
- any process's RSS is more than 5% above its RSS at the end of the warm-up
  (`--max-rss-growth`). Judged is VmRSS less RssShmem: a node's arena and a
  writer's staging memfds are shared memory bounded by `--arena` and the
  writer's pool, touched slot by slot as each node's share of the table
  wanders; the JSON lines carry VmRSS, RssAnon and RssShmem separately;
- any sampled item was wrong, or the writer or learner stopped on an error.

It also warns (without failing) when the first window after the warm-up
already runs below 90% of the rates asked: the machine cannot sustain them;
lower the rates. Runs on 127.0.0.1 only (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np

TICK = 0.01  # s between writer flushes


def make_payload(keys: np.ndarray, nbytes: int) -> np.ndarray:
    """Payloads that are a function of their key (rows of `nbytes` uint8)."""
    keys = np.asarray(keys, np.uint64)
    return (((keys[:, None] * np.uint64(2654435761)) >> np.uint64(7)).astype(np.uint8)
            + np.arange(nbytes, dtype=np.uint64).astype(np.uint8))


def rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """A memory figure of a process from /proc/PID/status in bytes: VmRSS
    (anonymous + file + shared memory it touched; what is judged), RssAnon or
    RssShmem (the arena and staging memfds); None when it has exited."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Window:
    """What the threads did since the last report (swapped out under a lock)."""

    def __init__(self):
        self.inserted = 0
        self.sampled_batches = 0
        self.sampled_items = 0
        self.wrong = 0
        self.sample_s: list[float] = []
        self.flush_s: list[float] = []


class Soak:
    """The writer and learner threads and their shared counters."""

    def __init__(self, client, table: str, args):
        self.client, self.table, self.args = client, table, args
        self.lock = threading.Lock()
        self.window = Window()
        self.stop = threading.Event()
        self.errors: list[str] = []

    def take(self) -> Window:
        """The current window's figures; starts a new one."""
        with self.lock:
            w, self.window = self.window, Window()
        return w

    def _error(self, who: str, exc: BaseException) -> None:
        print(f"{who} stopped: {exc!r}"[:500], file=sys.stderr, flush=True)
        with self.lock:
            self.errors.append(f"{who}: {exc!r}"[:300])
        self.stop.set()

    def writer(self) -> None:
        """Insert `insert_rate` items a second, one per call, on a schedule;
        flush every tick."""
        a = self.args
        try:
            with self.client.writer(max_items=max(64, int(a.insert_rate * TICK * 2))) as w:
                start, done = time.monotonic(), 0
                while not self.stop.is_set():
                    due = int((time.monotonic() - start) * a.insert_rate)
                    if due <= done:
                        time.sleep(TICK)
                        continue
                    n = min(due - done, int(a.insert_rate) + 1)  # at most a second's worth
                    for _ in range(n):
                        key = w.next_keys(1)[0]
                        w.insert(self.table, {"payload": make_payload([key], a.item_bytes)[0],
                                              "key": key}, priority=1.0)
                    t0 = time.perf_counter()
                    w.flush()
                    took = time.perf_counter() - t0
                    done += n
                    with self.lock:
                        self.window.inserted += n
                        self.window.flush_s.append(took)
        except Exception as exc:  # noqa: BLE001 - reported and fatal to the run
            self._error("writer", exc)

    def learner(self) -> None:
        """Sample `sample_rate` batches a second on a schedule; check every
        item; update priorities."""
        a = self.args
        rng = np.random.default_rng(a.seed)
        try:
            lrn = self.client.learner(self.table, batch_size=a.batch)
            batches = iter(lrn) if a.iterate else None
            try:
                start, done = time.monotonic(), 0
                while not self.stop.is_set():
                    due = int((time.monotonic() - start) * a.sample_rate)
                    if due <= done:
                        time.sleep(max(0.0, min(0.05, (done + 1) / a.sample_rate
                                                - (time.monotonic() - start))))
                        continue
                    t0 = time.perf_counter()
                    batch = next(batches) if batches is not None else lrn.sample(timeout=30)
                    took = time.perf_counter() - t0
                    d = batch.data
                    bad = (d["key"] != batch.keys) | (
                        make_payload(batch.keys, a.item_bytes) != d["payload"]).any(axis=1)
                    lrn.update_priorities(batch.keys, rng.uniform(0.1, 2.0, len(batch)))
                    done += 1
                    with self.lock:
                        self.window.sampled_batches += 1
                        self.window.sampled_items += len(batch)
                        self.window.wrong += int(bad.sum())
                        self.window.sample_s.append(took)
            finally:
                lrn.close()
        except Exception as exc:  # noqa: BLE001 - reported and fatal to the run
            self._error("learner", exc)


def percentiles(values: list[float]) -> dict:
    """p50/p99/max in ms (None when empty)."""
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    a = np.asarray(values) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "max_ms": round(float(a.max()), 3)}


def window_rates(rows: list[dict], start: float, window: float) -> list[tuple[float, float, float]]:
    """(end time, inserts/s, batches/s) over every trailing window of about
    `window` seconds that starts at or after `start`, from the rows' running
    totals (a writer that fell behind and caught up within a window does not
    count as a drop; one that stays behind does)."""
    points = [(0.0, 0, 0)] + [(r["t_s"], r["inserted_total"], r["sampled_batches_total"])
                              for r in rows]
    out = []
    for j, (t1, i1, b1) in enumerate(points):
        # the latest point at least `window` before t1, and not before `start`
        k = max((k for k in range(j) if points[k][0] <= t1 - window + 1e-6), default=None)
        if k is None or points[k][0] < start - 1e-6:
            continue
        t0, i0, b0 = points[k]
        out.append((t1, (i1 - i0) / (t1 - t0), (b1 - b0) / (t1 - t0)))
    return out


def judge(rows: list[dict], warmup: float, window: float, max_rate_drop: float,
          max_rss_growth: float, insert_rate: float,
          sample_rate: float) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a run from its interval rows: rates over
    trailing windows after the warm-up against the first such window (or
    the rate asked, when that window ran above it, catching up), RSS
    against the last sample of the warm-up, wrong items."""
    problems, warnings = [], []
    rates = window_rates(rows, warmup, window)
    if not rates:
        return [f"the run ended before one {window:.0f} s window after the {warmup:.0f} s "
                "warm-up: nothing judged; run longer than --warmup + --window"], warnings
    ref = rates[0]
    for col, what, asked in ((1, "inserts/s", insert_rate), (2, "sample batches/s", sample_rate)):
        if ref[col] < 0.9 * asked:
            warnings.append(f"{what} was {ref[col]:.1f} in the first window after the warm-up, "
                            f"below 90% of the {asked:g} asked: this machine does not sustain "
                            "that rate; lower it")
        # A paced run that fell behind during the warm-up catches up above the
        # rate asked in its first window: judge against what was asked then.
        base = min(ref[col], asked)
        for r in rates[1:]:
            if r[col] < (1.0 - max_rate_drop) * base:
                problems.append(f"{what} fell to {r[col]:.1f} over the {window:.0f} s to "
                                f"{r[0]:.0f} s, more than {max_rate_drop:.0%} below "
                                f"{base:.1f} (the first window to {ref[0]:.0f} s, at most "
                                "the rate asked)")
    def private(row: dict) -> dict:
        # VmRSS less shared memory: the arenas and staging memfds are shmem,
        # sized by --arena and the writer's pool, and get touched slot by slot
        # as per-node occupancy wanders (a bounded walk, not a leak).
        return {who: None if b is None or row["rss_shmem"].get(who) is None
                else b - row["rss_shmem"][who] for who, b in row["rss"].items()}

    before = [r for r in rows if r["t_s"] <= warmup + 1e-6]
    base = private(before[-1] if before else rows[0])
    flagged = set()
    for r in rows:
        if r["t_s"] <= warmup + 1e-6:
            continue
        for who, b in private(r).items():
            b0 = base.get(who)
            if who in flagged or b is None or b0 is None:
                continue
            if b > (1.0 + max_rss_growth) * b0:
                flagged.add(who)  # the first time only
                problems.append(f"{who} RSS (less shared memory) grew to {b / 2**20:.1f} MiB "
                                f"at {r['t_s']:.0f} s, more than {max_rss_growth:.0%} above "
                                f"{b0 / 2**20:.1f} MiB at the end of the warm-up")
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        problems.append(f"{wrong} sampled items had the wrong bytes")
    return problems, warnings


def plot(rows: list[dict], path: str, warmup: float) -> str:
    """Rates, latencies and RSS over time as a PNG; a message saying what was
    written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from distore_ucx.errors import install_hint  # here: importing it loads UCX

        return f"no plot: matplotlib is not installed ({install_hint('bench')})"
    t = [r["t_s"] / 60 for r in rows]
    fig, ax = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    ax[0].plot(t, [r["insert_per_s"] for r in rows], label="inserts/s")
    ax[0].plot(t, [r["sample_items_per_s"] for r in rows], label="sampled items/s")
    ax[0].set_ylabel("items/s")
    ax[1].plot(t, [r["sample"]["p50_ms"] for r in rows], label="sample p50")
    ax[1].plot(t, [r["sample"]["p99_ms"] for r in rows], label="sample p99")
    ax[1].plot(t, [r["flush"]["p99_ms"] for r in rows], label="flush p99")
    ax[1].set_ylabel("ms")
    for who in rows[0]["rss"]:
        ax[2].plot(t, [(r["rss"].get(who) or 0) / 2**20 for r in rows], label=who)
    ax[2].set_ylabel("RSS MiB")
    ax[2].set_xlabel("minutes")
    for a in ax:
        a.axvline(warmup / 60, color="grey", linestyle=":")
        a.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return f"plot written to {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--warmup", type=float, default=600.0,
                    help="s before rates and RSS are judged (default 600)")
    ap.add_argument("--interval", type=float, default=60.0, help="s between reports")
    ap.add_argument("--window", type=float, default=300.0,
                    help="s over which rates are judged (trailing; default 300)")
    ap.add_argument("--tls", default="sm", help="UCX_TLS for every process (sm, tcp)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--arena", default="64MiB", help="each node's arena")
    ap.add_argument("--disk", default="",
                    help="give each node a disk tier of this size (e.g. 1GiB; default none): "
                         "with a capacity above the arenas, items move to disk and are "
                         "sampled from there all the time")
    ap.add_argument("--disk-dir", default="", help="where the tier files go (default: the "
                    "cluster's log directory)")
    ap.add_argument("--disk-staging", default="0", help="each node's --disk-staging")
    ap.add_argument("--item-bytes", type=int, default=16384)
    ap.add_argument("--capacity", type=int, default=4096,
                    help="table capacity in items (the run inserts far more: eviction)")
    ap.add_argument("--insert-rate", type=float, default=1000.0, help="items/s")
    ap.add_argument("--sample-rate", type=float, default=50.0, help="batches/s")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iterate", action="store_true",
                    help="the learner takes batches from its iterator (prefetch thread)")
    ap.add_argument("--max-rate-drop", type=float, default=0.10)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="soak.png", help="PNG path ('' for none)")
    ap.add_argument("--json-out", help="also write the JSON lines here")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.interval <= 0 or args.insert_rate <= 0 or args.sample_rate <= 0:
        ap.error("--seconds, --interval and the rates must be positive")
    os.environ["UCX_TLS"] = args.tls
    import distore_ucx as ds

    spec = {"payload": ((args.item_bytes,), "uint8"), "key": ((), "uint64")}
    rows: list[dict] = []
    out = open(args.json_out, "w") if args.json_out else None  # noqa: SIM115 - closed below
    cluster = ds.LocalCluster(nodes=args.nodes, arena_bytes=args.arena,
                              env={"UCX_TLS": args.tls}, log_level="WARNING",
                              disk_bytes=args.disk or 0, disk_dir=args.disk_dir or None,
                              disk_staging=args.disk_staging)
    print(f"soak: {args.seconds:.0f} s ({args.warmup:.0f} s warm-up), {args.nodes} nodes x "
          f"{args.arena}{f' + a {args.disk} disk tier' if args.disk else ''}, "
          f"UCX_TLS={args.tls}, {args.item_bytes}-byte items, capacity "
          f"{args.capacity}; asking {args.insert_rate:g} inserts/s and {args.sample_rate:g} "
          f"batches/s of {args.batch}", flush=True)
    try:
        with cluster, ds.connect(cluster.address) as client:
            client.create_table("soak", capacity=args.capacity, spec=spec,
                                sampler=ds.Prioritized(0.6), remover=ds.Fifo(),
                                rate_limiter=ds.MinSize(args.batch))
            who = {pid: name for pid, name in
                   zip(cluster.pids(), ["control"] + [f"node{i}" for i in range(args.nodes)])}
            who[os.getpid()] = "client"
            soak = Soak(client, "soak", args)
            threads = [threading.Thread(target=soak.writer, name="writer"),
                       threading.Thread(target=soak.learner, name="learner")]
            t0 = time.monotonic()
            for th in threads:
                th.start()
            last, total_ins, total_bat = t0, 0, 0
            try:
                while time.monotonic() - t0 < args.seconds and not soak.stop.is_set():
                    soak.stop.wait(max(0.0, min(last + args.interval,
                                                t0 + args.seconds) - time.monotonic()))
                    now = time.monotonic()
                    w, dt = soak.take(), now - last
                    last = now
                    total_ins += w.inserted
                    total_bat += w.sampled_batches
                    info = client.table_info("soak")
                    row = {"t_s": round(now - t0, 1), "table_size": info["size"],
                           "cold": info.get("cold", 0),  # items on the disk tiers now
                           "inserted_total": total_ins, "sampled_batches_total": total_bat,
                           "insert_per_s": round(w.inserted / dt, 1),
                           "sample_batches_per_s": round(w.sampled_batches / dt, 2),
                           "sample_items_per_s": round(w.sampled_items / dt, 1),
                           "wrong": w.wrong, "sample": percentiles(w.sample_s),
                           "flush": percentiles(w.flush_s),
                           "rss": {name: rss_bytes(pid) for pid, name in who.items()},
                           "rss_anon": {name: rss_bytes(pid, "RssAnon")
                                        for pid, name in who.items()},
                           "rss_shmem": {name: rss_bytes(pid, "RssShmem")
                                         for pid, name in who.items()}}
                    rows.append(row)
                    line = json.dumps(row)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
                    rss = " ".join(f"{k} {v / 2**20:.0f}M" for k, v in row["rss"].items() if v)
                    print(f"{row['t_s']:7.0f} s  insert {row['insert_per_s']:8.0f}/s  sample "
                          f"{row['sample_batches_per_s']:6.1f} b/s  p99 "
                          f"{row['sample']['p99_ms'] or 0:7.2f} ms  wrong {row['wrong']}  "
                          + (f"cold {row['cold']}  " if args.disk else "") +
                          f"RSS {rss}", file=sys.stderr, flush=True)
            finally:
                soak.stop.set()
                for th in threads:
                    th.join(60)
    finally:
        if out:
            out.close()
    problems, warnings = judge(rows, args.warmup, args.window, args.max_rate_drop,
                               args.max_rss_growth,
                               args.insert_rate, args.sample_rate)
    problems += soak.errors
    summary = {"summary": True, "seconds": args.seconds, "intervals": len(rows),
               "sampled_items": int(sum(r["sample_items_per_s"] * args.interval for r in rows)),
               "wrong": sum(r["wrong"] for r in rows), "problems": problems,
               "warnings": warnings}
    print(json.dumps(summary), flush=True)
    if args.plot and rows:
        print(plot(rows, args.plot, args.warmup), flush=True)
    for text in warnings:
        print(f"warning: {text}", flush=True)
    for text in problems:
        print(f"FAILED: {text}", flush=True)
    print("soak " + ("FAILED" if problems else "passed"), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
