"""Demotion picks: how fast the control plane names the items a full node moves to disk.

A node whose arena is full asks the control plane for ``--n`` items at a time
(64, as storage/room.py does). For each table size in ``--items`` and each
sampler (prioritized, uniform) this builds a real control-plane ``Table`` of
8-byte items spread over 2 nodes (no processes, no network) and times, in
the same run:

- ``scan``: the exact picker, one scan of every record per request
  (``control/tiers.py`` ``pick_demotions``; what every request cost before
  ``Demotions``), median of ``--scans`` requests;
- ``ranked``: ``Demotions.pick``, one scan ranking many candidates and later
  requests taking the next ones that still qualify; every picked item is
  then marked moved, as the node's ``items_moved`` report does, until
  ``--total`` items were picked. Its time per request includes its scans.

Output: one JSON line per (size, sampler) on stdout, then a table; progress
on stderr.

    cd /tmp && <venv>/bin/python <repo>/perf/demotion.py --items 1000000 4000000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(n: int, kind: str):
    """A Table of n 8-byte items, alternately on nodes 1 and 2 in chunks."""
    import distore_ucx as ds
    from distore_ucx.control.tables import Table
    from distore_ucx.spec import TableSpec

    spec = TableSpec.parse(((8,), "uint8"))
    sampler = ds.Prioritized(0.6) if kind == "prioritized" else ds.Uniform()
    table = Table.make("t", n, spec, sampler=sampler)
    chunk = 1 << 16
    for i in range(0, n, chunk):
        keys = np.arange(i + 1, min(n, i + chunk) + 1, dtype=np.uint64)
        prios = np.random.default_rng(i).random(len(keys)) + 0.1
        table.add(1 + (i // chunk) % 2, keys, keys * np.uint64(64), keys, prios)
    return table


def measure(n: int, kind: str, args) -> dict:
    from distore_ucx.control.tiers import COLD, Demotions, pick_demotions

    table = build(n, kind)
    scan = []
    for _ in range(args.scans):
        t0 = time.perf_counter()
        keys, _, _ = pick_demotions(table, 1, args.n)
        scan.append(time.perf_counter() - t0)
    assert len(keys) == args.n
    picker, total, requests = Demotions(), 0, 0
    t0 = time.perf_counter()
    while total < args.total:
        keys, _, _ = picker.pick(table, 1, args.n)
        if len(keys) == 0:
            break
        table.store.offset[table.core.lookup(keys)] |= COLD  # the node moved them
        total += len(keys)
        requests += 1
    ranked = (time.perf_counter() - t0) / max(1, requests)
    return {"items": n, "sampler": kind, "n": args.n,
            "scan_ms": float(np.median(scan)) * 1e3, "ranked_ms": ranked * 1e3,
            "speedup": float(np.median(scan)) / ranked, "picked": total,
            "scans": picker.scans}


def main(argv=None) -> int:
    """Run the measurements; print JSON lines, then a table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--n", type=int, default=64, help="items a request asks for")
    p.add_argument("--scans", type=int, default=10, help="full-scan requests timed")
    p.add_argument("--total", type=int, default=200_000, help="items picked by Demotions")
    args = p.parse_args(argv)
    rows = []
    for n in args.items:
        for kind in ("prioritized", "uniform"):
            log(f"{n} items, {kind} ...")
            row = measure(n, kind, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"{'items':>10} {'sampler':>12} {'scan_ms':>8} {'ranked_ms':>9} {'x':>6} {'scans':>6}")
    for r in rows:
        print(f"{r['items']:>10} {r['sampler']:>12} {r['scan_ms']:>8.2f} {r['ranked_ms']:>9.3f} "
              f"{r['speedup']:>6.0f} {r['scans']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
