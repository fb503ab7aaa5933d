"""Latency sweep, 8 B to 64 MiB: single-item and small-batch gathers vs ucx_perftest.

For each UCX transport in ``--tls`` (default ``sm,tcp``, loopback only) and each item
size of ``--sizes`` (default powers of 4 from 8 B, and 64 MiB), a storage node in
another process holds an arena of random-pattern slots (perf/common.py), and it times:

ours
    ``_native.gather`` of 1 random slot per call, and of a small batch (``--batch``,
    default 8; fewer where the batch would pass 64 MiB), into one registered buffer:
    the time a learner's read of a sampled batch takes, without the control plane.
numpy
    ``np.take`` of the same rows from a local array of the same size: a memory copy.
perftest
    ``ucx_perftest -t ucp_get -O 1`` (one read outstanding) between two local
    processes with the same UCX settings: UCX's own read latency. It reads one
    cache-hot buffer; we read random slots of ``--arena`` bytes. Not over tcp:
    there UCX emulates a get in software, served only when the remote side
    progresses its worker, and ucx_perftest's remote side does so only between
    1 ms poll() timeouts (measured: 1.08 ms p50 for 8 B, its server asleep in
    poll), so ``ucp_get`` times that timer, not a read. Over tcp the baseline is
    a round trip of ``-t tag_lat`` messages instead, as an emulated get is one
    request and one reply: the one-way p50 of an 8 B message (the request) plus
    that of an item-sized one (the reply), between two processes that both
    busy-poll (our node's thread sleeps until a request comes).

Latencies are per call in microseconds (p50, p99); the number of calls per size is
scaled so each moves about ``--bytes`` (10 to 1000 calls). The first, a middle and the
last gather are checked byte for byte. Output: one JSON line per (tls, size), a table,
and with ``--plot`` a PNG of latency against item size.

    cd /tmp && <venv>/bin/python <repo>/perf/latency.py \\
        --json-out /tmp/latency.jsonl --plot /tmp/latency.png

``--first-sample`` measures something else instead: a new learner's first
``learner.sample()`` against its warm ones (p50 of the next 200), through the public
API on a LocalCluster of 2 nodes, for each read path (same-host mapped, and UCX with
each ``--tls``), ``--learners`` fresh learners each. The first sample should cost
no more than 2x a warm one: endpoints, remote keys and mappings are made when the
learner is created, not on its first read.
"""

from __future__ import annotations

import argparse
import sys

import common
import numpy as np
from common import (
    apply_ucx_env,
    fill_arena,
    fmt,
    log,
    measure_numpy,
    measure_ours,
    measure_perftest,
    node,
    plot_size_sweep,
    size_list,
)

MiB = 1 << 20
DEFAULT_SIZES = "8,32,128,512,2K,8K,32K,128K,512K,2M,8M,32M,64M"
QUICK_SIZES = "8,512,32K,2M,64M"
MAX_BATCH_BYTES = 64 * MiB
# Transports where UCX emulates a get: ucx_perftest's ucp_get is not a
# baseline there (the module docstring says why), a tag_lat round trip is.
ROUND_TRIP = {"tcp"}
_REQUESTS: dict[str, dict] = {}  # tls -> ucx_perftest tag_lat of an 8 B request


def round_trip_perftest(args, tls: str, size: int, iters: int,
                        warmup: int) -> tuple[dict | None, str | None]:
    """ucx_perftest's figure for one request of 8 B and one reply of `size`
    bytes: the sum of the two tag_lat one-way latencies (p50 and average)."""
    if tls not in _REQUESTS:
        req, why = measure_perftest(tls, 8, 1, 1000, 100, args.perftest_timeout,
                                    test="tag_lat")
        if req is None:
            return None, why
        _REQUESTS[tls] = req
    req = _REQUESTS[tls]
    reply, why = measure_perftest(tls, size, 1, iters, warmup, args.perftest_timeout,
                                  test="tag_lat")
    if reply is None:
        return None, why
    return {k: req[k] + reply[k] for k in ("p50_us", "avg_us")}, None


def iters_for(nbytes: int, total: int) -> tuple[int, int]:
    """(timed, warm-up) calls so that one measurement moves about `total` bytes."""
    iters = max(10, min(1000, total // nbytes))
    return iters, max(2, iters // 10)


def measure(args, tls: str, size: int) -> tuple[dict, bool]:
    """One (tls, size): ours and numpy at batch 1 and the small batch, then ucx_perftest."""
    apply_ucx_env(tls)
    small = max(1, min(args.batch, MAX_BATCH_BYTES // size))
    slots = max(args.arena // size, small, 2)
    rng = np.random.default_rng(args.seed)
    row: dict = {"tls": tls, "item_bytes": size, "batch": small}
    ok = True
    log(f"[{tls}] item {size} B, batches of 1 and {small}, arena {slots} slots "
        f"({slots * size / MiB:.0f} MiB)")
    with node(tls, size, slots) as (_, hello):
        arena2d = np.empty((slots, size), np.uint8)  # filled while the node fills its own
        fill_arena(arena2d)
        for n, tag in ((1, "1"), (small, "b")):
            if tag == "b" and small == 1:
                break
            iters, warmup = iters_for(n * size, args.bytes)
            batches = [rng.integers(0, slots, n) for _ in range(warmup + iters)]
            np_res, ok_np = measure_numpy(arena2d, batches, warmup)
            ours, ok_ours = measure_ours(tls, hello, size, batches, warmup)
            ok &= ok_np and ok_ours
            for name, res in (("ours", ours), ("numpy", np_res)):
                row[f"{name}_{tag}_p50_us"] = res["p50_ms"] * 1e3
                row[f"{name}_{tag}_p99_us"] = res["p99_ms"] * 1e3
            if tag == "1":
                row["iters"] = iters
        del arena2d
    iters, warmup = iters_for(size, args.bytes)
    if tls in ROUND_TRIP:
        pt, why = round_trip_perftest(args, tls, size, iters, warmup)
        row["perftest_test"] = "tag_lat round trip"
    else:
        pt, why = measure_perftest(tls, size, 1, iters, warmup, args.perftest_timeout)
        row["perftest_test"] = "ucp_get"
    row["perftest_p50_us"] = pt["p50_us"] if pt else None
    row["perftest_avg_us"] = pt["avg_us"] if pt else None
    row["ratio_vs_perftest"] = row["ours_1_p50_us"] / pt["p50_us"] if pt else None
    row["ratio_vs_numpy"] = row["ours_1_p50_us"] / row["numpy_1_p50_us"]
    if why:
        log(f"[{tls}] ucx_perftest: {why}")
        row["perftest_error"] = why
    row["verified"] = bool(ok)
    return row, ok


def print_table(rows: list[dict]) -> None:
    """One line per (tls, size): latencies in us, ratios of our single-item p50."""
    head = ["tls", "item_B", "ours1_p50", "ours1_p99", "numpy1_p50", "perf1_p50", "batch",
            "oursB_p50", "oursB_p99", "numpyB_p50", "x_perf", "x_np", "ok"]
    lines = [[r["tls"], str(r["item_bytes"]), fmt(r["ours_1_p50_us"], ".1f"),
              fmt(r["ours_1_p99_us"], ".1f"), fmt(r["numpy_1_p50_us"], ".1f"),
              fmt(r["perftest_p50_us"], ".1f"), str(r["batch"]),
              fmt(r.get("ours_b_p50_us"), ".1f"), fmt(r.get("ours_b_p99_us"), ".1f"),
              fmt(r.get("numpy_b_p50_us"), ".1f"), fmt(r["ratio_vs_perftest"], ".2f"),
              fmt(r["ratio_vs_numpy"], ".1f"), "yes" if r["verified"] else "NO"]
             for r in rows]
    print("latency per call in us; ...1: one item a call, ...B: `batch` items a call; "
          "x_perf, x_np: ours1_p50 over theirs; perf1_p50: ucx_perftest ucp_get -O 1, over tcp "
          "a tag_lat round trip (8 B request, item reply: perf/latency.py says why); ok: every "
          "checked byte right")
    common.print_table(head, lines)


def plot(rows: list[dict], path: str) -> None:
    """Latency (us) against item size, log-log."""
    plot_size_sweep(rows, [("ours_1_p50_us", "ours, 1 item, p50", "o-"),
                           ("ours_1_p99_us", "ours, 1 item, p99", "o:"),
                           ("ours_b_p50_us", "ours, small batch, p50", "d-"),
                           ("numpy_1_p50_us", "numpy, 1 item, p50", "s--"),
                           ("perftest_p50_us", "ucx_perftest get -O 1 (tcp: tag round trip), "
                                               "p50", "^:")],
                    "latency per call (us)", "gather latency", path, logy=True)


def parse_args(argv=None) -> argparse.Namespace:
    """Options; --quick changes the defaults of --sizes and --bytes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm,tcp", help="transports, one pass each (default sm,tcp)")
    p.add_argument("--sizes", default=None,
                   help=f"item sizes, comma separated, K/M suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--batch", type=int, default=8, help="the small batch (default 8 items)")
    p.add_argument("--bytes", type=int, default=None,
                   help="bytes moved per measurement (default 256 MiB; --quick 64 MiB)")
    p.add_argument("--arena", type=int, default=256 * MiB,
                   help="storage arena bytes (default 256 MiB, beyond the caches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perftest-timeout", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 64 MiB each")
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="write a PNG of latency vs item size (needs matplotlib)")
    p.add_argument("--first-sample", action="store_true",
                   help="measure a new learner's first sample against warm ones instead")
    p.add_argument("--learners", type=int, default=5,
                   help="fresh learners per path with --first-sample (default 5)")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch must be positive")
    args.sizes = size_list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.bytes = args.bytes or (64 * MiB if args.quick else 256 * MiB)
    return args


def first_sample(args) -> int:
    """First vs warm learner.sample() per read path (see the module docstring)."""
    import time

    import distore_ucx as ds

    rows = []
    size, batch = 112_896, 32
    paths = [("mapped", "sm")] + [(f"ucx:{t}", t) for t in args.tls.split(",") if t.strip()]
    with common.JsonLines(args.json_out) as out:
        for path, tls in paths:
            apply_ucx_env(tls)
            with ds.LocalCluster(nodes=2, arena_bytes=256 * MiB, env={"UCX_TLS": tls}) as c, \
                    ds.connect(c.address) as client:
                client.create_table("t", capacity=1000, spec=((size,), "uint8"))
                with client.writer() as w:
                    w.insert("t", np.ones((1000, size), np.uint8))
                firsts, warms = [], []
                for _ in range(args.learners):
                    with client.learner("t", batch_size=batch,
                                        local_map=path == "mapped") as learner:
                        t0 = time.perf_counter()
                        learner.sample()
                        firsts.append(time.perf_counter() - t0)
                        lat = []
                        for _ in range(200):
                            t0 = time.perf_counter()
                            learner.sample()
                            lat.append(time.perf_counter() - t0)
                        warms.append(float(np.percentile(lat, 50)))
            row = {"path": path, "item_bytes": size, "batch": batch,
                   "first_ms": float(np.median(firsts)) * 1e3,
                   "first_max_ms": float(np.max(firsts)) * 1e3,
                   "warm_p50_ms": float(np.median(warms)) * 1e3}
            row["first_vs_warm"] = row["first_ms"] / row["warm_p50_ms"]
            out.write(row)
            rows.append(row)
    head = ["path", "first_ms", "first_max_ms", "warm_p50_ms", "first/warm"]
    common.print_table(head, [[r["path"], fmt(r["first_ms"], ".3f"),
                               fmt(r["first_max_ms"], ".3f"), fmt(r["warm_p50_ms"], ".3f"),
                               fmt(r["first_vs_warm"], ".2f")] for r in rows])
    return 0


def main(argv=None) -> int:
    """Run the sweep; exit status 1 if any gathered byte was wrong."""
    args = parse_args(argv)
    if args.first_sample:
        return first_sample(args)
    tls_list = [t.strip() for t in args.tls.split(",") if t.strip()]
    return common.run_sweep(args.json_out, tls_list, args.sizes,
                            lambda tls, size: measure(args, tls, size), print_table,
                            plot, args.plot)

if __name__ == "__main__":
    sys.exit(main())
