"""perf/cross_host.py, small: one item size, every row measured and checked,
so that the script does not rot between the runs that give its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_cross_host_script_measures_sample_and_inserts_over_tcp(tmp_path):
    out_file = tmp_path / "cross.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "cross_host.py"), "--sizes", "64K",
         "--seconds", "0.3", "--min-batches", "3", "--min-bytes", "1M", "--fill-bytes", "8M",
         "--insert-arena", "128M", "--perftest-bytes", "4M", "--perftest-repeats", "1",
         "--sample-gets", "--iterate", "--sample-repeats", "2", "--json-out", str(out_file)],
        capture_output=True, text=True, timeout=240, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    # Inserts go as active messages over the nodes' insert listeners by default.
    assert [r["op"] for r in rows] == ["sample", "sample (gets)", "sample (iterated)",
                                       "insert one (am)", "insert batched (am)"]
    assert all(r["via"] == "ucx active messages (UCX_TLS=tcp)" for r in rows[3:]), rows[3:]
    # Over tcp nodes send samples as active messages; --sample-gets reads by
    # gets; --iterate takes batches from the iterator (prefetch thread).
    assert [r["via"] for r in rows[:3]] == ["ucx-am:tcp", "ucx:tcp", "ucx-am:tcp"], rows[:3]
    for r in rows:
        assert r["verified"] and r["tls"] == "tcp" and r["local_map"] is False
        assert r["item_bytes"] == 64 << 10 and r["batch"] == 32 and r["gbps"] > 0
        assert "tcp" in r["via"] and "mapped" not in r["via"] and "cma" not in r["via"]
        for base in ("am_bw", "am_sleep", "get"):
            # ucx_perftest may fail to run where the libucx wheel lacks it:
            # then the row says so with None, never a made-up figure.
            if r[f"{base}_gbps"] is not None:
                assert abs(r[f"vs_{base}" if base != "am_bw" else "vs_am_bw"]
                           - r["gbps"] / r[f"{base}_gbps"]) < 1e-9
    sample = rows[0]
    # --sample-repeats: every run's GB/s kept, the median run reported, and
    # the like-with-like ratio (median over the median am_sleep run).
    for r in rows[:3]:
        assert r["c_contiguous"] is True
        assert len(r["gbps_runs"]) == 2 and r["gbps"] in r["gbps_runs"]
        assert r["gbps_best"] == max(r["gbps_runs"])
        if r["am_sleep_median_gbps"] is not None:
            want = sum(r["gbps_runs"]) / 2 / r["am_sleep_median_gbps"]
            assert abs(r["vs_am_sleep_median"] - want) < 1e-9
    assert sample["c_contiguous"] is True and sample["batches"] >= 3
    assert 0 < sample["p50_ms"] <= sample["p99_ms"]
    assert 0 < sample["gather_mean_ms"] <= sample["mean_ms"] * 1.5
    assert "vs_am" in proc.stdout and "sample" in proc.stdout  # the table
    for r in rows[3:]:
        # What a timed batch held on average: at least an item, at most a
        # writer's default batch (8 MiB for items of 64 KiB).
        assert r["batch_bytes"] == 8 << 20
        assert r["item_bytes"] <= r["batch_mean_bytes"] <= r["batch_bytes"]
