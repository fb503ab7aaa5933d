"""perf/replay_bench.py end to end: a quick run of two small workloads.

The bench is a standalone script outside the package; this runs it as users
do (a subprocess, from outside the source tree) and checks its JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "perf", "replay_bench.py")

FIELDS = ("workload", "buffer", "sample_items_per_s", "sample_gb_per_s", "ratio",
          "batch_p50_ms", "batch_p99_ms", "insert_items_per_s", "cpu_pct",
          "demanded_samples_per_s", "capacity", "problems")


def test_replay_bench_quick_reports_sane_figures(tmp_path):
    out_file = tmp_path / "replay.jsonl"
    # The installed distore_ucx, never the uncompiled sources of this checkout.
    env = dict(os.environ)
    # A priority table (prefilled, priority updates) and a use-count table.
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--workloads", "dqn-gobigger,ppo-atari",
         "--memory", "48MiB", "--seconds", "1.5", "--tls", "sm",
         "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["workload"] for r in rows] == ["dqn-gobigger", "ppo-atari"]
    for r in rows:
        assert all(k in r for k in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["problems"] == []
        assert r["sample_items_per_s"] > 0 and r["batches"] > 0
        assert 0 < r["batch_p50_ms"] <= r["batch_p99_ms"]
        assert abs(r["ratio"] - r["sample_items_per_s"] / r["demanded_samples_per_s"]) < 0.01
        assert r["capacity"] * r["item_bytes"] <= 48 << 20
        # Writers are paced to the workload's rate: never far above it.
        assert 0 < r["insert_items_per_s"] <= 1.5 * r["demanded_inserts_per_s"]
        assert set(r["cpu_pct"]) >= {"control", "node0", "node1", "writer0", "learner"}
        assert all(v is not None and 0 <= v < 250 for v in r["cpu_pct"].values())
    gob, ppo = rows
    assert gob["priority_updates"] > 0 and gob["prefill_items"] == gob["capacity"]
    # Use-count: each item can be sampled at most max_times_sampled times.
    assert ppo["max_times_sampled"] == 2 and ppo["prefill_items"] == 0
    assert ppo["sample_items_per_s"] <= 2 * ppo["insert_items_per_s"] * 1.5 + 32 / 1.5
    assert "workload" in proc.stdout and "ratio" in proc.stdout  # the table
    # Every column is explained under it (issue 51: `of`, `cpu%ctl` were cryptic).
    lines = proc.stdout.splitlines()
    head = next(ln for ln in lines if ln.split()[:2] == ["workload", "buffer"]).split()
    legend = {ln.split()[0] for ln in lines[lines.index("columns:") + 1:] if ln.strip()}
    assert set(head) == legend, set(head) ^ legend
    assert "of" not in head and "cpu%ctl" not in head


def test_latency_over_tcp_compares_with_a_round_trip_not_perftests_poll_timer(tmp_path):
    # Issue 51: "tcp 8 B read p50 71.0 us (ucx_perftest 1092.3 us)": over tcp
    # ucp_get is served when ucx_perftest's passive side wakes from a 1 ms
    # poll() timeout. The baseline is a tag_lat request and reply now.
    from distore_ucx.bench import _summarize

    out_file = tmp_path / "latency.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "latency.py"), "--tls", "tcp",
         "--sizes", "8", "--bytes", str(1 << 20), "--arena", str(16 << 20),
         "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert row["perftest_test"] == "tag_lat round trip"
    if row["perftest_p50_us"] is None:
        pytest.skip(f"ucx_perftest did not run: {row.get('perftest_error')}")
    assert row["perftest_p50_us"] < 500, row  # 1,083-1,092 us as a ucp_get
    (line,) = _summarize("latency", [row])
    assert "for a request and a reply by tag_lat, both sides busy-polling" in line


def test_bandwidth_sweep_runs_and_verifies_a_size(tmp_path):
    # perf/bandwidth.py, one of `distore bench`'s three scripts, failed
    # before measuring anything ("'Namespace' object has no attribute
    # 'mapped_pass'") since gather_bandwidth.py measured mapped copies too.
    # One small size here; the sweep itself is `distore bench`'s.
    out_file = tmp_path / "bandwidth.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "bandwidth.py"), "--tls", "sm",
         "--sizes", "65536", "--bytes", str(4 << 20), "--arena", str(16 << 20),
         "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert row["item_bytes"] == 65536 and row["verified"] is True
    assert row["ours_gbps"] > 0 and row["numpy_gbps"] > 0


def test_distore_bench_without_a_checkout_says_what_to_do(tmp_path):
    # The installed distore_ucx, never the uncompiled sources of this checkout.
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "distore_ucx", "bench", "--perf-dir", str(tmp_path),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path), env=env, check=False)
    assert proc.returncode == 2
    assert "source checkout" in proc.stderr and "--perf-dir" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_metrics_scrape_script_runs_and_reports_each_case(tmp_path):
    """perf/metrics_scrape.py, small: it rotted once (a Table signature change
    left its child dead and the parent waiting 300 s), so it runs here."""
    out_file = tmp_path / "scrape.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "metrics_scrape.py"), "--tables", "2",
         "--items", "2000", "--scrapes", "5", "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["tables"] for r in rows] == [0, 2]
    filled = rows[1]
    assert filled["items"] == 2000 and filled["samples"] > rows[0]["samples"]
    assert 0 < filled["scrape_p50_ms"] <= filled["scrape_p99_ms"] <= filled["scrape_max_ms"]


def test_metrics_cost_script_sets_each_cost_against_its_path(tmp_path):
    """perf/metrics_cost.py, small: every row has a positive path cost and a share."""
    out_file = tmp_path / "cost.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "metrics_cost.py"), "--seconds", "0.5",
         "--scrapes", "3", "--items", "2000", "--loops", "2000", "--capacity", "2048",
         "--arena", "32MiB", "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=180, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(r["part"], r["process"]) for r in rows] == [
        ("recording", "learner"), ("recording", "control"), ("recording", "writer"),
        ("recording", "node"), ("serving", "control"), ("serving", "node")]
    for r in rows:
        assert r["path_us"] > 0 and r["metrics_us"] >= 0 and r["share"] is not None
    assert rows[0]["sample_batches"] > 0 and rows[0]["insert_batches"] > 0


def test_demotion_script_compares_the_ranked_picker_with_a_full_scan(tmp_path):
    """perf/demotion.py, small: both pickers timed, every requested item picked."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "demotion.py"), "--items", "20000",
         "--total", "3000", "--scans", "2"],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["sampler"] for r in rows] == ["prioritized", "uniform"]
    for r in rows:
        assert r["scan_ms"] > 0 and r["ranked_ms"] > 0
        assert r["picked"] >= 3000 and r["scans"] >= 1


def test_fanin_probe_says_what_flushes_waited_on_and_how_the_run_ended(tmp_path):
    """perf/fanin.py --probe (perf/flush_probe.py), small: it reaches into a
    writer's parts, so it runs here to keep it from rotting."""
    out_file = tmp_path / "fanin.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "fanin.py"), "--actors", "3", "--rate", "50",
         "--seconds", "1.5", "--batch", "16", "--sample-rate", "5", "--probe", "0",
         "--close-together", "--max-p99-ms", "10000", "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(out_file.read_text())
    probe = row["probe"]
    assert row["missing"] == 0 and row["acked"] > 0
    # the writers' CPU in insert() and flush(): measured, and more than nothing an item
    assert 0 < row["writer_cpu_us_per_item"] < 1e6
    # --probe 0 keeps every flush; the writers connected at creation.
    assert probe["slow_flushes"] > 0 and probe["first_flushes"] == 3
    assert "ack" in probe["first_s"] and probe["connections"]["mean"] >= 2
    assert probe["tail"] and all(len(step) == 9 for step in probe["tail"])
