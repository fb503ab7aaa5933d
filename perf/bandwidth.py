"""Bandwidth sweep, 8 B to 64 MiB: our batched gather vs a numpy gather vs ucx_perftest.

For each UCX transport in ``--tls`` (default ``sm,tcp``, loopback only) and each item
size of ``--sizes`` (default powers of 4 from 8 B, and 64 MiB), it runs the measurement
of perf/gather_bandwidth.py (see there): random slots of an arena held by a storage node
in another process, gathered in batches by ``_native.gather`` into one registered
buffer; the same rows gathered locally with ``np.take`` (the one-core memory-copy
ceiling); and ``ucx_perftest -t ucp_get -O <batch>`` (UCX itself), all in the same run.

Large batches: ``--batch-bytes`` worth of items (default 8 MiB; at least 4, at most 256
items). The number of batches per size is scaled so each size moves about
``--bytes`` (default 1 GiB; at least 5, at most 200 batches), which keeps a full sweep
of both transports to a few minutes. GB/s is 10^9 bytes per second.

Output: one JSON line per (tls, size), a table, and with ``--plot`` a PNG of GB/s
against item size. ``gather_bandwidth.py`` is the same measurement at the item sizes
of the replay workloads; this script is the sweep.

    cd /tmp && <venv>/bin/python <repo>/perf/bandwidth.py \\
        --json-out /tmp/bandwidth.jsonl --plot /tmp/bandwidth.png
"""

from __future__ import annotations

import argparse
import sys

import gather_bandwidth
from common import plot_size_sweep, run_sweep, size_list

MiB = 1 << 20
DEFAULT_SIZES = "8,32,128,512,2K,8K,32K,128K,512K,2M,8M,32M,64M"
QUICK_SIZES = "8,512,32K,2M,64M"


def batch_for(size: int, batch_bytes: int) -> int:
    """Items per batch: `batch_bytes` worth, 4 to 256."""
    return max(4, min(256, batch_bytes // size))


def iters_for(size: int, batch: int, total: int) -> tuple[int, int]:
    """(timed, warm-up) batches so that one size moves about `total` bytes."""
    iters = max(5, min(200, total // (batch * size)))
    return iters, max(1, iters // 10)


def plot(rows: list[dict], path: str) -> None:
    """GB/s against item size, one line per method and transport."""
    plot_size_sweep(rows, [("ours_gbps", "our gather", "o-"), ("numpy_gbps", "numpy", "s--"),
                           ("perftest_gbps", "ucx_perftest", "^:")],
                    "GB/s (10^9 B/s)", "gather bandwidth, large batches", path, logy=True)


def parse_args(argv=None) -> argparse.Namespace:
    """Options; --quick changes the defaults of --sizes and --bytes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm,tcp", help="transports, one pass each (default sm,tcp)")
    p.add_argument("--sizes", default=None,
                   help=f"item sizes, comma separated, K/M suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--batch-bytes", type=int, default=8 * MiB,
                   help="bytes per batch (default 8 MiB; 4..256 items)")
    p.add_argument("--bytes", type=int, default=None,
                   help="bytes moved per size and method (default 1 GiB; --quick 128 MiB)")
    p.add_argument("--arena", type=int, default=256 * MiB,
                   help="storage arena bytes (default 256 MiB, beyond the caches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perftest-timeout", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 128 MiB each")
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="write a PNG of GB/s vs item size (needs matplotlib)")
    args = p.parse_args(argv)
    args.sizes = size_list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.bytes = args.bytes or (128 * MiB if args.quick else 1 << 30)
    return args


def main(argv=None) -> int:
    """Run the sweep; exit status 1 if any gathered byte was wrong."""
    args = parse_args(argv)

    def measure(tls: str, size: int):
        batch = batch_for(size, args.batch_bytes)
        iters, warmup = iters_for(size, batch, args.bytes)
        # The sweep measures the UCX gather; the same-host mapped copy is
        # gather_bandwidth.py's (--mapped-pass there).
        one = argparse.Namespace(batch=batch, arena=args.arena, iters=iters,
                                 warmup=warmup, seed=args.seed,
                                 perftest_timeout=args.perftest_timeout, mapped_pass=None,
                                 copy_threads=2)
        row, ok = gather_bandwidth.run_one(one, tls, size)
        row["iters"] = iters
        return row, ok

    tls_list = [t.strip() for t in args.tls.split(",") if t.strip()]
    return run_sweep(args.json_out, tls_list, args.sizes, measure,
                     gather_bandwidth.print_table, plot, args.plot)

if __name__ == "__main__":
    sys.exit(main())
