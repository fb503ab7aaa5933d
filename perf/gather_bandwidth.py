"""Bandwidth of the one-sided sample path: our batched gather vs numpy vs ucx_perftest.

For each UCX transport in ``--tls`` (default ``sm,tcp``: one pass with ``UCX_TLS=sm``, one
with ``UCX_TLS=tcp`` on the loopback device) and each item size in ``--sizes``, it measures:

ours
    A storage "node" runs in another process (this script in its hidden ``--serve`` mode):
    it creates a ``UcxRuntime``, maps an arena with ``remote_read=True``, fills every slot
    with a known pattern and hands (worker address, packed rkey, base, size) to this process
    over its stdout, then keeps its runtime (and its progress thread, which serves the
    TCP-emulated RMA) alive until its stdin closes. This process (the "learner") makes an
    endpoint and a ``RemoteKey`` and times ``_native.gather`` of a fresh random batch of slots
    per iteration, as sampling does, into one registered destination region. The first and
    the last batch are checked byte for byte; a mismatch makes the exit status 1.
numpy
    The same rows (same size, same random slot indices) gathered locally from an in-process
    array of the same size with ``np.take(arena2d, idx, axis=0, out=out, mode="clip")``: the
    memory-copy ceiling of one core.
perftest
    ``ucx_perftest -t ucp_get -s SIZE -O BATCH`` (from the libucx wheel) between two local
    processes with the same UCX settings, for about the same number of bytes: what UCX itself
    reaches for reads of that size with a batch worth of reads in flight.

GB/s is 10^9 bytes per second: bytes moved / sum of the per-batch times (ours, numpy), or
ucx_perftest's overall bandwidth. The batch holds ~4 MiB (at least 4, at most 256 items)
unless ``--batch`` is given. Latencies are per batch for ours and numpy (ms), and per
operation (the "50.0%ile" column) for ucx_perftest (us).

Output: one JSON line per (tls, size) on stdout, then an aligned table; progress goes to
stderr. Run it from outside the source tree, e.g.::

    cd /tmp && PYTHONPATH=/work/main /work/main/.venv/bin/python \\
        /work/main/perf/gather_bandwidth.py --iters 100 --json-out /tmp/gather.jsonl

``--plot FILE.png`` also draws GB/s against item size if matplotlib is importable.
Only 127.0.0.1 is used: the TCP transport is pinned to the ``lo`` device
(``UCX_NET_DEVICES=lo``) unless UCX_NET_DEVICES is already set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import socket
import subprocess
import sys
import time

import numpy as np

os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"

MiB = 1 << 20
DEFAULT_SIZES = "3072,28224,112896,1048576,3145728,10485760"
BATCH_BYTES = 4 * MiB
MIN_BATCH, MAX_BATCH = 4, 256
LARGE_ITEM = MiB  # items this big get a smaller arena...
LARGE_ARENA_MIN = 256 * MiB  # ...but still well beyond the last-level cache
LARGE_ARENA_SLOTS = 64
GATHER_TIMEOUT_S = 30.0
SERVE_READY_TIMEOUT_S = 120.0
HEADER = 8  # each slot starts with its index as a little-endian uint64


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- config


def ucx_env(tls: str) -> dict[str, str]:
    """UCX settings (without the UCX_ prefix) shared by every process of one pass."""
    cfg = {"TLS": tls}
    if "tcp" in tls.split(",") and "UCX_NET_DEVICES" not in os.environ:
        cfg["NET_DEVICES"] = "lo"  # keep TCP on 127.0.0.1
    return cfg


def apply_ucx_env(tls: str) -> dict[str, str]:
    """Set this process's UCX environment for `tls` (before any UCX object exists)."""
    cfg = ucx_env(tls)
    for k, v in cfg.items():
        os.environ["UCX_" + k] = v
    if "NET_DEVICES" not in cfg and "UCX_NET_DEVICES" not in os.environ:
        os.environ.pop("UCX_NET_DEVICES", None)
    os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return cfg


def batch_for(size: int, override: int | None) -> int:
    if override:
        return override
    return max(MIN_BATCH, min(MAX_BATCH, round(BATCH_BYTES / size)))


def arena_slots(arena: int, size: int, batch: int) -> int:
    """Slots in the arena: `arena` bytes, fewer for large items, never fewer than a batch."""
    slots = arena // size
    if size >= LARGE_ITEM:
        slots = min(slots, max(LARGE_ARENA_SLOTS, math.ceil(LARGE_ARENA_MIN / size)))
    return max(slots, batch, 2)


# --------------------------------------------------------------------------- pattern

_BASE_ROWS: dict[int, np.ndarray] = {}


def base_row(size: int) -> np.ndarray:
    row = _BASE_ROWS.get(size)
    if row is None:
        row = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        _BASE_ROWS[size] = row
    return row


def fill_pattern(rows: np.ndarray, slots: np.ndarray) -> None:
    """rows[i] = the content of slot slots[i]: a per-size random row plus slot % 251 (mod
    256), with the slot index as a uint64 in the first bytes. Deterministic in (slot, size)."""
    rows[:] = base_row(rows.shape[1])
    rows += (slots % 251).astype(np.uint8)[:, None]
    h = min(HEADER, rows.shape[1])
    stamp = slots.astype("<u8").view(np.uint8).reshape(len(slots), 8)
    rows[:, :h] = stamp[:, :h]


def fill_arena(arena2d: np.ndarray, chunk_bytes: int = 64 * MiB) -> None:
    n, size = arena2d.shape
    step = max(1, chunk_bytes // size)
    for start in range(0, n, step):
        stop = min(n, start + step)
        fill_pattern(arena2d[start:stop], np.arange(start, stop, dtype=np.uint64))


def check_rows(got: np.ndarray, idx: np.ndarray, what: str) -> bool:
    want = np.empty_like(got)
    fill_pattern(want, idx.astype(np.uint64))
    if np.array_equal(got, want):
        return True
    bad = np.nonzero((got != want).any(axis=1))[0]
    log(f"MISMATCH in {what}: {len(bad)} of {len(idx)} rows differ "
        f"(first: row {bad[0]}, slot {idx[bad[0]]})")
    return False


# --------------------------------------------------------------------------- storage node


def serve(args: argparse.Namespace) -> int:
    """Hidden --serve mode: the storage node. Env first, then UCX."""
    apply_ucx_env(args.tls)
    from distore_ucx.transport.runtime import UcxRuntime

    size, slots = args.item_bytes, args.slots
    rt = UcxRuntime(progress_thread=True, config=ucx_env(args.tls))
    try:
        region = rt.map_region(size * slots, remote_read=True)
        fill_arena(region.view()[: size * slots].reshape(slots, size))
        hello = {
            "worker_address": rt.address.hex(),
            "rkey": bytes(region.pack_rkey()).hex(),
            "base": int(region.address),
            "size": int(region.size),
            "slots": slots,
            "pid": os.getpid(),
        }
        sys.stdout.write(json.dumps(hello) + "\n")
        sys.stdout.flush()
        for _ in sys.stdin:  # wait for EOF (or the parent's death)
            pass
        del region
    finally:
        rt.close()
    return 0


def start_node(tls: str, size: int, slots: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--tls", tls,
           "--item-bytes", str(size), "--slots", str(slots)]
    env = dict(os.environ)
    env.update({"UCX_" + k: v for k, v in ucx_env(tls).items()})
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def read_hello(proc: subprocess.Popen, timeout: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"storage node did not start within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"storage node exited early (status {proc.wait(10)})")
    return json.loads(line)


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    if proc is None:
        return
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- measurements


def summarize(lat_s: np.ndarray, nbytes: int) -> dict:
    return {
        "gbps": nbytes / float(lat_s.sum()) / 1e9,
        "p50_ms": float(np.percentile(lat_s, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat_s, 99)) * 1e3,
    }


def measure_numpy(arena2d: np.ndarray, batches: list[np.ndarray], warmup: int) -> tuple:
    size = arena2d.shape[1]
    out = np.empty((len(batches[0]), size), np.uint8)
    ok = True
    lat = np.empty(len(batches) - warmup)
    for i, idx in enumerate(batches):
        t0 = time.perf_counter()
        # mode="clip": with the default mode="raise" numpy always buffers `out` (a temporary
        # of the batch's size, then a second copy), which halves the baseline. The indices
        # are in range, so the result is the same.
        np.take(arena2d, idx, axis=0, out=out, mode="clip")
        dt = time.perf_counter() - t0
        if i >= warmup:
            lat[i - warmup] = dt
        if i in (0, warmup, len(batches) - 1):
            ok &= check_rows(out, idx, f"numpy batch {i}")
    return summarize(lat, lat.size * out.nbytes), ok


def measure_ours(tls: str, hello: dict, size: int, batches: list[np.ndarray],
                 warmup: int) -> tuple:
    from distore_ucx._native_loader import _native
    from distore_ucx.transport.runtime import UcxRuntime

    batch = len(batches[0])
    rt = UcxRuntime(progress_thread=True, config=ucx_env(tls))
    key = dest = view = None
    try:
        ep = rt.endpoint(bytes.fromhex(hello["worker_address"]), "bench-node")
        key = _native.RemoteKey(ep, bytes.fromhex(hello["rkey"]), hello["base"],
                                hello["size"], "bench-node")
        dest = rt.map_region(batch * size)
        view = dest.view()[: batch * size].reshape(batch, size)
        key_index = np.zeros(batch, np.uint32)
        length = np.full(batch, size, np.uint64)
        dest_offset = np.arange(batch, dtype=np.uint64) * np.uint64(size)
        base, usize = np.uint64(hello["base"]), np.uint64(size)
        addrs = [base + idx.astype(np.uint64) * usize for idx in batches]
        lat = np.empty(len(batches) - warmup)
        ok = True
        for i, addr in enumerate(addrs):
            t0 = time.perf_counter()
            st = _native.gather(rt.worker, [key], key_index, addr, length, dest, dest_offset,
                                GATHER_TIMEOUT_S)
            dt = time.perf_counter() - t0
            if i >= warmup:
                lat[i - warmup] = dt
            if st.any():
                raise RuntimeError(f"gather batch {i}: statuses "
                                   f"{sorted(set(st.tolist()) - {0})} (0 is ok)")
            if i in (0, warmup, len(batches) - 1):
                ok &= check_rows(view, batches[i], f"gather batch {i}")
        return summarize(lat, lat.size * batch * size), ok
    finally:
        del key, view, dest  # keys and regions before the endpoints and worker
        rt.close()


def perftest_path() -> tuple[str, str]:
    import libucx

    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "bin", "ucx_perftest"), os.path.join(root, "lib")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_listening(port: int) -> bool:
    """Whether something listens on `port`, read from /proc (no connection made)."""
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[1].endswith(want) and fields[3] == "0A":  # 0A: LISTEN
                        return True
        except OSError:
            continue
    return False


def measure_perftest(tls: str, size: int, batch: int, iters: int, warmup: int,
                     timeout: float) -> tuple[dict | None, str | None]:
    """ucx_perftest ucp_get with `batch` reads outstanding, iters*batch reads in all."""
    try:
        exe, lib = perftest_path()
    except ImportError as exc:
        return None, f"libucx not importable: {exc}"
    if not os.access(exe, os.X_OK):
        return None, f"{exe} not found"
    env = dict(os.environ)  # includes what ucxx put there at import (UCX_RNDV_THRESH, ...)
    env.update({"UCX_" + k: v for k, v in ucx_env(tls).items()})
    env["LD_LIBRARY_PATH"] = lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    port = free_port()
    common = ["-p", str(port)]
    client = [exe, "127.0.0.1", *common, "-t", "ucp_get", "-s", str(size),
              "-n", str(iters * batch), "-w", str(warmup * batch), "-O", str(batch)]
    server = None
    try:
        server = subprocess.Popen([exe, *common], env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while not port_listening(port):
            if server.poll() is not None:
                return None, f"ucx_perftest server exited ({server.returncode}): " + \
                    server.stderr.read().strip()[-300:]
            if time.monotonic() > deadline:
                return None, "ucx_perftest server did not listen within 10 s"
            time.sleep(0.02)
        try:
            out = subprocess.run(client, env=env, capture_output=True, text=True,
                                 timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return None, f"ucx_perftest client timed out after {timeout:.0f} s"
        final = [ln for ln in out.stdout.splitlines() if ln.startswith("Final:")]
        if out.returncode != 0 or not final:
            tail = (out.stderr or out.stdout).strip()[-300:]
            return None, f"ucx_perftest client failed ({out.returncode}): {tail}"
        cols = final[-1].split()[1:]
        # iterations, latency 50%/avg/overall (us), bandwidth avg/overall, msgrate avg/overall.
        # ucx_perftest's "MB/s" is MiB/s: bandwidth / (1024.0 * 1024.0) in its printer.
        mib_s = float(cols[5])
        return {"gbps": mib_s * MiB / 1e9, "p50_us": float(cols[1])}, None
    finally:
        if server is not None:
            if server.poll() is None:
                server.terminate()
                try:
                    server.wait(5)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            if server.stderr is not None:
                server.stderr.close()


def run_one(args, tls: str, size: int) -> tuple[dict, bool]:
    apply_ucx_env(tls)
    batch = batch_for(size, args.batch)
    slots = arena_slots(args.arena, size, batch)
    rng = np.random.default_rng(args.seed)
    batches = [rng.integers(0, slots, batch) for _ in range(args.warmup + args.iters)]
    log(f"[{tls}] item {size} B, batch {batch}, arena {slots} slots "
        f"({slots * size / MiB:.0f} MiB)")
    node = None
    try:
        node = start_node(tls, size, slots)
        arena2d = np.empty((slots, size), np.uint8)  # filled while the node fills its own
        fill_arena(arena2d)
        hello = read_hello(node, SERVE_READY_TIMEOUT_S)
        numpy_res, ok_np = measure_numpy(arena2d, batches, args.warmup)
        del arena2d
        ours, ok_ours = measure_ours(tls, hello, size, batches, args.warmup)
    finally:
        stop_process(node)
    pt, why = measure_perftest(tls, size, batch, args.iters, args.warmup, args.perftest_timeout)
    if why:
        log(f"[{tls}] ucx_perftest: {why}")
    row = {
        "tls": tls,
        "item_bytes": size,
        "batch": batch,
        "ours_gbps": ours["gbps"],
        "ours_p50_ms": ours["p50_ms"],
        "ours_p99_ms": ours["p99_ms"],
        "numpy_gbps": numpy_res["gbps"],
        "numpy_p50_ms": numpy_res["p50_ms"],
        "numpy_p99_ms": numpy_res["p99_ms"],
        "perftest_gbps": pt["gbps"] if pt else None,
        "perftest_p50_us": pt["p50_us"] if pt else None,
        "ratio_vs_numpy": ours["gbps"] / numpy_res["gbps"],
        "ratio_vs_perftest": ours["gbps"] / pt["gbps"] if pt else None,
        "verified": bool(ok_np and ok_ours),
    }
    if why:
        row["perftest_error"] = why
    return row, row["verified"]


# --------------------------------------------------------------------------- output


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = ["tls", "item_B", "batch", "ours_GB/s", "p50_ms", "p99_ms", "numpy_GB/s", "p50_ms",
            "p99_ms", "perf_GB/s", "p50_us", "vs_np", "vs_perf", "ok"]
    lines = [head]
    for r in rows:
        lines.append([
            r["tls"], str(r["item_bytes"]), str(r["batch"]),
            fmt(r["ours_gbps"], ".2f"), fmt(r["ours_p50_ms"], ".3f"),
            fmt(r["ours_p99_ms"], ".3f"), fmt(r["numpy_gbps"], ".2f"),
            fmt(r["numpy_p50_ms"], ".3f"), fmt(r["numpy_p99_ms"], ".3f"),
            fmt(r["perftest_gbps"], ".2f"), fmt(r["perftest_p50_us"], ".2f"),
            fmt(r["ratio_vs_numpy"], ".2f"), fmt(r["ratio_vs_perftest"], ".2f"),
            "yes" if r["verified"] else "NO",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not importable; not writing {path}")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for tls in dict.fromkeys(r["tls"] for r in rows):
        sel = [r for r in rows if r["tls"] == tls]
        x = [r["item_bytes"] for r in sel]
        for key, label, style in (("ours_gbps", "gather", "o-"), ("numpy_gbps", "numpy", "s--"),
                                  ("perftest_gbps", "ucx_perftest", "^:")):
            pts = [(xi, r[key]) for xi, r in zip(x, sel, strict=True) if r[key] is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, label=f"{label} ({tls})")
    ax.set_xscale("log")
    ax.set_xlabel("item size (bytes)")
    ax.set_ylabel("GB/s (10^9 B/s)")
    ax.set_title("batched gather bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="sm,tcp",
                   help="transports, one pass each (UCX_TLS value per pass; default sm,tcp)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="item sizes in bytes, comma separated")
    p.add_argument("--batch", type=int, default=None,
                   help="items per batch (default: ~4 MiB worth, 4..256)")
    p.add_argument("--arena", type=int, default=1 << 30,
                   help="storage arena bytes (default 1 GiB; less for items >= 1 MiB)")
    p.add_argument("--iters", type=int, default=200, help="timed batches (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed batches first (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perftest-timeout", type=float, default=180.0)
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="write a PNG of GB/s vs item size (needs matplotlib)")
    # hidden: the storage node's mode
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--item-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or (args.batch is not None and args.batch < 1):
        p.error("--iters and --batch must be positive, --warmup non-negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    tls_list = [t.strip() for t in args.tls.split(",") if t.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    rows: list[dict] = []
    all_ok = True
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(args.json_out, "w")) if args.json_out else None
        for tls in tls_list:
            for size in sizes:
                row, ok = run_one(args, tls, size)
                all_ok &= ok
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                    out.flush()
    print()
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    if not all_ok:
        log("data mismatch: see MISMATCH lines above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
