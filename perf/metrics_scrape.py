"""How long a Prometheus scrape of a big control plane takes.

A control plane (its own process, as `distore control` runs it) holds
--tables prioritized tables with --items items in all, some of them leased;
this process fetches its /metrics --scrapes times over HTTP and parses each
with prometheus_client's parser. Reported: scrape latency p50/p99/max, the
exposition's size, and the time the control plane's event loop spends on
the snapshot (what a scrape costs the requests it serves). Baseline, same
run: the same scrapes of an empty control plane (no tables).

    cd /tmp && <venv>/bin/python <repo>/perf/metrics_scrape.py

Target (issue #15): a scrape of 10^6 items in 16 tables answers in <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import urllib.request

import numpy as np
from common import cpu_seconds


def serve_plane(tables: int, items: int, queue, stop) -> None:
    """Child: a ControlPlane filled in place, serving /metrics on a free port."""
    import asyncio

    from distore_ucx import metrics
    from distore_ucx.config import ControlConfig
    from distore_ucx.control.server import ControlPlane
    from distore_ucx.control.tables import Table
    from distore_ucx.selectors import Prioritized
    from distore_ucx.spec import TableSpec

    async def main():
        plane = ControlPlane(ControlConfig(port=0, metrics_port=metrics.AUTO_PORT))
        server = await plane.start()
        spec = TableSpec.parse(((1024,), "uint8"))
        per = items // tables if tables else 0
        for i in range(tables):
            t = Table.make(f"table-{i:02d}", per, spec, sampler=Prioritized(0.6), seed=i)
            k = np.arange(per, dtype=np.uint64) + np.uint64(i * per)
            t.add(1, k, np.arange(per, dtype=np.uint64) * np.uint64(spec.slot_size), k + 1,
                  np.random.default_rng(i).uniform(0.1, 2, per))
            recs, _, _ = t.sample(min(per, 256))
            plane.leases.grant(t.name, recs)
            t.stats.decision.observe(0.0001)
            plane.tables[t.name] = t
        took = []
        for _ in range(20):
            t0 = time.perf_counter()
            metrics.control_snapshot(plane)
            took.append(time.perf_counter() - t0)
        queue.put({"port": plane.metrics_server.port,
                   "snapshot_p50_ms": round(float(np.median(took)) * 1e3, 3)})
        while not stop.is_set():
            await asyncio.sleep(0.05)
        plane.metrics_server.close()
        server.close()

    asyncio.run(main())


def _wait_ready(proc, queue, timeout: float) -> dict:
    """The child's ready message; raises at once if the child died (its
    traceback is on stderr) instead of waiting out the timeout."""
    import queue as queue_mod

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except queue_mod.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the control-plane process exited with code {proc.exitcode} "
                                   "before serving /metrics (its traceback is above)") from None
    raise RuntimeError(f"the control plane did not serve /metrics within {timeout:.0f} s")


def measure(tables: int, items: int, scrapes: int) -> dict:
    """Start a filled control plane, scrape it `scrapes` times; the figures."""
    from prometheus_client.parser import text_string_to_metric_families

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve_plane, args=(tables, items, queue, stop), daemon=True)
    proc.start()
    try:
        info = _wait_ready(proc, queue, 300.0)
        url = f"http://127.0.0.1:{info['port']}/metrics"
        lat, parse, size, samples = [], [], 0, 0
        idle0 = cpu_seconds(proc.pid)
        time.sleep(2.0)  # the control plane's own CPU while idle, to subtract
        idle = cpu_seconds(proc.pid) - idle0
        cpu0, t_start = cpu_seconds(proc.pid), time.monotonic()
        for i in range(scrapes + 3):
            t0 = time.perf_counter()
            text = urllib.request.urlopen(url, timeout=30).read().decode()
            t1 = time.perf_counter()
            fams = list(text_string_to_metric_families(text))
            if i >= 3:  # the first few warm the connection path and the parser
                lat.append(t1 - t0)  # the scrape: what Prometheus waits for
                parse.append(time.perf_counter() - t1)
            size, samples = len(text), sum(len(f.samples) for f in fams)
        cpu = cpu_seconds(proc.pid) - cpu0 - idle / 2.0 * (time.monotonic() - t_start)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    a = np.array(lat) * 1e3
    return {"tables": tables, "items": items, "scrapes": scrapes,
            "scrape_p50_ms": round(float(np.percentile(a, 50)), 2),
            "scrape_p99_ms": round(float(np.percentile(a, 99)), 2),
            "scrape_max_ms": round(float(a.max()), 2), "exposition_bytes": size,
            "samples": samples, "snapshot_p50_ms": info["snapshot_p50_ms"],
            "python_parse_p50_ms": round(float(np.median(parse)) * 1e3, 2),
            # CPU the control plane spent per scrape (all threads; /proc, 10 ms ticks
            # averaged over every scrape): what metrics cost it, load or not.
            "cpu_ms_per_scrape": round(cpu / (scrapes + 3) * 1e3, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=16)
    p.add_argument("--items", type=int, default=1_000_000, help="items in all tables")
    p.add_argument("--scrapes", type=int, default=100)
    p.add_argument("--json-out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    rows = [dict(measure(0, 0, args.scrapes), case="baseline: empty control plane"),
            dict(measure(args.tables, args.items, args.scrapes), case="filled")]
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"\n{'case':<32} {'tables':>6} {'items':>9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'max ms':>7} {'bytes':>7} {'loop ms':>7} {'cpu ms':>7}")
    for r in rows:
        print(f"{r['case']:<32} {r['tables']:>6} {r['items']:>9} {r['scrape_p50_ms']:>7.2f} "
              f"{r['scrape_p99_ms']:>7.2f} {r['scrape_max_ms']:>7.2f} "
              f"{r['exposition_bytes']:>7} {r['snapshot_p50_ms']:>7.3f} "
              f"{r['cpu_ms_per_scrape']:>7.2f}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
