"""Learner fetch into device memory: bandwidth against a plain copy, and data waits.

For each workload (W1: 32 x 112,896 B items, Atari frames; R2D2: 4 x 10 MiB
sequences) and each device in ``--devices`` (``cpu``; ``cuda:0`` where a GPU
is visible, its rows skipped with a message elsewhere) it starts a
LocalCluster (one storage node, ``UCX_TLS`` from ``--tls``, default sm),
inserts random items and measures, in the same run:

fetch
    ``learner.sample()`` back to back (no prefetch thread): sampled bytes
    landed on the device per second, control-plane round trip included.
    On a GPU the time includes the staging copy (synchronised per batch).
    ``iter``: the same, iterating the learner (the prefetch thread samples).
baseline
    A plain copy of the same number of bytes into the same kind of memory:
    on the CPU a numpy copy host to host from a source larger than the
    caches (one core's memory-copy ceiling: what landing sampled bytes in
    host memory costs at best); on a GPU a pinned
    host tensor copied to the device (``copy_(non_blocking=True)`` then
    synchronize), the best a host-staged fetch could do.
wait
    ``for batch in learner`` with ``--prefetch`` (default 2) batches in
    flight and a simulated ``--step-ms`` (default 5) training step: a sleep,
    since during a GPU step the learner's CPU only waits. The wait fraction
    is the time spent inside ``next()`` over wall time.

Output: one JSON line per (workload, device), then a table. GB/s = 10^9 B/s.
Run it from outside the source tree::

    cd /tmp && <venv>/bin/python <repo>/perf/gpu_fetch.py

Only 127.0.0.1 is used (UCX_NET_DEVICES=lo unless already set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

WORKLOADS = {
    # name: (item bytes, batch size, items in the table)
    "W1": (112_896, 32, 512),
    "R2D2": (10 << 20, 4, 24),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gpu_available() -> tuple[bool, str]:
    """(True, "") if torch sees a CUDA GPU, else (False, why)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU"
    return True, ""


def baseline_cpu(nbytes: int, iters: int) -> float:
    """GB/s of numpy host-to-host copies of nbytes into one destination, from
    successive parts of a source far larger than the caches (as sampled
    items come from a large arena, not from a cache-hot buffer)."""
    parts = max(4, (512 << 20) // nbytes)
    src = np.ones(parts * nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src[:nbytes])
    t0 = time.perf_counter()
    for i in range(iters):
        j = (i + 1) % parts * nbytes
        np.copyto(dst, src[j : j + nbytes])
    return nbytes * iters / (time.perf_counter() - t0) / 1e9


def baseline_gpu(nbytes: int, iters: int, device: str) -> float:
    """GB/s of a pinned host tensor copied to `device`, synchronised each time."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    return nbytes * iters / (time.perf_counter() - t0) / 1e9


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(client, table: str, batch: int, item: int, device: str, args) -> dict:
    framework = "torch" if device.startswith("cuda") else "numpy"
    nbytes = batch * item
    row: dict = {"device": device, "batch": batch, "item_bytes": item}
    with client.learner(table, batch, device=device, prefetch=args.prefetch,
                        framework=framework) as learner:
        row["path"] = learner.path
        for _ in range(args.warmup):
            learner.sample()
        lat = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            learner.sample()
            sync(device)
            lat.append(time.perf_counter() - t0)
        lat = np.array(lat)
        row["fetch_GBps"] = nbytes * len(lat) / lat.sum() / 1e9
        row["fetch_p50_ms"] = float(np.median(lat) * 1e3)
        row["fetch_p99_ms"] = float(np.percentile(lat, 99) * 1e3)
        # The same learner iterated flat out: the prefetch thread samples.
        it = iter(learner)
        next(it)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            next(it)
            sync(device)
        row["iter_GBps"] = nbytes * args.iters / (time.perf_counter() - t0) / 1e9
    if device.startswith("cuda"):
        row["baseline"] = "pinned host -> device copy"
        row["baseline_GBps"] = baseline_gpu(nbytes, args.iters, device)
    else:
        row["baseline"] = "numpy host copy"
        row["baseline_GBps"] = baseline_cpu(nbytes, args.iters)
    row["ratio"] = row["fetch_GBps"] / row["baseline_GBps"]
    row["iter_ratio"] = row["iter_GBps"] / row["baseline_GBps"]

    step = args.step_ms / 1e3
    with client.learner(table, batch, device=device, prefetch=args.prefetch,
                        framework=framework) as learner:
        it = iter(learner)
        for _ in range(args.warmup):
            next(it)
        waited = 0.0
        t_start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            next(it)
            waited += time.perf_counter() - t0
            time.sleep(step)  # the simulated training step
            sync(device)
        wall = time.perf_counter() - t_start
    row.update(prefetch=args.prefetch, step_ms=args.step_ms, steps=args.steps,
               wait_fraction=waited / wall, steps_per_s=args.steps / wall)
    return row


def run_workload(name: str, devices: list[str], args) -> list[dict]:
    import distore_ucx as ds

    item, batch, count = WORKLOADS[name]
    slot = ds.TableSpec.parse(((item,), "uint8")).slot_size
    arena = max(64 << 20, slot * (count + 64) * 2)
    rows = []
    log(f"{name}: starting a storage node ({arena >> 20} MiB arena, UCX_TLS={args.tls})")
    with ds.LocalCluster(nodes=1, arena_bytes=arena, env={"UCX_TLS": args.tls},
                         log_level="WARNING") as cluster, ds.connect(cluster.address) as client:
        client.create_table(name, capacity=count, spec=((item,), "uint8"))
        rng = np.random.default_rng(1)
        with client.writer(max_items=max(1, (8 << 20) // item)) as writer:
            for start in range(0, count, 8):
                k = min(8, count - start)
                writer.insert(name, rng.integers(0, 256, (k, item), dtype=np.uint8))
        for device in devices:
            log(f"{name}: measuring on {device}")
            row = {"workload": name, "tls": args.tls, **measure(client, name, batch, item,
                                                                  device, args)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [("workload", "{}"), ("device", "{}"), ("path", "{}"), ("batch", "{}"),
            ("fetch_GBps", "{:.2f}"), ("fetch_p50_ms", "{:.2f}"), ("fetch_p99_ms", "{:.2f}"),
            ("iter_GBps", "{:.2f}"), ("baseline_GBps", "{:.2f}"), ("ratio", "{:.2f}"),
            ("iter_ratio", "{:.2f}"), ("wait_fraction", "{:.3f}"),
            ("steps_per_s", "{:.1f}")]
    table = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="W1,R2D2", help="comma list of " + ",".join(WORKLOADS))
    p.add_argument("--devices", default="cpu,cuda:0",
                   help="comma list; GPU devices are skipped with a message when none is visible")
    p.add_argument("--tls", default="sm", help="UCX_TLS for the store and the learner")
    p.add_argument("--iters", type=int, default=100, help="timed sample() calls")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=300, help="simulated training steps")
    p.add_argument("--step-ms", type=float, default=5.0, help="simulated step time (ms)")
    p.add_argument("--prefetch", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["UCX_TLS"] = args.tls
    devices = []
    for d in args.devices.split(","):
        if d.startswith("cuda"):
            ok, why = gpu_available()
            if not ok:
                log(f"skipping {d}: {why}")
                continue
        devices.append(d)
    rows = []
    for name in args.workloads.split(","):
        rows += run_workload(name, devices, args)
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
