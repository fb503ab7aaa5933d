"""The hostile peer of test_remote_writes.py: a client that authenticates as
a learner does, takes a node's worker address and remote key, and then
either writes into the node with UCX puts or reads its arena with gets,
over an endpoint with or without peer-failure handling.

Prints one JSON line per operation ({"op", "address", "status"}); a put
the node refuses may never complete, so the test bounds this process's
time and kills it. Not a test module itself (pytest collects test_*.py only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

import distore_ucx as ds
from distore_ucx._native_loader import _native


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("control")
    p.add_argument("node_id", type=int)
    p.add_argument("--error-handling", action="store_true",
                   help="make the endpoint with UCP_ERR_HANDLING_MODE_PEER")
    p.add_argument("--put", type=lambda s: int(s, 0), default=None,
                   help="write 256 bytes of 0xEE at this absolute address of the node")
    p.add_argument("--get", type=int, default=0,
                   help="read this many bytes from the start of the arena, 4 times")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--linger", type=float, default=0.0,
                   help="stay connected this many seconds before exiting")
    args = p.parse_args()

    client = ds.connect(args.control)
    node = [n for n in client.nodes() if n["node_id"] == args.node_id][0]
    worker = client.runtime.worker
    try:
        ep = _native.Endpoint(worker, node["worker_address"], args.error_handling, "victim")
    except ds.DistoreError as exc:  # e.g. no transport of UCX_TLS detects peer failures
        print(json.dumps({"op": "endpoint", "status": -1, "error": str(exc)}), flush=True)
        return 0
    print(json.dumps({"op": "endpoint", "status": 0}), flush=True)
    if args.put is not None:
        # A key that claims to span the whole address space: the bounds a
        # learner's key checks are the client's own, nothing the node enforces.
        key = _native.RemoteKey(ep, node["rkey"], 0, (1 << 64) - 1, "victim")
        src = client.runtime.map_region(4096)
        src.view()[:] = 0xEE
        status = _native.put(worker, key, args.put, src, 256, args.timeout)
        print(json.dumps({"op": "put", "address": args.put, "status": status}), flush=True)
    if args.get:
        key = _native.RemoteKey(ep, node["rkey"], node["arena_base"], node["arena_size"],
                                "victim")
        dest = client.runtime.map_region(args.get)
        for _ in range(4):
            status = _native.gather(worker, [key], np.zeros(1, np.uint32),
                                    np.array([node["arena_base"]], np.uint64),
                                    np.array([args.get], np.uint64), dest,
                                    np.zeros(1, np.uint64), args.timeout, 0.0)
            digest = hashlib.sha256(bytes(dest.view()[:args.get])).hexdigest()
            print(json.dumps({"op": "get", "address": node["arena_base"],
                              "status": int(status[0]), "sha256": digest}), flush=True)
    sys.stdout.flush()
    if args.linger:
        time.sleep(args.linger)  # stays connected while the test looks at the node
    return 0


if __name__ == "__main__":
    sys.exit(main())
