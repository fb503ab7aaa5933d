"""The writer and learner of test_multihost.py's two-namespace test, run in
the client's network namespace while the store runs in another.

Inserts keyed items (tests/helpers.py: every byte follows from the item's
key) one per call and in batches, then samples `--batches` batches and
checks every item of each, and that every field is a C-contiguous
[batch, *shape] array. Prints one JSON line: counts, and how the writer's
and the learner's nodes read and were read. Not a test module itself.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for helpers.py

import helpers  # noqa: E402

import distore_ucx as ds  # noqa: E402


def main() -> int:
    faulthandler.dump_traceback_later(60, repeat=True)  # a stuck read shows where
    p = argparse.ArgumentParser()
    p.add_argument("--control", required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    out = {"inserted": 0, "sampled_items": 0, "bad_batches": 0, "not_dense": []}
    mult = 7  # neighbouring keys differ in every byte
    with ds.connect(args.control) as client:
        client.create_table("t", capacity=args.items, spec=helpers.keyed_spec(args.width))
        with client.writer() as writer:
            half = args.items // 2
            # One item per call (the writer's one-item path) ...
            for k in range(half):
                one = helpers.keyed_items(k, 1, args.width, mult)
                writer.insert("t", {"obs": one["obs"][0], "key": one["key"][0]})
            # ... and whole batches per call.
            for first in range(half, args.items, 16):
                writer.insert("t", helpers.keyed_items(first, min(16, args.items - first),
                                                       args.width, mult))
            writer.flush()
            out["inserted"] = args.items
            out["writer_paths"] = sorted(set(writer.paths.values()))
        with client.learner("t", batch_size=args.batch_size) as learner:
            seen = set()
            for _ in range(args.batches):
                batch = learner.sample()
                for name, array in batch.data.items():
                    if not array.flags.c_contiguous or array.shape[0] != len(batch):
                        out["not_dense"].append([name, list(array.shape),
                                                 list(array.strides)])
                try:
                    helpers.check_keyed(batch, args.width, mult)
                except AssertionError:
                    out["bad_batches"] += 1
                out["sampled_items"] += len(batch)
                seen.update(int(k) for k in batch.data["key"])
            out["distinct_keys"] = len(seen)
            out["max_key"] = max(seen)
            out["learner_paths"] = sorted(set(learner.paths.values()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
