"""Shared pieces of the perf scripts: UCX settings, a storage "node" process
with a patterned arena, our timed gather, a numpy gather, ucx_perftest,
process CPU time, and output (JSON lines, aligned tables, optional plots).

Not a script of its own except for its hidden node mode, which the scripts
start as a child process::

    python perf/common.py --serve --tls sm --item-bytes 4096 --slots 1024

The node maps an arena with ``remote_read=True``, fills every slot with a
known pattern (see ``fill_pattern``), writes one JSON line (worker address,
packed rkey, base, size) to stdout and keeps its UCX runtime, and the progress
thread that serves TCP-emulated RMA, alive until its stdin closes.

Only 127.0.0.1 is used: the TCP transport is pinned to the ``lo`` device
unless UCX_NET_DEVICES is already set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time

import numpy as np

os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"

MiB = 1 << 20
GATHER_TIMEOUT_S = 60.0
SERVE_READY_TIMEOUT_S = 120.0
HEADER = 8  # each slot starts with its index as a little-endian uint64


def log(msg: str) -> None:
    """Progress and diagnostics go to stderr; stdout carries only results."""
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- UCX settings


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


# --------------------------------------------------------------------------- pattern

_BASE_ROWS: dict[int, np.ndarray] = {}


def base_row(size: int) -> np.ndarray:
    """A random row of `size` bytes, the same for every process (seeded by size)."""
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
    """Fill every slot of an (n, size) arena with its pattern, a chunk at a time."""
    n, size = arena2d.shape
    step = max(1, chunk_bytes // size)
    for start in range(0, n, step):
        stop = min(n, start + step)
        fill_pattern(arena2d[start:stop], np.arange(start, stop, dtype=np.uint64))


def check_rows(got: np.ndarray, idx: np.ndarray, what: str) -> bool:
    """Whether `got` holds the pattern of slots `idx`; logs the first mismatch."""
    want = np.empty_like(got)
    fill_pattern(want, idx.astype(np.uint64))
    if np.array_equal(got, want):
        return True
    bad = np.nonzero((got != want).any(axis=1))[0]
    log(f"MISMATCH in {what}: {len(bad)} of {len(idx)} rows differ "
        f"(first: row {bad[0]}, slot {idx[bad[0]]})")
    return False


# --------------------------------------------------------------------------- storage node


def serve(tls: str, size: int, slots: int) -> int:
    """The node mode: map and fill an arena, say hello on stdout, serve until stdin closes."""
    apply_ucx_env(tls)
    from distore_ucx._native_loader import _native
    from distore_ucx.transport.local_map import LocalMapServer
    from distore_ucx.transport.runtime import UcxRuntime

    rt = UcxRuntime(progress_thread=True, config=ucx_env(tls))
    share = None
    try:
        # As storage nodes make arenas by default: a sealed memfd, registered
        # read-only for UCX, and offered to same-host readers to map.
        region = _native.MemoryRegion.write_protected(rt.region_owner, size * slots, True)
        fill_arena(region.view()[: size * slots].reshape(slots, size))
        if region.share_fd >= 0:
            share = LocalMapServer(region.share_fd, region.size, 1, region.page_kind, None,
                                   "bench-node").start()
        hello = {
            "worker_address": rt.address.hex(),
            "rkey": bytes(region.pack_rkey()).hex(),
            "base": int(region.address),
            "size": int(region.size),
            "slots": slots,
            "pid": os.getpid(),
            "page_kind": region.page_kind,
            "local_socket": share.name if share else None,
        }
        sys.stdout.write(json.dumps(hello) + "\n")
        sys.stdout.flush()
        for _ in sys.stdin:  # wait for EOF (or the parent's death)
            pass
        if share is not None:
            share.close()
        del region
    finally:
        rt.close()
    return 0


def start_node(tls: str, size: int, slots: int) -> subprocess.Popen:
    """Start a node process (this file's --serve mode); read its hello with read_hello."""
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--tls", tls,
           "--item-bytes", str(size), "--slots", str(slots)]
    env = dict(os.environ)
    env.update({"UCX_" + k: v for k, v in ucx_env(tls).items()})
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def read_hello(proc: subprocess.Popen, timeout: float = SERVE_READY_TIMEOUT_S) -> dict:
    """The node's hello line, or RuntimeError if it does not come within `timeout` s."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"storage node did not start within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"storage node exited early (status {proc.wait(10)})")
    return json.loads(line)


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """Close a child's pipes and wait for it; terminate, then kill, if it lingers."""
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


@contextlib.contextmanager
def node(tls: str, size: int, slots: int):
    """A running node process as a context manager: yields its hello, always stops it."""
    proc = None
    try:
        proc = start_node(tls, size, slots)
        yield proc, read_hello(proc)
    finally:
        stop_process(proc)


# --------------------------------------------------------------------------- measurements


def summarize(lat_s: np.ndarray, nbytes: int) -> dict:
    """GB/s over the summed batch times, and per-batch p50/p99 in ms."""
    return {
        "gbps": nbytes / float(lat_s.sum()) / 1e9,
        "p50_ms": float(np.percentile(lat_s, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat_s, 99)) * 1e3,
    }


def measure_numpy(arena2d: np.ndarray, batches: list[np.ndarray], warmup: int) -> tuple:
    """Time np.take of each batch of rows of a local arena: (summary, verified)."""
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
    """Time `_native.gather` of each batch of slots from a node: (summary, verified).

    One endpoint and RemoteKey, one registered destination of one batch, the
    first, first timed and last batch checked byte for byte.
    """
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


def measure_mapped(hello: dict, size: int, batches: list[np.ndarray], warmup: int,
                   threads: int = 2) -> tuple:
    """Time `_native.mapped_gather` of each batch from the node's arena mapped
    read-only in this process (the same-host path): (summary, verified)."""
    from distore_ucx._native_loader import _native
    from distore_ucx.transport.local_map import receive_arena

    if not hello.get("local_socket"):
        raise RuntimeError("the node could not share its arena (no sealed memfd)")
    fd, nbytes, _, high = receive_arena(hello["local_socket"], 1, None, "bench-node")
    try:
        arena = _native.MappedArena(fd, nbytes, "bench-node", high)
    finally:
        os.close(fd)
    from distore_ucx.transport.runtime import UcxRuntime

    batch = len(batches[0])
    rt = UcxRuntime(progress_thread=False, env_tls=os.environ.get("UCX_TLS"))
    dest = view = None
    try:
        pool = _native.CopyPool(max(0, threads - 1))
        dest = rt.map_region(batch * size)
        view = dest.view()[: batch * size].reshape(batch, size)
        index = np.zeros(batch, np.uint32)
        length = np.full(batch, size, np.uint64)
        dest_offset = np.arange(batch, dtype=np.uint64) * np.uint64(size)
        offsets = [idx.astype(np.uint64) * np.uint64(size) for idx in batches]
        lat = np.empty(len(batches) - warmup)
        ok = True
        for i, off in enumerate(offsets):
            t0 = time.perf_counter()
            st = _native.mapped_gather([arena], index, off, length, dest, dest_offset, pool)
            dt = time.perf_counter() - t0
            if i >= warmup:
                lat[i - warmup] = dt
            if st.any():
                raise RuntimeError(f"mapped batch {i}: statuses {sorted(set(st.tolist()))}")
            if i in (0, warmup, len(batches) - 1):
                ok &= check_rows(view, batches[i], f"mapped batch {i}")
        return summarize(lat, lat.size * batch * size), ok
    finally:
        del view, dest, arena
        rt.close()


def perftest_path() -> tuple[str, str]:
    """(ucx_perftest executable, UCX lib dir) of the libucx wheel."""
    import libucx

    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "bin", "ucx_perftest"), os.path.join(root, "lib")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
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


def measure_perftest(tls: str, size: int, outstanding: int, ops: int, warmup_ops: int,
                     timeout: float, test: str = "ucp_get",
                     extra_env: dict[str, str] | None = None,
                     extra_args: list[str] | None = None) -> tuple[dict | None, str | None]:
    """``ucx_perftest -t <test> -s size -O outstanding`` between two local processes
    (`test` ucp_get by default, e.g. ucp_am_bw); `extra_env` adds UCX settings
    (without the UCX_ prefix) to both, e.g. {"RNDV_SCHEME": "put_zcopy"}, and
    `extra_args` options to the client's command line (e.g. ["-E", "sleep"]).

    Returns ({"gbps", "p50_us", "avg_us"}, None), or (None, why) when it could not run.
    p50_us and avg_us are per operation.
    """
    try:
        exe, lib = perftest_path()
    except ImportError as exc:
        return None, f"libucx not importable: {exc}"
    if not os.access(exe, os.X_OK):
        return None, f"{exe} not found"
    env = dict(os.environ)  # includes what ucxx put there at import (UCX_RNDV_THRESH, ...)
    env.update({"UCX_" + k: v for k, v in ucx_env(tls).items()})
    env.update({"UCX_" + k: v for k, v in (extra_env or {}).items()})
    env["LD_LIBRARY_PATH"] = lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    port = free_port()
    common = ["-p", str(port)]
    client = [exe, "127.0.0.1", *common, "-t", test, "-s", str(size),
              "-n", str(ops), "-w", str(warmup_ops), "-O", str(outstanding),
              *(extra_args or [])]
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
            time.sleep(0.02)  # polling /proc with a deadline
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
        return {"gbps": mib_s * MiB / 1e9, "p50_us": float(cols[1]),
                "avg_us": float(cols[2])}, None
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


# --------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after its ")" are fixed.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- output


def fmt(v, spec: str) -> str:
    """format(v, spec), or "-" for a missing value."""
    return "-" if v is None else format(v, spec)


def print_table(head: list[str], lines: list[list[str]]) -> None:
    """Print rows of strings right-aligned under `head`."""
    lines = [head, *lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


class JsonLines:
    """Writes each result row as one JSON line to stdout and, if given, a file.

    >>> with JsonLines(args.json_out) as out:
    ...     out.write({"size": 8, "gbps": 0.1})
    """

    def __init__(self, path: str | None):
        self._file = open(path, "w") if path else None

    def write(self, row: dict) -> None:
        """Emit one row now (flushed, so a killed run keeps what it measured)."""
        line = json.dumps(row)
        print(line, flush=True)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file, if any."""
        if self._file:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pyplot(path: str):
    """matplotlib.pyplot with the Agg backend, or None (with a message) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from distore_ucx.errors import install_hint  # here: importing it loads UCX

        log(f"matplotlib is not importable ({install_hint('bench')}); not writing {path}")
        return None
    return plt


def save_figure(plt, fig, path: str) -> None:
    """Save and close a figure, and say where it went."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote {path}")


def plot_size_sweep(rows: list[dict], series: list[tuple[str, str, str]], ylabel: str,
                    title: str, path: str, logy: bool = False) -> None:
    """One line per (series, tls) against item size: series is [(key, label, style)]."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    # Colour and marker say the method, the line style the transport.
    lines = ["-", "--", ":", "-."]
    for t, tls in enumerate(dict.fromkeys(r["tls"] for r in rows)):
        sel = [r for r in rows if r["tls"] == tls]
        for i, (key, label, style) in enumerate(series):
            pts = [(r["item_bytes"], r[key]) for r in sel if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=style[0], linestyle=lines[t % len(lines)],
                        color=f"C{i}", label=f"{label} ({tls})")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("item size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    save_figure(plt, fig, path)


def run_sweep(json_out, tls_list, sizes, measure, print_rows, plot=None, plot_path=None) -> int:
    """The size sweep every gather script runs: measure(tls, size) -> (row, ok)
    for each transport and size, JSON lines as they come, then the table and
    the plot. Exit status 1 if any gathered byte was wrong."""
    rows, all_ok = [], True
    with JsonLines(json_out) as out:
        for tls in tls_list:
            for size in sizes:
                row, ok = measure(tls, size)
                all_ok &= ok
                rows.append(row)
                out.write(row)
    print()
    print_rows(rows)
    if plot_path and plot is not None:
        plot(rows, plot_path)
    if not all_ok:
        log("data mismatch: see MISMATCH lines above")
        return 1
    return 0


def size_list(text: str) -> list[int]:
    """Comma-separated sizes with optional K/M suffixes (powers of 1024): '8,4K,64M'."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        if not part:
            continue
        if part[-1] in mult:
            out.append(int(float(part[:-1]) * mult[part[-1]]))
        else:
            out.append(int(part))
    return out


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description="perf helper: the storage node mode")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--tls", required=True)
    p.add_argument("--item-bytes", type=int, required=True)
    p.add_argument("--slots", type=int, required=True)
    args = p.parse_args(argv)
    return serve(args.tls, args.item_bytes, args.slots)


if __name__ == "__main__":
    sys.exit(_main())
