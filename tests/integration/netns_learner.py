"""The learner of test_multihost.py, run inside its own network namespace.

Inserts verifiable items, samples until told to stop and prints one JSON
line: the time of every good batch, bad bytes seen, errors, live nodes.
Not a test module itself (pytest collects test_*.py only).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import numpy as np

import distore_ucx as ds

ITEM = 4096
SPEC = {"obs": ((ITEM,), "uint8"), "key": ((), "uint64")}


def live(node: dict) -> bool:
    """Listed as live: a cut-off node is unresponsive (routed around, its
    items kept until the grace), not live."""
    return node.get("state", "live" if node["alive"] else "gone") == "live"


def items(first: int, n: int) -> dict:
    """Items whose bytes follow from their key, so any wrong byte is seen."""
    k = np.arange(first, first + n, dtype=np.uint64)
    return {"obs": ((k[:, None] * 31 + np.arange(ITEM)) % 251).astype(np.uint8), "key": k}


def bad_rows(batch) -> int:
    """How many rows of a batch hold bytes that are not their key's."""
    k = batch.data["key"]
    expect = ((k[:, None] * 31 + np.arange(ITEM)) % 251).astype(np.uint8)
    return int((batch.data["obs"] != expect).any(axis=1).sum())


def main() -> int:
    # A learner stuck in a read shows where, in its log, every 30 s.
    faulthandler.dump_traceback_later(30, repeat=True)
    p = argparse.ArgumentParser()
    p.add_argument("--control", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--items", type=int, default=2000)
    args = p.parse_args()
    out = {"ok_times": [], "bad": 0, "errors": [], "batches": 0}
    with ds.connect(args.control) as client:
        client.create_table("t", capacity=100_000, spec=SPEC)
        with client.writer(max_items=100) as writer:  # batches go round robin over nodes
            for first in range(0, args.items, 100):
                writer.insert("t", items(first, 100))
        learner = client.learner("t", batch_size=32, transfer_timeout=1.0, timeout=5.0)
        for _ in range(20):
            out["bad"] += bad_rows(learner.sample())
        out["nodes_before"] = [n["node_id"] for n in client.status()["nodes"] if live(n)]
        with open(args.ready_file + ".tmp", "w") as fh:
            json.dump({"time": time.time()}, fh)
        os.replace(args.ready_file + ".tmp", args.ready_file)
        while not os.path.exists(args.stop_file):
            try:
                batch = learner.sample()
            except ds.DistoreError as exc:
                out["errors"].append([time.time(), f"{type(exc).__name__}: {exc}"])
                continue
            out["batches"] += 1
            out["bad"] += bad_rows(batch)
            out["ok_times"].append(time.time())
        out["nodes_after"] = [n["node_id"] for n in client.status()["nodes"] if live(n)]
        out["resampled"] = learner.resampled
        learner.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
