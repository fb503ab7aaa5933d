"""Insert batches by UCX active message through distore's native calls
(am_send, AmInbox, pull_am into an Arena), per kind of writer endpoint, next
to ``ucx_perftest -t ucp_am_bw -E sleep`` of the same size in the same run
(-E sleep: it sleeps when idle, as these processes do; the busy-polling
one swings by 10x on a shared machine).

    python perf/am_insert_native.py [--sizes 110K,3M,10M] [--repeats 3]

Over UCX_TLS=tcp on 127.0.0.1, put_zcopy rendezvous. This process is the
writer; a subprocess is the receiver (the node's guarded runtime, an
Arena, an AmInbox on the reader worker, pull_am on one thread), which
acknowledges each batch; two batches are in flight. Endpoint kinds:

- listener: AmInbox.listen + Endpoint.to_listener, peer-failure handling
  (the safe path, native/am_connections.h);
- listener-runs: the same, items sent several to a message (runs of up to
  AmInbox.run_bytes, received through the node's bounce chunks: what
  writers do for items that fit several to a megabyte);
- address: the node's worker address, no peer-failure handling (the path
  DISTORE_AM_INSERTS=1 took before listeners);
- address-peer: the worker address with peer-failure handling (UCX then
  copies through bounce buffers).

No control plane, no descriptor, no registration: the native data path
only. Prints JSON lines and a table (GB/s, median of the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

import numpy as np
from common import apply_ucx_env, measure_perftest, size_list

BATCH = {110 << 10: 32, 3 << 20: 8, 10 << 20: 4}  # items per batch, as the workloads sample
DEPTH = 2  # batches in flight


def receiver(item_bytes: int, items: int, listen: bool) -> None:
    """The receiving side: commands 'pull TOKEN' on stdin, 'ok'/'bad' out."""
    from distore_ucx._native_loader import _native
    from distore_ucx.config import runtime_config, ucx_tls
    from distore_ucx.protocol import AM_INSERT_ID
    from distore_ucx.spec import SLOT_HEADER
    from distore_ucx.storage.arena import Arena
    from distore_ucx.storage.guard import guard_remote_access
    from distore_ucx.transport.runtime import UcxRuntime

    guarded = guard_remote_access()
    runtime = UcxRuntime(config={**runtime_config(), **guarded}, env_tls=ucx_tls())
    slot = SLOT_HEADER + item_bytes
    arena = Arena(runtime, (DEPTH + 1) * items * slot, hugepages=False)
    inbox = _native.AmInbox(runtime.reader_worker, AM_INSERT_ID)
    port = inbox.listen("127.0.0.1", 0) if listen else 0
    print(json.dumps({"port": port, "address": bytes(runtime.reader_worker.address).hex()}),
          flush=True)
    keys = np.arange(1, items + 1, dtype=np.uint64)
    lengths = np.full(items, item_bytes, np.uint64)
    for line in sys.stdin:
        token = int(line.split()[1])
        offsets = arena.allocate("t", slot, items)
        st = arena.pull_am(inbox, token, offsets, keys, arena.next_generations(items), lengths,
                           30.0)
        arena.free("t", offsets)
        cpu = time.process_time()
        print(f"ok {cpu}" if not st.any() else f"bad {st.tolist()}", flush=True)
    inbox.close()
    runtime.close()


def run(kind: str, item_bytes: int, items: int, seconds: float) -> tuple[float, float]:
    """GB/s of batches of `items` x `item_bytes` over a `kind` endpoint, and
    the CPU seconds per GB both sides spent (less sensitive to a busy
    machine than GB/s)."""
    from distore_ucx._native_loader import _native
    from distore_ucx.config import runtime_config, ucx_tls
    from distore_ucx.protocol import AM_INSERT_ID
    from distore_ucx.transport.runtime import UcxRuntime

    proc = subprocess.Popen([sys.executable, __file__, "--receiver", str(item_bytes), str(items),
                             "1" if kind.startswith("listener") else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.environ.get("TMPDIR", "/tmp"))
    hello = json.loads(proc.stdout.readline())
    runtime = UcxRuntime(config=runtime_config(), env_tls=ucx_tls())
    try:
        run_bytes = _native.AmInbox.run_bytes if kind == "listener-runs" else 0
        if kind.startswith("listener"):
            ep = _native.Endpoint.to_listener(runtime.worker, "127.0.0.1", hello["port"], "rx")
        else:
            ep = _native.Endpoint(runtime.worker, bytes.fromhex(hello["address"]),
                                  kind == "address-peer", "rx")
        region = _native.MemoryRegion.write_protected(runtime.region_owner,
                                                      DEPTH * items * item_bytes)
        view = region.view()
        view[:] = np.frombuffer(os.urandom(1 << 16), np.uint8).repeat(len(view) >> 16 or 1)[
            : len(view)]
        lengths = np.full(items, item_bytes, np.uint64)
        sent = n = 0
        t0 = None
        start = time.perf_counter()
        while True:
            while sent - n < DEPTH:
                b = sent % DEPTH
                offsets = (np.arange(items, dtype=np.uint64) + np.uint64(b * items)) * np.uint64(
                    item_bytes)
                token = secrets.randbits(62) | 1
                _native.am_send(ep, region, AM_INSERT_ID, token, offsets, lengths, run_bytes)
                proc.stdin.write(f"pull {token}\n")
                proc.stdin.flush()
                sent += 1
            reply = proc.stdout.readline().split()
            if not reply or reply[0] != "ok":
                raise RuntimeError(f"{kind}: a batch failed: {reply}")
            n += 1
            if n == DEPTH * 2:  # warmed up
                t0, n0, cpu0 = time.perf_counter(), n, time.process_time() + float(reply[1])
            if t0 is not None and time.perf_counter() - t0 > seconds:
                break
            if time.perf_counter() - start > 20 * seconds:
                raise RuntimeError(f"{kind}: too slow")
        gb = (n - n0) * items * item_bytes / 1e9
        gbps = gb / (time.perf_counter() - t0)
        cpu_per_gb = (time.process_time() + float(reply[1]) - cpu0) / gb
        for _ in range(sent - n):
            proc.stdout.readline()
        ep.close(force=False, timeout=1.0)
        return gbps, cpu_per_gb
    finally:
        proc.stdin.close()
        proc.wait(30)
        runtime.close()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        receiver(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=size_list, default=[110 << 10, 3 << 20, 10 << 20])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    args = p.parse_args()
    apply_ucx_env("tcp")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    kinds = ["listener", "listener-runs", "address", "address-peer"]
    rows = []
    for size in args.sizes:
        items = BATCH.get(size, max(1, (8 << 20) // size))
        runs: dict[str, list[float]] = {k: [] for k in kinds + ["ucp_am_bw"]}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.repeats):  # interleaved: a busy machine slows all alike
            for kind in kinds:
                gbps, cpu_gb = run(kind, size, items, args.seconds)
                runs[kind].append(gbps)
                cpu[kind].append(cpu_gb)
            ops = max(20 * items, int(args.seconds * 1e9 / size))
            pt, why = measure_perftest("tcp", size, items, ops, max(items, ops // 10), 300,
                                       test="ucp_am_bw", extra_env={"RNDV_SCHEME": "put_zcopy"},
                                       extra_args=["-E", "sleep"])
            runs["ucp_am_bw"].append(pt["gbps"] if pt else float("nan"))
            if why:
                print(f"ucx_perftest: {why}", file=sys.stderr)
        row = {"item_bytes": size, "batch": items,
               **{k: round(statistics.median(v), 3) for k, v in runs.items()},
               **{f"{k} cpu_s/GB": round(statistics.median(v), 2) for k, v in cpu.items()},
               "runs": runs, "cpu": cpu}
        print(json.dumps(row), flush=True)
        rows.append(row)
    cols = kinds + ["ucp_am_bw"]
    print(f"\nGB/s, median of {args.repeats}; UCX_TLS=tcp, put_zcopy, {DEPTH} batches in flight")
    print(f"{'item':>10} {'batch':>6}" + "".join(f"{c:>14}" for c in cols) + f"{'listener/bw':>13}")
    for r in rows:
        print(f"{r['item_bytes']:>10} {r['batch']:>6}" + "".join(f"{r[c]:>14.2f}" for c in cols)
              + f"{r['listener'] / r['ucp_am_bw']:>13.2f}")
    print("\nCPU s/GB, writer + receiver (median)")
    for r in rows:
        print(f"{r['item_bytes']:>10} {r['batch']:>6}"
              + "".join(f"{r[c + ' cpu_s/GB']:>14.2f}" for c in kinds))


if __name__ == "__main__":
    main()
