"""Reverb's priority updates, the baseline of perf/control_plane.py's `remote` group.

Runs under a Python that has DeepMind's Reverb (`pip install dm-reverb==0.14.0
tensorflow==2.15.0` into a venv of its own: Reverb pins TensorFlow and numpy < 2,
which the store's own venv does not take), never imports distore_ucx:

    <reverb-venv>/bin/python perf/reverb_updates.py --items 262144 --batches 2000

A Reverb server runs in a child process (as the store's control plane does),
with a table like the store's: prioritized sampler (exponent 0.6), FIFO remover,
capacity --items. The script inserts --items items of 8 bytes, learns the keys
of up to --keys of them by sampling (Reverb does not hand writers their items'
keys), then calls `Client.mutate_priorities` with 1024 and with 32 random keys
of those a call, back to back, each call waiting for its reply (Reverb's client
has no other way), for as many keys in all as the store's run (--batches x 1024).
Prints one JSON line per size: {"bench": "reverb_updates", "batch", "keys_per_s",
"p50_us", "p99_us", "keys_known"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up chatter


def serve(items: int) -> None:
    """Run a Reverb server with one table until stdin closes; its port on stdout."""
    import reverb

    table = reverb.Table("p", sampler=reverb.selectors.Prioritized(0.6),
                         remover=reverb.selectors.Fifo(), max_size=items,
                         rate_limiter=reverb.rate_limiters.MinSize(1))
    server = reverb.Server(tables=[table])
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


def measure(args) -> list[dict]:
    """Fill the child's table, then time mutate_priorities a size."""
    import numpy as np
    import reverb

    child = subprocess.Popen([sys.executable, __file__, "--serve", "--items", str(args.items)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        client = reverb.Client(f"localhost:{port}")
        t0 = time.perf_counter()
        with client.trajectory_writer(num_keep_alive_refs=1) as w:
            for i in range(args.items):
                w.append({"x": np.zeros(8, np.uint8)})
                w.create_item("p", 1.0, {"x": w.history["x"][-1:]})
                if i % 4096 == 4095:  # Reverb asks writers to flush regularly
                    w.flush()
            w.flush()
        print(f"reverb: {args.items} items inserted in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        keys: set[int] = set()
        for sample in client.sample("p", num_samples=args.keys):
            keys.add(int(sample[0].info.key))
        known = np.array(sorted(keys), np.uint64)
        rng = np.random.default_rng(1)
        rows = []
        for per_call in (1024, 32):
            calls = args.batches * 1024 // per_call
            prios = rng.uniform(0.1, 2, per_call).tolist()
            batches = [dict(zip(known[rng.integers(0, len(known), per_call)].tolist(), prios))
                       for _ in range(calls)]
            client.mutate_priorities("p", updates=batches[0])
            lat = []
            t0 = time.perf_counter()
            for b in batches:
                t = time.perf_counter()
                client.mutate_priorities("p", updates=b)
                lat.append(time.perf_counter() - t)
            rate = calls * per_call / (time.perf_counter() - t0)
            us = np.array(lat) * 1e6
            rows.append({"bench": "reverb_updates", "batch": per_call, "keys_per_s": round(rate),
                         "p50_us": round(float(np.percentile(us, 50)), 2),
                         "p99_us": round(float(np.percentile(us, 99)), 2),
                         "keys_known": len(known)})
        return rows
    finally:
        child.stdin.close()
        child.wait(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=262_144, help="items in the table")
    p.add_argument("--batches", type=int, default=2000,
                   help="keys updated in all a size: this many x 1024")
    p.add_argument("--keys", type=int, default=8192,
                   help="samples drawn to learn keys to update")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.items)
        return 0
    for row in measure(args):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
