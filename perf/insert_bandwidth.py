"""Bandwidth of the insert path (writer -> storage node), with a same-run ucx_perftest baseline.

For each UCX transport in ``--tls`` (default ``sm,tcp``) a LocalCluster (control plane and
one storage node) runs with that ``UCX_TLS``; this process is the writer. For each item
size in ``--sizes`` it times:

one
    one item per ``writer.insert()`` call, ``--items`` items (at least ``--min-bytes`` worth),
    then ``flush()``: batching happens under the hood.
batched
    ``--batch`` items per ``insert()`` call (default 32), same total.
concurrent
    one item per call, as ``one``, while a learner in another process samples the same
    table flat out (``--sample-batch`` items per ``sample()``, default the workloads'
    batches): the insert rate and the sample rate (GB/s of items returned by
    ``sample()``) of the same seconds. ``--insert-gbps`` paces the writer (default: flat
    out, the two then share the cores as they can).

GB/s is 10^9 bytes of item payload per second, from the first insert to the end of the
final flush (everything acknowledged, so sampleable). The table is FIFO with a capacity
that fits the arena, so long runs evict. The writer's ``paths`` say how the node read the
batches (``mapped (same host)``, ``cma (same host)`` or ``ucx (UCX_TLS=...)``).
``--no-local-map`` makes same-host nodes read writers' memory with process_vm_readv
instead of mapping their staging buffers (``DISTORE_LOCAL_MAP=0``).

Each row also gives the CPU seconds per GB inserted of the writer process, the storage
node and the control plane: on a shared, busy machine the wall-clock rate depends on
what else runs, the CPU cost much less.

perftest
    ``ucx_perftest -t ucp_get -s SIZE -O BATCH`` between two local processes with the same
    UCX settings: what UCX itself reaches reading items of that size, a batch in flight.
cpprb (``--cpprb``, same host)
    cpprb's shared-memory ring (``MPReplayBuffer``, its memory written once first, as the
    arena's slots are) filled by another process for ``--seconds``: one item per ``add``
    (mode one) or ``--batch`` (batched): what a multiprocess shared-memory buffer inserts.
    Its writer adds the same distinct items ours inserts, in the same order (up to 64,
    256 MiB at most: read from memory, not from the cache); ``--cpprb-hot-source`` makes it
    add one array over and over instead (cache-hot: 14-29% faster here), as this
    script did before.

After each run a sample of the table is read back and checked against what was written
(the item's bytes encode its index); a mismatch makes the exit status 1.

Output: JSON lines on stdout, then a short table; progress on stderr. Only 127.0.0.1 is
used. Example (brief run; the lead measures final figures on a quiet machine)::

    cd /tmp && /work/main/.venv/bin/python /work/main/perf/insert_bandwidth.py \\
        --sizes 3K,110K,3M,10M --seconds 2 --json-out /tmp/insert.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

import common
import numpy as np
from common import apply_ucx_env, cpu_seconds, fmt, log, measure_perftest, size_list

MiB = 1 << 20
DEFAULT_SIZES = "3K,110K,3M,10M"


def pattern(index: np.ndarray, size: int) -> np.ndarray:
    """Items whose bytes encode their index: (len(index), size) uint8 (uint8 sums wrap,
    so no temporary larger than the result is made)."""
    base = ((np.arange(size, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(7)).astype(
        np.uint8)
    return base[None, :] + (index.astype(np.uint64) & np.uint64(0xFF)).astype(np.uint8)[:, None]


# A learner in its own process for the concurrent mode: samples flat out between two
# lines on stdin ("go", then EOF) and prints what it sampled as one JSON line.
SAMPLER = textwrap.dedent("""
    import json, sys, time
    import distore_ucx as ds
    client = ds.connect(sys.argv[1])
    learner = client.learner(sys.argv[2], int(sys.argv[3]))
    learner.sample()  # warm: endpoints or mappings made
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.perf_counter() + float(sys.argv[4])
    n = nbytes = 0
    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        batch = learner.sample()
        n += len(batch)
        nbytes += batch.data.nbytes
    dt = time.perf_counter() - t0
    print(json.dumps({"items": n, "bytes": nbytes, "seconds": dt,
                      "paths": sorted(set(learner.paths.values()))}), flush=True)
    learner.close()
    client.close()
""")


def start_sampler(address: str, table: str, batch: int, seconds: float) -> subprocess.Popen:
    """The concurrent mode's learner process, warmed up and waiting for "go"."""
    proc = subprocess.Popen([sys.executable, "-c", SAMPLER, address, table, str(batch),
                             str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd="/tmp")
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"the sampling learner did not start (said {line!r})")
    return proc


def sample_batch_for(size: int) -> int:
    """The concurrent learner's batch for items of `size` bytes, as the
    workloads sample them: W1 32 x 110 KB, W2 8 x 3 MB, W3 4 x 10 MB."""
    return 32 if size < MiB else max(4, (24 * MiB) // size)


def run_mode(ds, client, tls: str, size: int, mode: str, args, pids: dict) -> dict:
    table = f"ins_{tls.replace(',', '_')}_{size}_{mode}"
    # The tables of one size share the arena (a cluster per size): each gets
    # an equal part of half of it (the rest: slots of batches in flight).
    share = int(args.arena * 0.5) // len(args.modes)
    capacity = max(8, share // (size + 64))
    client.create_table(table, capacity, ((size,), np.uint8), sampler=ds.Uniform(),
                        remover=ds.Fifo())
    per_call = args.batch if mode == "batched" else 1
    src = pattern(np.arange(source_count(size, per_call)), size)  # the writer's data
    n_src = len(src)
    # The writer's default (None) unless --batch-bytes: then at least 2 items.
    batch_bytes = None if args.batch_bytes is None else max(args.batch_bytes, 2 * size)
    writer = client.writer(batch_bytes=batch_bytes, max_in_flight=args.in_flight)
    # Warm up: buffers registered, connections and endpoints made, and every
    # slot of the table written once, so that the timed part measures the
    # steady state of a full store (slots reused, arena pages faulted in).
    warm = 0
    while warm < capacity + per_call:
        writer.insert(table, src[:per_call] if per_call > 1 else src[0])
        warm += per_call
    writer.flush()
    sampler = None
    if mode == "concurrent":
        sampler = start_sampler(client.address, table,
                                args.sample_batch or sample_batch_for(size), args.seconds)
        sampler.stdin.write("go\n")
        sampler.stdin.flush()
    n = 0
    st = writer.stats
    batches0, bytes0 = st.batches, st.bytes  # the timed part's batches (warm-up left out)
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    cpu0["writer"] = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + args.seconds
    # --insert-gbps paces the concurrent mode's writer (the target is
    # a rate of inserts while sampling, not two processes racing for 2 cores).
    pace = args.insert_gbps * 1e9 if (args.insert_gbps and sampler is not None) else 0.0
    while time.perf_counter() < deadline or (n * size < args.min_bytes and sampler is None):
        if pace:
            ahead = n * size / pace - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        i = n % n_src
        if per_call == 1:
            writer.insert(table, src[i])
        else:
            j = min(i, n_src - per_call)
            writer.insert(table, src[j : j + per_call])
        n += per_call
    writer.flush()
    elapsed = time.perf_counter() - t0
    cpu = {k: (cpu_seconds(pid) or 0.0) - (cpu0[k] or 0.0) for k, pid in pids.items()}
    cpu["writer"] = time.process_time() - cpu0["writer"]
    sampled = None
    if sampler is not None:
        out, _ = sampler.communicate(timeout=args.seconds + 60)
        sampled = json.loads(out.strip().splitlines()[-1])
    paths = sorted(set(writer.paths.values()))
    batch_bytes = writer.batch_bytes  # the writer's own (8 MiB, or as given)
    # What a batch held on average: a table of items of megabytes gets
    # batches of several items past batch_bytes (client/writer/staging.py).
    batch_mean = (st.bytes - bytes0) / max(1, st.batches - batches0)
    writer.close()
    ok = verify(client, table, src, size)
    gb = n * size / 1e9
    row = {"tls": tls, "item_bytes": size, "mode": mode, "per_call": per_call,
           "items": n, "seconds": elapsed, "gbps": gb / elapsed, "batch_bytes": batch_bytes,
           "batch_mean_bytes": batch_mean,
           "items_per_s": n / elapsed, "via": ",".join(paths), "verified": ok,
           "local_map": args.local_map, "paced_gbps": pace / 1e9 if pace else None,
           **{f"cpu_s_per_gb_{k}": v / gb for k, v in cpu.items()}}
    if sampled is not None:
        row.update(sample_gbps=sampled["bytes"] / sampled["seconds"] / 1e9,
                   sample_items_per_s=sampled["items"] / sampled["seconds"],
                   sample_paths=",".join(sampled["paths"]))
    return row


def verify(client, table: str, src: np.ndarray, size: int) -> bool:
    """Sample a few items and check each is one of the items written, whole."""
    learner = client.learner(table, 8)
    try:
        batch = learner.sample()
        got = np.asarray(batch.data).reshape(len(batch), size)
        first = got[:, 0].astype(np.int64)
        # item i starts with pattern byte (0 + i) & 0xFF: recover i modulo 256, then compare
        cand = src[:256] if len(src) >= 256 else src
        ok = True
        for row, b in zip(got, first):
            idx = np.flatnonzero(cand[:, 0] == b)
            if not any(np.array_equal(row, src[k]) for k in idx):
                log(f"MISMATCH: table {table}: a sampled item matches no written item")
                ok = False
        return ok
    finally:
        learner.close()


def source_count(size: int, per_call: int) -> int:
    """How many distinct items a writer (ours, cpprb's) cycles through: up to
    64, about 256 MiB at most, at least one call's worth. Made before timing."""
    return max(per_call, min(64, (256 * MiB) // size))


def _cpprb_adds(rb, size: int, per_call: int, seconds: float, conn, hot: bool) -> None:
    """The cpprb baseline's writer process: `per_call` items a call for
    `seconds`, the GB/s it reached sent back on `conn`. Its items are those
    our writer inserts, in the same order (`hot`: one array over and over)."""
    if hot:
        src = np.zeros((per_call, size), np.uint8)
        src[:, :8] = 1
    else:
        src = pattern(np.arange(source_count(size, per_call)), size)
    n_src = len(src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        i = n % n_src
        if per_call == 1:
            rb.add(obs=src[i][None])
        else:
            j = min(i, n_src - per_call)
            rb.add(obs=src[j : j + per_call])
        n += per_call
    conn.send(n * size / (time.perf_counter() - t0) / 1e9)


def cpprb_insert_gbps(size: int, per_call: int, seconds: float, ring_bytes: int,
                      hot: bool = False) -> float:
    """GB/s another process inserts into cpprb's shared-memory ring of about
    `ring_bytes`, `per_call` items of `size` bytes an add, its memory
    written once first (pip install cpprb); `hot`: one source array."""
    import multiprocessing as mp

    from cpprb import MPReplayBuffer

    ctx = mp.get_context("fork")  # the ring's shared memory goes with the child
    capacity = max(4 * per_call, ring_bytes // size)
    rb = MPReplayBuffer(capacity, {"obs": {"shape": (size,), "dtype": np.uint8}}, ctx=ctx)
    chunk = np.zeros((max(1, min(capacity, (64 * MiB) // size)), size), np.uint8)
    for _ in range(-(-capacity // len(chunk))):  # every page written once
        rb.add(obs=chunk)
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_cpprb_adds, args=(rb, size, per_call, seconds, send, hot))
    child.start()
    got = recv.recv() if recv.poll(seconds + 60) else None
    child.join(30)
    if got is None or child.exitcode != 0:
        raise RuntimeError(f"the cpprb writer process failed (exit code {child.exitcode})")
    return float(got)


def run_tls(args, tls: str, out) -> list[dict]:
    import distore_ucx as ds

    apply_ucx_env(tls)
    os.environ["DISTORE_LOCAL_MAP"] = "1" if args.local_map else "0"
    rows = []
    env = {"UCX_TLS": tls, "UCX_LOG_LEVEL": "error"}
    for size in args.sizes:
        # A fresh cluster per item size: the tables of one size share its
        # arena (those of every size at once overfill it with 10 MB items).
        with ds.LocalCluster(nodes=1, arena_bytes=args.arena, env=env,
                             log_level="WARNING", prefault=args.prefault) as c:
            client = ds.connect(c.address)
            pids = {"control": c.control.pid, "node": c.nodes[0].pid}
            try:
                pt, why = measure_perftest(tls, size, args.batch, args.batch * 200,
                                           args.batch * 20, args.perftest_timeout)
                if why:
                    log(f"[{tls}] ucx_perftest: {why}")
                for mode in args.modes:
                    log(f"[{tls}] {size} B, {mode}")
                    row = run_mode(ds, client, tls, size, mode, args, pids)
                    row["perftest_gbps"] = pt["gbps"] if pt else None
                    row["ratio_vs_perftest"] = row["gbps"] / pt["gbps"] if pt else None
                    if args.cpprb and mode in ("one", "batched"):
                        rb = cpprb_insert_gbps(size, args.batch if mode == "batched" else 1,
                                               args.seconds, args.arena // 2,
                                               args.cpprb_hot_source)
                        row["cpprb_gbps"], row["vs_cpprb"] = rb, row["gbps"] / rb
                        log(f"[{tls}] cpprb: {rb:.2f} GB/s ({row['vs_cpprb']:.2f}x)")
                    rows.append(row)
                    out.write(row)
            finally:
                client.close()
    return rows


def print_rows(rows: list[dict]) -> None:
    head = ["tls", "item_B", "mode", "items", "GB/s", "items/s", "perf_GB/s", "vs_perf",
            "cpprb_GB/s", "vs_cpprb", "cpu_s/GB w+n+c", "sample_GB/s", "via", "ok"]
    lines = [[r["tls"], str(r["item_bytes"]), r["mode"], str(r["items"]), fmt(r["gbps"], ".3g"),
              fmt(r["items_per_s"], ".3g"), fmt(r["perftest_gbps"], ".3g"),
              fmt(r["ratio_vs_perftest"], ".2f"), fmt(r.get("cpprb_gbps"), ".3g"),
              fmt(r.get("vs_cpprb"), ".2f"),
              "+".join(format(r[f"cpu_s_per_gb_{k}"], ".2f") for k in ("writer", "node",
                                                                       "control")),
              fmt(r.get("sample_gbps"), ".3g"), r["via"], "yes" if r["verified"] else "NO"]
             for r in rows]
    common.print_table(head, lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm,tcp", help="UCX_TLS per pass (default sm,tcp)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="item sizes, K/M suffixes allowed")
    p.add_argument("--modes", default="one,batched",
                   help="comma-separated: one, batched, concurrent (default one,batched)")
    p.add_argument("--batch", type=int, default=32, help="items per call in batched mode")
    p.add_argument("--sample-batch", type=int, default=None,
                   help="items per sample() of the concurrent mode's learner (default: "
                        "the workloads' batches: 32 below 1 MB, else about 24 MiB, at least 4)")
    p.add_argument("--insert-gbps", type=float, default=0.0,
                   help="concurrent mode: pace the writer to this many GB/s (default: flat out)")
    p.add_argument("--no-local-map", dest="local_map", action="store_false",
                   help="same-host nodes read writers with process_vm_readv, not a mapping")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run")
    p.add_argument("--min-bytes", type=int, default=64 * MiB, help="at least this much per run")
    p.add_argument("--arena", type=int, default=1 << 30,
                   help="storage arena bytes (every slot is written once before timing)")
    p.add_argument("--batch-bytes", type=int, default=None,
                   help="writer batch_bytes, at least 2 items (default: the writer's, 8 MiB "
                        "grown to 8 items of up to 32 MiB for large items)")
    p.add_argument("--in-flight", type=int, default=4,
                   help="writer max_in_flight (default 4, the writer's)")
    p.add_argument("--perftest-timeout", type=float, default=120.0)
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="the node takes arena pages as items arrive (default: made at start, "
                   "as `distore node` does)")
    p.add_argument("--cpprb", action="store_true",
                   help="also time cpprb's shared-memory ring filled by another process, "
                        "modes one and batched (pip install cpprb)")
    p.add_argument("--cpprb-hot-source", action="store_true",
                   help="cpprb's writer adds one array over and over (cache-hot) instead of "
                        "the distinct items ours inserts")
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    args.sizes = size_list(args.sizes)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - {"one", "batched", "concurrent"} or not args.modes:
        p.error("--modes: one, batched, concurrent")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with common.JsonLines(args.json_out) as out:
        for tls in [t.strip() for t in args.tls.split(",") if t.strip()]:
            rows += run_tls(args, tls, out)
    print()
    print_rows(rows)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
