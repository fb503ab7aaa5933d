"""UCX active-message rendezvous over TCP: speed per endpoint kind, and
what a receiver sees when its sender is SIGKILLed mid-rendezvous.

Runs perf/am_rndv_probe.cc (built here against the libucx wheel's UCX),
standalone, no distore code involved: it is the evidence for how the
insert path makes its endpoints (native/am_insert.h).

    python perf/am_rndv_probe.py bw                 # GB/s, three endpoint kinds + ucp_am_bw
    python perf/am_rndv_probe.py kills --kills 100  # SIGKILL senders mid-rendezvous

`bw` prints, for each size, rendezvous sends over (i) endpoints made from
a worker address without peer-failure handling, (ii) the same with
UCP_ERR_HANDLING_MODE_PEER, (iii) endpoints made through a listener
(sockaddr, with a connection-manager lane) with it, next to
`ucx_perftest -t ucp_am_bw -E sleep` of the same size, same run, all with
UCX_TLS=tcp and UCX_RNDV_SCHEME=put_zcopy on the sender. `kills` keeps one
receiver up and, `--kills` times, starts a sender, waits until the receiver
has taken some of its messages, kills it with SIGKILL, and checks the
receiver: alive, every completed receive's content right, every slot back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, measure_perftest, ucx_env

HERE = Path(__file__).resolve().parent
SIZES = {"110KB": 110 << 10, "3MB": 3 << 20, "10MB": 10 << 20}


def ucx_dir() -> Path:
    """The libucx wheel's folder (headers, libraries, ucx_perftest)."""
    import libucx

    return Path(libucx.__file__).resolve().parent


def build(out: Path) -> Path:
    """Compile the probe against the wheel's UCX (once per output folder)."""
    exe = out / "am_rndv_probe"
    src = HERE / "am_rndv_probe.cc"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        ucx = ucx_dir()
        subprocess.run(["g++", "-O2", "-std=c++17", f"-I{ucx}/include", str(src), "-o", str(exe),
                        f"-L{ucx}/lib", "-lucp", "-lucs"], check=True)
    return exe


def env(**extra: str) -> dict[str, str]:
    """The environment of every UCX process here: TCP only, the wheel's libraries."""
    e = dict(os.environ)
    e.update({"UCX_" + k: v for k, v in ucx_env("tcp").items()})  # TCP on 127.0.0.1
    e.update(LD_LIBRARY_PATH=str(ucx_dir() / "lib"), UCX_WARN_UNUSED_ENV_VARS="n",
             UCX_LOG_LEVEL="error")
    e.update(extra)
    return e


class Receiver:
    """A probe receiver process; `stats()` asks it for its counters."""

    def __init__(self, exe: Path, where: str, size: int, slots: int, cwd: str, **extra: str):
        self.proc = subprocess.Popen([str(exe), "recv", where, str(size), str(slots)], cwd=cwd,
                                     env=env(**extra), stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if '"ready"' not in line:
            raise RuntimeError(f"receiver did not start: {line!r}")

    def stats(self) -> dict:
        """Its counters now (it prints them on SIGUSR1)."""
        self.proc.send_signal(signal.SIGUSR1)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"receiver exited (status {self.proc.wait()})")
            d = json.loads(line)
            if "arrived" in d:
                return d

    def wait_for(self, pred, timeout: float) -> dict:
        """Poll its counters until `pred(stats)` or `timeout` s; the last counters."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if pred(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.01)

    def stop(self) -> tuple[int, list[str]]:
        """SIGTERM; its exit status and final lines (after a clean teardown)."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return self.proc.returncode, out.splitlines()[-2:]


def sender(exe: Path, mode: str, target: str, size: int, count: int, window: int, cwd: str,
           **extra: str) -> subprocess.Popen:
    return subprocess.Popen([str(exe), "send", mode, target, str(size), str(count), str(window)],
                            cwd=cwd, env=env(UCX_RNDV_SCHEME="put_zcopy", **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def perftest(size: int, count: int, window: int, peer_failure: bool = False) -> float:
    """ucx_perftest -t ucp_am_bw -E sleep of `size` bytes, `window` outstanding,
    GB/s (put_zcopy on the sender; -E sleep: it sleeps when idle, as the
    probe's receiver does, which a shared machine needs for figures that
    hold still); `peer_failure`: its -e (UCP_ERR_HANDLING_MODE_PEER)."""
    pt, why = measure_perftest("tcp", size, window, count, max(window, count // 10), 300,
                               test="ucp_am_bw", extra_env={"RNDV_SCHEME": "put_zcopy"},
                               extra_args=["-E", "sleep"] + (["-e"] if peer_failure else []))
    if why:
        print(f"ucx_perftest: {why}", file=sys.stderr)
    return pt["gbps"] if pt else float("nan")


def bw(args) -> None:
    cols = ["addr-none", "addr-peer", "sockaddr", "ucp_am_bw", "ucp_am_bw -e"]
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        rows = []
        for name, size in SIZES.items():
            count = max(40, int(args.gigabytes * 1e9 / size))
            runs: dict[str, list[float]] = {c: [] for c in cols}
            # Interleaved repeats: a busy machine slows all columns alike.
            for _ in range(args.repeats):
                for mode in cols[:3]:
                    runs[mode].append(probe_bw(exe, mode, size, count, args.window, tmp))
                runs["ucp_am_bw"].append(perftest(size, count, args.window))
                runs["ucp_am_bw -e"].append(perftest(size, count, args.window, True))
            row = {"size": name, "bytes": size, "count": count, "window": args.window,
                   **{c: statistics.median(v) for c, v in runs.items()},
                   "runs": runs}
            print(json.dumps(row), flush=True)
            rows.append(row)
        print(f"\nGB/s, median of {args.repeats}, UCX_TLS=tcp, UCX_RNDV_SCHEME=put_zcopy")
        print(f"{'size':8}" + "".join(f"{c:>14}" for c in cols) + f"{'sockaddr/bw':>14}")
        for r in rows:
            vals = "".join(f"{r[c]:>14.2f}" for c in cols)
            print(f"{r['size']:8}{vals}{r['sockaddr'] / r['ucp_am_bw']:>14.2f}")


def probe_bw(exe: Path, mode: str, size: int, count: int, window: int, tmp: str) -> float:
    """GB/s of `count` rendezvous sends over a `mode` endpoint (nan if it failed)."""
    if mode == "sockaddr":
        port = free_port()
        where, target = f"listen:{port}", f"127.0.0.1:{port}"
    else:
        target = os.path.join(tmp, f"addr-{mode}")
        where = f"addr:{target}"
    rx = Receiver(exe, where, size, window, tmp, PROBE_NO_FILL="1")
    s = sender(exe, mode, target, size, count, window, tmp, PROBE_NO_FILL="1")
    out, _ = s.communicate(timeout=600)
    rx.stop()
    return json.loads(out.splitlines()[-1])["gb_s"] if s.returncode == 0 else float("nan")


def kills(args) -> None:
    size = SIZES[args.size]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        port = free_port()
        if args.mode == "sockaddr":
            where, target = f"listen:{port}", f"127.0.0.1:{port}"
        else:
            target = os.path.join(tmp, "addr")
            where = f"addr:{target}"
        rx = Receiver(exe, where, size, args.slots, tmp)
        first = rx.stats()
        t0 = time.monotonic()
        killed_mid = 0
        for i in range(args.kills):
            before = rx.stats()
            s = sender(exe, args.mode, target, size, 0, args.window, tmp)
            # Some of its messages taken, then a kill at a random moment after.
            rx.wait_for(lambda st, b=before: st["arrived"] >= b["arrived"] + 2, 10)
            time.sleep(rng.uniform(0, args.max_delay))
            mid = rx.stats()
            s.kill()
            s.wait()
            killed_mid += mid["busy_slots"] > 0
            after = rx.wait_for(lambda st: st["busy_slots"] == 0 and st["queued"] == 0,
                                args.settle)
            if rx.proc.poll() is not None:
                print(json.dumps({"kill": i, "receiver": "died", "status": rx.proc.returncode}))
                sys.exit(1)
            if after["busy_slots"] or after["queued"] or after["bad_content"]:
                print(json.dumps({"kill": i, "stuck": after}), flush=True)
            if args.verbose or i % 10 == 9:
                print(json.dumps({"kill": i + 1, **after}), flush=True)
        last = rx.stats()
        status, tail = rx.stop()
        summary = {
            "mode": args.mode, "size": args.size, "kills": args.kills,
            "killed_with_receives_under_way": killed_mid,
            "seconds": round(time.monotonic() - t0, 1),
            "ok": last["ok"], "failed": last["failed"], "fail": last["fail"],
            "bad_content": last["bad_content"], "busy_slots": last["busy_slots"],
            "queued": last["queued"], "eps_left": last["eps"], "ep_errors": last["ep_errors"],
            "max_recv_ms": last["max_recv_ms"],
            "rss_kb_first": first["rss_kb"], "rss_kb_last": last["rss_kb"],
            "receiver_exit": status, "clean_exit": any("clean_exit" in t for t in tail),
        }
        print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bw", help="GB/s per endpoint kind, next to ucp_am_bw")
    b.add_argument("--gigabytes", type=float, default=1.0, help="bytes per measurement")
    b.add_argument("--window", type=int, default=8, help="sends in flight")
    b.add_argument("--repeats", type=int, default=3, help="interleaved runs (median shown)")
    k = sub.add_parser("kills", help="SIGKILL senders mid-rendezvous")
    k.add_argument("--mode", default="sockaddr", choices=["sockaddr", "addr-peer", "addr-none"])
    k.add_argument("--size", default="3MB", choices=list(SIZES))
    k.add_argument("--kills", type=int, default=100)
    k.add_argument("--window", type=int, default=8)
    k.add_argument("--slots", type=int, default=8)
    k.add_argument("--max-delay", type=float, default=0.05, help="s after the first receives")
    k.add_argument("--settle", type=float, default=10.0, help="s for the slots to come back")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    {"bw": bw, "kills": kills}[args.cmd](args)


if __name__ == "__main__":
    main()
