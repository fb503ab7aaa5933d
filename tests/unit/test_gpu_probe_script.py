"""perf/gpu_mapped_probe.py where it cannot run: it says what it needs and
exits 2, never a made-up figure (tests/gpu runs it on a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed here: tests/gpu runs the probe")
def test_the_probe_without_cupy_says_what_it_needs(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "gpu_mapped_probe.py"), "--arena", "64M"],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert proc.returncode == 2
    assert "needs CuPy and a CUDA GPU" in proc.stderr
    assert proc.stdout == ""  # no rows
