"""Both ends of the native active-message sample path (native/am_sample.h)
as separate processes over UCX: a storage node's side (an arena of
patterned slots and an AmSampleServer on the worker's progress thread) and
a learner's (an AmSampleClient reading dense batches into a registered
ring slot, or, with --path get, today's batched gets: gather_dense through
a staging buffer, as the learner reads nodes it does not map).
perf/am_sample_native.py measures with it; tests/integration/
test_am_sample.py checks with it.

    python am_sample_peer.py node --item-bytes 112896 --slots 64
        prints {"address", "rkey", "base", "size", "slot_size", "slots", "pid"}
        (hex for bytes), then answers stdin lines: "stats" (one JSON line), "exit".
    python am_sample_peer.py learner HELLO_JSON --item-bytes 112896 --slots 64 --batch 32
        reads --batches batches (every byte checked) or for --seconds (the
        first and last batch checked) and prints one JSON line:
        {"batches", "bad", "statuses", "gbps", "p50_ms", "p99_ms", "client"}.

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
        arena = _native.MemoryRegion.write_protected(rt.region_owner, slot_size * args.slots, False)
        view = arena.view()
        for s in range(args.slots):
            slot = view[s * slot_size:(s + 1) * slot_size]
            slot[:SLOT_HEADER].view(np.uint64)[:] = [key_of(s), generation_of(s)]
            for f, data in zip(spec.fields, expected(spec, s)):
                slot[SLOT_HEADER + f.offset:SLOT_HEADER + f.offset + f.nbytes] = data
        _native.allow_remote_reads(arena.address, arena.size)
        server = _native.AmSampleServer(rt.worker, arena, endpoints=args.endpoints,
                                        max_in_flight=args.max_in_flight, stall=args.stall)
        print(json.dumps({"address": rt.address.hex(), "rkey": arena.pack_rkey().hex(),
                          "base": arena.address, "size": arena.size, "slot_size": slot_size,
                          "slots": args.slots, "pid": os.getpid()}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "stats":
                stats = dict(server.stats)
                stats["cpu_s"] = time.process_time()  # every thread of the node
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


class Reader:
    """One learner ring slot (a registered region, dense layout) and the path
    that fills it from the node."""

    def __init__(self, rt, spec: TableSpec, n: int, hello: dict, args):
        self.spec, self.n, self.path = spec, n, args.path
        self.worker = rt.reader_worker  # progressed by the read alone, as a learner's
        # Gets need peer-failure handling (a learner's endpoints have it over
        # TCP); the active messages take whichever --error-handling says.
        eh = args.error_handling or args.path == "get"
        self.ep = _native.Endpoint(self.worker, bytes.fromhex(hello["address"]), eh, "node")
        self.layout = spec.layout(n)
        self.reads = _native.BatchLayout(
            n, self.layout.header,
            np.array([SLOT_HEADER + f.offset for f in spec.fields], np.uint64),
            np.array([f.nbytes for f in spec.fields], np.uint64),
            np.array(self.layout.offsets, np.uint64))
        self.dest = rt.map_region(self.layout.nbytes)
        self.buf = self.dest.view()
        self.buf.fill(0)  # fault the pages in now, as the ring does
        self.rows = np.arange(n, dtype=np.uint64)
        self.slot_size = hello["slot_size"]
        self.timeout, self.rndv_min = args.timeout, args.rndv_min
        if args.path == "am":
            self.client = _native.AmSampleClient(self.worker)
        else:
            self.key = _native.RemoteKey(self.ep, bytes.fromhex(hello["rkey"]), hello["base"],
                                         hello["size"], "node")
            self.base = np.uint64(hello["base"])
            self.staging = rt.map_region(n * self.reads.read_length)
            self.staging.view().fill(0)

    def read(self, slots: np.ndarray) -> np.ndarray:
        offsets = slots.astype(np.uint64) * np.uint64(self.slot_size)
        if self.path == "am":
            return self.client.fetch([self.ep], np.zeros(self.n, np.uint32), offsets, self.rows,
                                     self.reads, self.dest, self.timeout, self.rndv_min)
        return _native.gather_dense(self.worker, [self.key], np.zeros(self.n, np.uint32),
                                    self.base + offsets, self.rows, self.reads, self.dest,
                                    self.staging, self.timeout)

    def bad_rows(self, slots: np.ndarray, statuses: np.ndarray) -> int:
        """Rows whose status, header or any byte is wrong."""
        headers = self.spec.header_view(self.buf, self.layout)
        views = [np.ndarray((self.n,) + f.shape, f.dtype, buffer=self.buf, offset=o)
                 for f, o in zip(self.spec.fields, self.layout.offsets)]
        assert all(v.flags.c_contiguous for v in views)
        same = (headers[:, 0] == key_of(slots)) & (headers[:, 1] == generation_of(slots))
        bad = set(np.flatnonzero(~same | (statuses != 0)).tolist())
        for r, s in enumerate(slots.tolist()):
            for v, want in zip(views, expected(self.spec, s)):
                if not np.array_equal(v[r].reshape(-1).view(np.uint8), want):
                    bad.add(r)
        return len(bad)

    def close(self):
        if self.path == "am":
            self.client.close()
        else:
            self.key = None
        self.ep.close(self.ep.error_handling, 1.0)


def run_learner(args) -> int:
    hello = json.loads(args.hello)
    spec = spec_of(args.item_bytes, args.fields)
    n = args.batch
    with UcxRuntime(config=ucx_config(args.tls), env_tls=args.tls) as rt:
        reader = Reader(rt, spec, n, hello, args)
        rng = np.random.default_rng(args.seed)
        if args.die_after > 0:  # SIGKILL ourselves mid-batch
            threading.Timer(args.die_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        lat, bad, seen = [], 0, set()
        t0, cpu0 = time.perf_counter(), time.process_time()
        b = 0
        while True:
            last = (args.batches and b == args.batches - 1) or (
                args.seconds and time.perf_counter() - t0 >= args.seconds)
            slots = rng.choice(hello["slots"], n, replace=False)
            check = args.check and (args.batches or b == 0 or last)
            if check:
                reader.buf[:] = 0  # a row not written reads as wrong
            start = time.perf_counter()
            statuses = reader.read(slots)
            lat.append(time.perf_counter() - start)
            seen.update(statuses.tolist())
            if check:
                bad += reader.bad_rows(slots, statuses)
            else:
                bad += int(np.count_nonzero(statuses))
            b += 1
            if last:
                break
        cpu = time.process_time() - cpu0
        lat_s = np.array(lat[min(args.warmup, len(lat) - 1):])
        out = {"path": args.path, "batches": b, "bad": bad, "statuses": sorted(seen),
               "bytes": b * n * spec.item_bytes, "cpu_s": cpu,
               "gbps": n * spec.item_bytes / float(np.median(lat_s)) / 1e9,
               "mean_gbps": n * spec.item_bytes * len(lat_s) / float(lat_s.sum()) / 1e9,
               "p50_ms": float(np.median(lat_s)) * 1e3,
               "p99_ms": float(np.percentile(lat_s, 99)) * 1e3}
        if args.path == "am":
            out["client"] = dict(reader.client.stats)
        print(json.dumps(out), flush=True)
        reader.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=("node", "learner"))
    p.add_argument("hello", nargs="?", help="learner: the node's first output line (JSON)")
    p.add_argument("--tls", default="tcp")
    p.add_argument("--item-bytes", type=int, required=True)
    p.add_argument("--fields", type=int, choices=(1, 3), default=1)
    p.add_argument("--slots", type=int, default=64, help="node: slots in the arena")
    p.add_argument("--endpoints", default="reply", help="node: the server's endpoint mode")
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--stall", type=float, default=10.0,
                   help="node: abandon a batch after this many seconds without progress")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--path", choices=("am", "get"), default="am",
                   help="learner: active messages (AmSampleClient) or today's gets")
    p.add_argument("--batches", type=int, default=0, help="read this many, every byte checked")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="or read for this long (first and last batch checked)")
    p.add_argument("--warmup", type=int, default=3, help="batches left out of the figures")
    p.add_argument("--check", type=int, default=1, help="0: check no bytes")
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
