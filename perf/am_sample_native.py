"""Sample batches by active message, native layer alone, next to what UCX moves.

Two processes on 127.0.0.1 over ``UCX_TLS=tcp`` (what a learner on another
host sees), both with ``UCX_RNDV_SCHEME=put_zcopy``: a storage node's side
(an arena of patterned slots, an AmSampleServer on its worker's progress
thread, the remote-access guards a node installs) and a learner's, reading
dense batches into one registered ring slot in a loop for ``--seconds``
(perf/am_sample_peer.py). For each item size of ``--sizes`` (default 110 KB,
3 MB, 10 MB with batches of 32, 8, 4 items, as the workloads W1-W3):

am
    ``AmSampleClient.fetch``: one request to the node, each item sent by the
    node as a rendezvous active message straight into its dense array; the
    learner's endpoint without peer-failure handling.
am_eh
    the same over an endpoint with peer-failure handling (``--error-handling``):
    UCX 1.21 then sends eagerly, through bounce buffers.
get
    today's path for a node a learner does not map: ``gather_dense``, one get
    per slot into a staging buffer, then copied into place.

Baselines in the same run (``--perftest-repeats`` runs before the store's and as
many after, the best kept: on a shared machine busy-polling pairs lose most to
other load), same message size, ``batch`` messages outstanding (``--perftest-window``
sets it, e.g. to ``--max-in-flight``, what the node keeps in flight of a batch):
``ucx_perftest -t ucp_am_bw`` with put_zcopy (``am_bw``) and the same with
``-E sleep`` (``am_sleep``: both sides sleep when idle, as the store's
processes do). ``vs_am`` and ``vs_am_sl`` are the path's GB/s (10^9 bytes of
item payload per second, the median batch) over each. ``cpu_s/GB``: CPU
seconds per GB moved of the learner and of the node (all its threads), the
steadier figure on a shared machine. The first and last batch of every run
are checked byte for byte, every field C-contiguous.

Output: JSON lines on stdout (``--json-out`` too), then a short table;
progress on stderr. Quick run (a few minutes on 2 cores)::

    cd /tmp && nice <venv>/bin/python <repo>/perf/am_sample_native.py --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common
from common import JsonLines, fmt, log, measure_perftest, size_list

MiB = 1 << 20
TLS = "tcp"
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "am_sample_peer.py")
DEFAULT_SIZES = "112896,3M,10M"  # the workloads' W1, W2, W3


def batch_for(size: int) -> int:
    """Items per batch, as the workloads sample them: 32 x 110 KB, 8 x 3 MB, 4 x 10 MB."""
    return 32 if size < MiB else max(4, (24 * MiB) // size)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"UCX_" + k: v for k, v in common.ucx_env(TLS).items()})
    env.setdefault("UCX_LOG_LEVEL", "error")
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return env


def perftest(args, size: int, batch: int) -> dict[str, list]:
    """ucp_am_bw GB/s (put_zcopy), busy-polling and with -E sleep."""
    ops = max(20 * batch, args.perftest_bytes // size)
    out = {}
    for name, extra in (("am_bw", []), ("am_sleep", ["-E", "sleep"])):
        runs = []
        for _ in range(args.perftest_repeats):
            pt, why = measure_perftest(TLS, size, args.perftest_window or batch, ops,
                                       max(batch, ops // 10),
                                       args.perftest_timeout, test="ucp_am_bw",
                                       extra_env={"RNDV_SCHEME": "put_zcopy"},
                                       extra_args=extra)
            if why:
                log(f"[{size} B] ucx_perftest ucp_am_bw {' '.join(extra)}: {why}")
            runs.append(pt["gbps"] if pt else None)
        out[name] = runs
        log(f"[{size} B] ucx_perftest ucp_am_bw {' '.join(extra)}: "
            + ", ".join(fmt(r, ".2f") for r in runs) + " GB/s")
    return out


def node_stats(node: subprocess.Popen) -> dict:
    node.stdin.write("stats\n")
    node.stdin.flush()
    return json.loads(node.stdout.readline())


def measure_paths(args, size: int, batch: int) -> list[dict]:
    """Run a node, then a learner per path against it."""
    env = child_env()
    slot = size + 64
    slots = max(2 * batch, min(256, args.arena_bytes // slot))
    node = subprocess.Popen(
        [sys.executable, PEER, "node", "--item-bytes", str(size), "--slots", str(slots),
         "--max-in-flight", str(args.max_in_flight), "--fields", str(args.fields)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    rows = []
    try:
        hello = node.stdout.readline()
        if not hello:
            raise RuntimeError(f"the node for {size} B items did not start")
        for path in args.paths.split(","):
            cpu0 = node_stats(node)["cpu_s"]
            extra = ["--path", "get"] if path == "get" else ["--path", "am"]
            if path == "am_eh":
                extra.append("--error-handling")
            log(f"[{size} B] {path}: {args.seconds:g} s of batches of {batch}")
            r = subprocess.run(
                [sys.executable, PEER, "learner", hello, "--item-bytes", str(size),
                 "--batch", str(batch), "--seconds", str(args.seconds),
                 "--rndv-min", str(args.rndv_min), "--fields", str(args.fields), *extra],
                capture_output=True, text=True, env=env, timeout=args.seconds * 4 + 120)
            if r.returncode != 0 or not r.stdout.strip():
                log(f"[{size} B] {path} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
                continue
            row = json.loads(r.stdout.strip().splitlines()[-1])
            row["path"] = path
            # CPU seconds per GB moved, of the learner and of the node (every
            # thread): what each path costs on a machine others share.
            gb = row["bytes"] / 1e9
            row["cpu_s_per_gb_learner"] = row["cpu_s"] / gb
            row["cpu_s_per_gb_node"] = (node_stats(node)["cpu_s"] - cpu0) / gb
            rows.append(row)
        log(f"[{size} B] node: {node_stats(node)}")
        node.stdin.write("exit\n")
        node.stdin.flush()
        node.wait(30)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    return rows


def run_size(args, size: int, out: JsonLines) -> list[dict]:
    batch = batch_for(size)
    before = perftest(args, size, batch)
    found = measure_paths(args, size, batch)
    after = perftest(args, size, batch)
    base = {k: max((v for v in before[k] + after[k] if v is not None), default=None)
            for k in before}
    rows = []
    for r in found:
        row = {"tls": TLS, "item_bytes": size, "batch": batch, **r,
               "am_bw_gbps": base["am_bw"], "am_sleep_gbps": base["am_sleep"],
               **{f"{k}_runs_gbps": before[k] + after[k] for k in before},
               "vs_am_bw": r["gbps"] / base["am_bw"] if base["am_bw"] else None,
               "vs_am_sleep": r["gbps"] / base["am_sleep"] if base["am_sleep"] else None}
        out.write(row)
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    head = ["item_B", "batch", "path", "GB/s", "p50_ms", "p99_ms", "am_bw", "vs_am",
            "am_sleep", "vs_am_sl", "cpu_s/GB l+n", "ok"]
    common.print_table(head, [
        [str(r["item_bytes"]), str(r["batch"]), r["path"], fmt(r["gbps"], ".3g"),
         fmt(r["p50_ms"], ".2f"), fmt(r["p99_ms"], ".2f"), fmt(r["am_bw_gbps"], ".3g"),
         fmt(r["vs_am_bw"], ".2f"), fmt(r["am_sleep_gbps"], ".3g"),
         fmt(r["vs_am_sleep"], ".2f"),
         f"{r['cpu_s_per_gb_learner']:.2f}+{r['cpu_s_per_gb_node']:.2f}",
         "yes" if r["bad"] == 0 else f"NO ({r['bad']})"]
        for r in rows])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="item sizes, K/M suffixes allowed (default 110 KB, 3 MB, 10 MB)")
    p.add_argument("--paths", default="am,get",
                   help="comma-separated, of am, am_eh (peer-failure handling), get")
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per path")
    p.add_argument("--arena-bytes", type=int, default=256 * MiB,
                   help="the node's arena holds about this much (at least 2 batches)")
    p.add_argument("--max-in-flight", type=int, default=16,
                   help="the node's messages in flight per batch")
    p.add_argument("--rndv-min", type=int, default=8192,
                   help="fields of this many bytes and more go by rendezvous")
    p.add_argument("--fields", type=int, choices=(1, 3), default=1,
                   help="fields per item: 1, or 3 (the item and two small fields, as W1-like "
                        "tables have: a reward, a step)")
    p.add_argument("--perftest-repeats", type=int, default=1,
                   help="ucx_perftest runs before, and as many after, the store's (best kept)")
    p.add_argument("--perftest-window", type=int, default=0,
                   help="messages ucx_perftest keeps outstanding (default: the batch; the "
                        "node keeps at most --max-in-flight of a batch in flight)")
    p.add_argument("--perftest-bytes", type=int, default=1 << 30,
                   help="about this many bytes per ucx_perftest run")
    p.add_argument("--perftest-timeout", type=float, default=120.0)
    p.add_argument("--json-out", default=None, help="also write the JSON lines here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.apply_ucx_env(TLS)
    rows = []
    t0 = time.monotonic()
    with JsonLines(args.json_out) as out:
        for size in size_list(args.sizes):
            rows += run_size(args, size, out)
    print_rows(rows)
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0 if rows and all(r["bad"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
