"""Bandwidth of the one-sided sample path: our batched gather vs numpy vs ucx_perftest.

For each UCX transport in ``--tls`` (default ``sm,tcp``: one pass with ``UCX_TLS=sm``, one
with ``UCX_TLS=tcp`` on the loopback device) and each item size in ``--sizes``, it measures:

ours
    A storage "node" runs in another process (perf/common.py in its hidden ``--serve``
    mode): it creates a ``UcxRuntime``, maps an arena with ``remote_read=True``, fills every slot
    with a known pattern and hands (worker address, packed rkey, base, size) to this process
    over its stdout, then keeps its runtime (and its progress thread, which serves the
    TCP-emulated RMA) alive until its stdin closes. This process (the "learner") makes an
    endpoint and a ``RemoteKey`` and times ``_native.gather`` of a fresh random batch of slots
    per iteration, as sampling does, into one registered destination region. The first and
    the last batch are checked byte for byte; a mismatch makes the exit status 1.
mapped
    The same-host path learners take by default: this process receives the node's sealed
    arena fd over its Unix socket (transport/local_map.py), maps it read-only and times
    ``_native.mapped_gather`` (plain loads, ``--copy-threads`` threads for batches of 1 MiB
    or more) of the same batches. Measured once per size (it does not depend on UCX_TLS),
    in the first pass.
numpy
    The same rows (same size, same random slot indices) gathered locally from an in-process
    array of the same size with ``np.take(arena2d, idx, axis=0, out=out, mode="clip")``: the
    memory-copy ceiling of one core.
perftest
    ``ucx_perftest -t ucp_get -s SIZE -O BATCH`` (from the libucx wheel) between two local
    processes with the same UCX settings, for about the same number of bytes: what UCX itself
    reaches for reads of that size with a batch worth of reads in flight.

GB/s is 10^9 bytes per second: bytes moved / sum of the per-batch times (ours, numpy), or
ucx_perftest's overall bandwidth. The batch holds ~4 MiB (at least 4, at most 256 items)
unless ``--batch`` is given. Latencies are per batch for ours and numpy (ms), and per
operation (the "50.0%ile" column) for ucx_perftest (us).

Output: one JSON line per (tls, size) on stdout, then an aligned table; progress goes to
stderr. Run it from outside the source tree, e.g.::

    cd /tmp && /work/main/.venv/bin/python \\
        /work/main/perf/gather_bandwidth.py --iters 100 --json-out /tmp/gather.jsonl

``--plot FILE.png`` also draws GB/s against item size if matplotlib is importable.
Only 127.0.0.1 is used: the TCP transport is pinned to the ``lo`` device
(``UCX_NET_DEVICES=lo``) unless UCX_NET_DEVICES is already set.
"""

from __future__ import annotations

import argparse
import math
import sys

import common
import numpy as np
from common import (
    apply_ucx_env,
    fill_arena,
    fmt,
    log,
    measure_mapped,
    measure_numpy,
    measure_ours,
    measure_perftest,
    node,
    plot_size_sweep,
)

MiB = 1 << 20
DEFAULT_SIZES = "3072,28224,112896,1048576,3145728,10485760"
BATCH_BYTES = 4 * MiB
MIN_BATCH, MAX_BATCH = 4, 256
LARGE_ITEM = MiB  # items this big get a smaller arena...
LARGE_ARENA_MIN = 256 * MiB  # ...but still well beyond the last-level cache
LARGE_ARENA_SLOTS = 64


# --------------------------------------------------------------------------- config


def batch_for(size: int, override: int | None) -> int:
    if override:
        return override
    return max(MIN_BATCH, min(MAX_BATCH, round(BATCH_BYTES / size)))


def arena_slots(arena: int, size: int, batch: int) -> int:
    """Slots in the arena: `arena` bytes, fewer for large items, never fewer than a batch."""
    slots = arena // size
    if size >= LARGE_ITEM:
        slots = min(slots, max(LARGE_ARENA_SLOTS, math.ceil(LARGE_ARENA_MIN / size)))
    return max(slots, batch, 2)


# --------------------------------------------------------------------------- measurements


def run_one(args, tls: str, size: int) -> tuple[dict, bool]:
    apply_ucx_env(tls)
    batch = batch_for(size, args.batch)
    slots = arena_slots(args.arena, size, batch)
    rng = np.random.default_rng(args.seed)
    batches = [rng.integers(0, slots, batch) for _ in range(args.warmup + args.iters)]
    log(f"[{tls}] item {size} B, batch {batch}, arena {slots} slots "
        f"({slots * size / MiB:.0f} MiB)")
    with node(tls, size, slots) as (_, hello):
        arena2d = np.empty((slots, size), np.uint8)  # filled while the node fills its own
        fill_arena(arena2d)
        numpy_res, ok_np = measure_numpy(arena2d, batches, args.warmup)
        del arena2d
        ours, ok_ours = measure_ours(tls, hello, size, batches, args.warmup)
        mapped, ok_mapped = None, True
        if tls == args.mapped_pass:
            mapped, ok_mapped = measure_mapped(hello, size, batches, args.warmup,
                                               args.copy_threads)
    pt, why = measure_perftest(tls, size, batch, batch * args.iters, batch * args.warmup,
                               args.perftest_timeout)
    if why:
        log(f"[{tls}] ucx_perftest: {why}")
    row = {
        "tls": tls,
        "item_bytes": size,
        "batch": batch,
        "ours_gbps": ours["gbps"],
        "ours_p50_ms": ours["p50_ms"],
        "ours_p99_ms": ours["p99_ms"],
        "numpy_gbps": numpy_res["gbps"],
        "numpy_p50_ms": numpy_res["p50_ms"],
        "numpy_p99_ms": numpy_res["p99_ms"],
        "mapped_gbps": mapped["gbps"] if mapped else None,
        "mapped_p50_ms": mapped["p50_ms"] if mapped else None,
        "mapped_p99_ms": mapped["p99_ms"] if mapped else None,
        "mapped_vs_numpy": mapped["gbps"] / numpy_res["gbps"] if mapped else None,
        "arena_pages": hello.get("page_kind"),
        "perftest_gbps": pt["gbps"] if pt else None,
        "perftest_p50_us": pt["p50_us"] if pt else None,
        "ratio_vs_numpy": ours["gbps"] / numpy_res["gbps"],
        "ratio_vs_perftest": ours["gbps"] / pt["gbps"] if pt else None,
        "verified": bool(ok_np and ok_ours and ok_mapped),
    }
    if why:
        row["perftest_error"] = why
    return row, row["verified"]


# --------------------------------------------------------------------------- output


def print_table(rows: list[dict]) -> None:
    head = ["tls", "item_B", "batch", "ours_GB/s", "p50_ms", "p99_ms", "mapped_GB/s", "p50_ms",
            "p99_ms", "numpy_GB/s", "p50_ms", "p99_ms", "perf_GB/s", "p50_us", "vs_np",
            "mapped_vs_np", "vs_perf", "ok"]
    lines = [head]
    for r in rows:
        lines.append([
            r["tls"], str(r["item_bytes"]), str(r["batch"]),
            fmt(r["ours_gbps"], ".3g"), fmt(r["ours_p50_ms"], ".3f"),
            fmt(r["ours_p99_ms"], ".3f"), fmt(r["mapped_gbps"], ".3g"),
            fmt(r["mapped_p50_ms"], ".3f"), fmt(r["mapped_p99_ms"], ".3f"),
            fmt(r["numpy_gbps"], ".3g"),
            fmt(r["numpy_p50_ms"], ".3f"), fmt(r["numpy_p99_ms"], ".3f"),
            fmt(r["perftest_gbps"], ".3g"), fmt(r["perftest_p50_us"], ".2f"),
            fmt(r["ratio_vs_numpy"], ".2f"), fmt(r["mapped_vs_numpy"], ".2f"),
            fmt(r["ratio_vs_perftest"], ".2f"),
            "yes" if r["verified"] else "NO",
        ])
    common.print_table(head, lines[1:])


def plot(rows: list[dict], path: str) -> None:
    plot_size_sweep(rows, [("ours_gbps", "gather", "o-"), ("mapped_gbps", "mapped", "d-"),
                           ("numpy_gbps", "numpy", "s--"),
                           ("perftest_gbps", "ucx_perftest", "^:")],
                    "GB/s (10^9 B/s)", "batched gather bandwidth", path)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm,tcp",
                   help="transports, one pass each (UCX_TLS value per pass; default sm,tcp)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="item sizes in bytes, comma separated")
    p.add_argument("--batch", type=int, default=None,
                   help="items per batch (default: ~4 MiB worth, 4..256)")
    p.add_argument("--arena", type=int, default=1 << 30,
                   help="storage arena bytes (default 1 GiB; less for items >= 1 MiB)")
    p.add_argument("--iters", type=int, default=200, help="timed batches (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed batches first (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-threads", type=int, default=2,
                   help="threads of the mapped copy for batches >= 1 MiB (default 2)")
    p.add_argument("--mapped-pass", default=None,
                   help="the --tls pass that also measures the mapped path (default: the "
                        "first; 'none' to skip it)")
    p.add_argument("--perftest-timeout", type=float, default=180.0)
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="write a PNG of GB/s vs item size (needs matplotlib)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or (args.batch is not None and args.batch < 1):
        p.error("--iters and --batch must be positive, --warmup non-negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tls_list = [t.strip() for t in args.tls.split(",") if t.strip()]
    if args.mapped_pass is None:
        args.mapped_pass = tls_list[0] if tls_list else None
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return common.run_sweep(args.json_out, tls_list, sizes,
                            lambda tls, size: run_one(args, tls, size), print_table,
                            plot, args.plot)


if __name__ == "__main__":
    sys.exit(main())
