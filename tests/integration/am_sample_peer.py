"""Both ends of test_am_sample.py, as separate processes over UCX: a storage
node's side (an arena of patterned slots and an AmSampleServer on the
worker's progress thread) and a learner's (an AmSampleClient reading dense
batches and checking every byte). Not a test module itself (pytest
collects test_*.py only); perf/am_sample_native.py measures with it.

    python am_sample_peer.py node --item-bytes 112640 --slots 64
        prints {"address": hex, "slot_size": ..., "slots": ..., "pid": ...};
        then answers stdin lines: "stats" (one JSON line), "exit".
    python am_sample_peer.py learner ADDRESS --item-bytes 112640 --slots 64 --batch 32
        prints one JSON line per batch: {"batch", "ok", "bad", "seconds", "bytes"}.

A slot's header is (key, generation) of slot s; its fields are bytes that
follow from s (`expected`), so a wrong, torn or misplaced item is seen.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

from distore_ucx._native_loader import _native
from distore_ucx.spec import SLOT_HEADER, TableSpec
from distore_ucx.transport.runtime import UcxRuntime

SEED = 20260


def spec_of(item_bytes: int, fields: int) -> TableSpec:
    """One uint8 field of `item_bytes`, or (fields=3) that and two small
    fields after it with alignment padding between them, as real tables
    have (a reward, a step)."""
    if fields == 1:
        return TableSpec.parse(((item_bytes,), "uint8"))
    return TableSpec.parse({"obs": ((item_bytes,), "uint8"), "reward": ((), "float32"),
                            "step": ((), "int64")})


def key_of(slot: np.ndarray) -> np.ndarray:
    return np.asarray(slot, np.uint64) + np.uint64(1 << 40)


def generation_of(slot: np.ndarray) -> np.ndarray:
    return np.asarray(slot, np.uint64) * np.uint64(3) + np.uint64(1)


def expected(spec: TableSpec, slot: int) -> list[np.ndarray]:
    """The bytes of each field of slot `slot`."""
    out = []
    for k, f in enumerate(spec.fields):
        base = np.random.default_rng(SEED + k).integers(0, 256, f.nbytes, np.uint8)
        out.append(np.roll(base, (slot * 7919) % max(f.nbytes, 1)))
    return out


def ucx_config(tls: str) -> dict[str, str]:
    # As storage nodes and clients run: rendezvous by put_zcopy (chosen by
    # the sender), no adaptive progress (storage/node.py says why).
    return {"TLS": tls, "RNDV_SCHEME": "put_zcopy", "ADAPTIVE_PROGRESS": "n"}


def run_node(args) -> int:
    # The guards a storage node installs before its worker exists: the
    # node's own sends must not trip them.
    config = ucx_config(args.tls)
    if _native.refuse_remote_writes() or _native.refuse_tcp_puts():
        config["TCP_PUT_ENABLE"] = "n"
    spec = spec_of(args.item_bytes, args.fields)
    slot_size = spec.slot_size
    with UcxRuntime(config=config, env_tls=args.tls) as rt:
        arena = _native.MemoryRegion.write_protected(rt.context, slot_size * args.slots, False)
        view = arena.view()
        for s in range(args.slots):
            slot = view[s * slot_size:(s + 1) * slot_size]
            slot[:SLOT_HEADER].view(np.uint64)[:] = [key_of(s), generation_of(s)]
            for f, data in zip(spec.fields, expected(spec, s)):
                slot[SLOT_HEADER + f.offset:SLOT_HEADER + f.offset + f.nbytes] = data
        _native.allow_remote_reads(arena.address, arena.size)
        server = _native.AmSampleServer(rt.worker, arena, endpoints=args.endpoints,
                                        max_in_flight=args.max_in_flight, stall=args.stall)
        print(json.dumps({"address": rt.address.hex(), "slot_size": slot_size,
                          "slots": args.slots, "pid": os.getpid()}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "stats":
                stats = dict(server.stats)
                stats["guard"] = dict(_native.refused_remote_access())
                print(json.dumps(stats), flush=True)
            elif cmd == "progress":  # what a node's periodic sweep would do
                rt.worker.progress()
                print(json.dumps({"progressed": True}), flush=True)
            elif cmd == "exit":
                break
        closed = server.close(5.0)
        print(json.dumps({"closed": closed}), flush=True)
    return 0


def run_learner(args) -> int:
    spec = spec_of(args.item_bytes, args.fields)
    slot_size = spec.slot_size
    n = args.batch
    with UcxRuntime(config=ucx_config(args.tls), env_tls=args.tls) as rt:
        worker = rt.reader_worker  # progressed by fetch alone, as a learner's gathers are
        ep = _native.Endpoint(worker, bytes.fromhex(args.address), args.error_handling, "node")
        client = _native.AmSampleClient(worker)
        layout = spec.layout(n)
        reads = _native.BatchLayout(
            n, layout.header, np.array([SLOT_HEADER + f.offset for f in spec.fields], np.uint64),
            np.array([f.nbytes for f in spec.fields], np.uint64),
            np.array(layout.offsets, np.uint64))
        dest = rt.map_region(layout.nbytes)
        buf = dest.view()
        buf.fill(0)  # fault the pages in now
        views = [np.ndarray((n,) + f.shape, f.dtype, buffer=buf, offset=o)
                 for f, o in zip(spec.fields, layout.offsets)]
        headers = np.ndarray((n, 2), np.uint64, buffer=buf, offset=layout.header)
        rng = np.random.default_rng(args.seed)
        node = np.zeros(n, np.uint32)
        rows = np.arange(n, dtype=np.uint64)
        if args.die_after > 0:  # SIGKILL ourselves mid-batch
            threading.Timer(args.die_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        b = 0
        while args.batches == 0 or b < args.batches:
            slots = rng.choice(args.slots, n, replace=False)
            buf[layout.header:] = 0 if args.check else buf[layout.header:]
            t0 = time.perf_counter()
            statuses = client.fetch([ep], node, slots.astype(np.uint64) * np.uint64(slot_size),
                                    rows, reads, dest, args.timeout, args.rndv_min)
            seconds = time.perf_counter() - t0
            bad = int(np.count_nonzero(statuses))
            if args.check:
                same = (headers[:, 0] == key_of(slots)) & (headers[:, 1] == generation_of(slots))
                bad_rows = set(np.flatnonzero(~same | (statuses != 0)).tolist())
                for r, s in enumerate(slots.tolist()):
                    for v, want in zip(views, expected(spec, s)):
                        if not np.array_equal(v[r].reshape(-1).view(np.uint8), want):
                            bad_rows.add(r)
                bad = len(bad_rows)
                assert all(v.flags.c_contiguous for v in views)
            print(json.dumps({"batch": b, "ok": bad == 0, "bad": bad,
                              "statuses": sorted(set(statuses.tolist())), "seconds": seconds,
                              "bytes": n * spec.item_bytes}), flush=True)
            b += 1
        print(json.dumps({"stats": dict(client.stats)}), flush=True)
        client.close()
        ep.close(args.error_handling, 1.0)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=("node", "learner"))
    p.add_argument("address", nargs="?", help="the node's worker address, hex (learner)")
    p.add_argument("--tls", default="tcp")
    p.add_argument("--item-bytes", type=int, required=True)
    p.add_argument("--fields", type=int, choices=(1, 3), default=1)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--endpoints", default="reply", help="node: the server's endpoint mode")
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--stall", type=float, default=10.0,
                   help="node: abandon a batch after this many seconds without progress")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=1, help="0: until killed")
    p.add_argument("--check", type=int, default=1, help="check every byte (0: do not)")
    p.add_argument("--error-handling", action="store_true",
                   help="learner: its endpoint has peer-failure handling")
    p.add_argument("--rndv-min", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--die-after", type=float, default=0.0,
                   help="learner: SIGKILL itself after this many seconds")
    args = p.parse_args()
    return run_node(args) if args.role == "node" else run_learner(args)


if __name__ == "__main__":
    sys.exit(main())
