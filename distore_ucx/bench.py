"""`distore bench`: run the perf suite and collect its results in one folder.

The suite is the standalone scripts in the source tree's `perf/` folder
(replay workloads, bandwidth and latency sweeps); they are not part of the
installed package, so this command needs a source checkout: the package
imported from it (`pip install -e .`, PYTHONPATH=<checkout>), the current
directory inside one (after `pip install .`), or `--perf-dir` pointing at
one's `perf/`. The scripts use the installed distore_ucx. Each script runs as a subprocess
with the same Python and the same distore_ucx; its progress is echoed with
a prefix, its JSON lines, table and plot land in the output folder, and a
summary table closes the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .errors import ConfigError
from .progress import Progress

SUITE = ("replay", "bandwidth", "latency")
SCRIPTS = {"replay": "replay_bench.py", "bandwidth": "bandwidth.py", "latency": "latency.py"}


def _lacks(perf: Path) -> list[str]:
    return [s for s in SCRIPTS.values() if not (perf / s).is_file()]


def find_perf_dir(given: str | None = None, cwd: str | None = None) -> Path:
    """The perf/ folder of a source checkout: `given`, else the one beside
    the imported distore_ucx (pip install -e ., PYTHONPATH=<checkout>), else
    that of the checkout the current directory is in (after `pip install .`
    the package lives in site-packages, the scripts stay in the checkout).

    Raises ConfigError, saying what to do, when there is none.
    """
    pkg = Path(__file__).resolve().parent
    if given:
        perf = Path(given).resolve()
        missing = _lacks(perf)
        if missing:
            raise ConfigError(
                f"--perf-dir {perf} lacks {', '.join(missing)}: give the perf/ folder of a "
                "distore-ucx source checkout")
        return perf
    here = Path(cwd or os.getcwd()).resolve()
    for root in (pkg.parent, here, *here.parents):
        if (root / "distore_ucx").is_dir() and not _lacks(root / "perf"):
            return root / "perf"
    raise ConfigError(
        f"distore bench runs the scripts in a source checkout's perf/ folder, which the "
        f"installed package does not include (distore_ucx was imported from {pkg}), and "
        f"{here} is not inside a checkout. Run it from inside the repository's clone, or "
        f"pass --perf-dir <checkout>/perf")


def _summarize(name: str, rows: list[dict]) -> list[str]:
    """A few lines of headline figures for one script's rows."""
    out = []
    if name == "replay":
        for r in rows:
            out.append(f"{r['workload']:<14} {r['sample_items_per_s']:>10.0f} samples/s of "
                       f"{r['demanded_samples_per_s']:>5} demanded ({r['ratio']:.2f}x), "
                       f"{r['sample_gb_per_s']:.3f} GB/s, p99 {r['batch_p99_ms']:.1f} ms")
    elif name == "bandwidth":
        for tls in dict.fromkeys(r["tls"] for r in rows):
            best = max((r for r in rows if r["tls"] == tls), key=lambda r: r["ours_gbps"])
            out.append(f"{tls:<4} peak {best['ours_gbps']:.2f} GB/s at {best['item_bytes']} B "
                       f"(numpy {best['numpy_gbps']:.2f}, ucx_perftest "
                       + (f"{best['perftest_gbps']:.2f})" if best["perftest_gbps"] else "-)"))
    elif name == "latency":
        for tls in dict.fromkeys(r["tls"] for r in rows):
            small = min((r for r in rows if r["tls"] == tls), key=lambda r: r["item_bytes"])
            pt = small["perftest_p50_us"]
            ours = f"{tls:<4} {small['item_bytes']} B read p50 {small['ours_1_p50_us']:.1f} us"
            if pt is None:
                out.append(f"{ours} (ucx_perftest -)")
            elif small.get("perftest_test") == "tag_lat round trip":
                out.append(f"{ours} (ucx_perftest: {pt:.1f} us for a request and a reply by "
                           "tag_lat, both sides busy-polling; its ucp_get is no baseline over "
                           "tcp: perf/latency.py says why)")
            else:
                out.append(f"{ours} (ucx_perftest ucp_get {pt:.1f} us)")
    return out


def _run_script(name: str, perf: Path, out_dir: Path, extra: list[str], env: dict,
                progress: Progress) -> dict:
    """Run one script, echoing its progress; returns its status and rows."""
    jsonl, png, txt = (out_dir / f"{name}{ext}" for ext in (".jsonl", ".png", ".txt"))
    cmd = [sys.executable, str(perf / SCRIPTS[name]), "--json-out", str(jsonl),
           "--plot", str(png), *extra]
    progress.write(f"[{name}] {' '.join(cmd)}")
    t0 = time.monotonic()
    with open(txt, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=str(out_dir))
        try:
            for line in proc.stderr:
                progress.write(f"[{name}] {line.rstrip()}")
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: the script stops its own children
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            proc.stderr.close()
    rows = []
    if jsonl.exists():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {"script": name, "exit_code": rc, "seconds": round(time.monotonic() - t0, 1),
            "rows": len(rows), "files": [p.name for p in (jsonl, png, txt) if p.exists()],
            "headline": _summarize(name, rows) if rows else []}


def run_bench(args) -> int:
    """Run the suite (args: out, quick, only, perf_dir); returns the exit code."""
    perf = find_perf_dir(args.perf_dir)
    names = [s.strip() for s in (args.only or ",".join(SUITE)).split(",") if s.strip()]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        raise ConfigError(f"unknown bench scripts {unknown}; choose from {', '.join(SUITE)}")
    out_dir = Path(args.out or os.path.join("bench-results", time.strftime("%Y%m%d-%H%M%S")))
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # the same distore_ucx for the scripts
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("UCX_NET_DEVICES", "lo")  # every process is on this host
    extra = ["--quick"] if args.quick else []
    print(f"distore bench: {', '.join(names)}{' (quick)' if args.quick else ''}; "
          f"results in {out_dir}", flush=True)
    results = []
    # A bar on a terminal, a line per finished script elsewhere (stderr).
    with Progress("distore bench", total=len(names), unit="scripts", every=0) as progress:
        for n in names:
            results.append(_run_script(n, perf, out_dir, extra, env, progress))
            progress.update(1, note=f"{n} done (exit {results[-1]['exit_code']})")
    (out_dir / "summary.json").write_text(json.dumps(
        {"quick": bool(args.quick), "results": results}, indent=2) + "\n")
    print(f"\n{'script':<10} {'exit':>4} {'seconds':>8} {'rows':>5}  files")
    for r in results:
        print(f"{r['script']:<10} {r['exit_code']:>4} {r['seconds']:>8.1f} {r['rows']:>5}  "
              f"{', '.join(r['files'])}")
    for r in results:
        for line in r["headline"]:
            print(f"  {r['script']}: {line}")
    print(f"results: {out_dir}")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1
