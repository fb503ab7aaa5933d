"""perf/stress_faults.py, short (12 s a transport): kills, hangs and foreign lease releases while
learners read flat out; every item's bytes are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "perf", "stress_faults.py")


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_faults_under_flat_out_reads_give_no_wrong_item(tls, tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--seconds", "12", "--tls", tls, "--interval", "2",
         "--seed", "7"],
        check=False, capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 0, result
    assert result["wrong"] == 0 and result["sampled"] > 10_000
    assert result.get("learner_fatal_errors", 0) == 0 and result.get("learner_errors", 0) == 0
    assert result.get("kills", 0) + result.get("hangs", 0) >= 3  # faults really happened
    assert result["foreign_releases"] > 1000
