"""perf/gpu_mapped_probe.py, small: the GPU gathers items out of a registered
read-only mapping, every gathered batch exact (marked gpu: skipped with a
reason without CuPy and a CUDA GPU; without them the script says so and
exits 2, tested unmarked in tests/unit/test_gpu_probe_script.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_gathers_out_of_a_read_only_mapping_exactly(tmp_path):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed (pip install cupy-cuda12x)")
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy sees no CUDA GPU")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CuPy sees no CUDA GPU ({exc})")
    out = tmp_path / "probe.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "perf", "gpu_mapped_probe.py"), "--arena", "256M",
         "--iters", "10", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["workload"] for r in rows] == ["W1", "R2D2"]
    for r in rows:
        assert r["verified"] is True
        assert r["mapped_kernel_gbps"] > 0 and r["pinned_copy_gbps"] > 0
        assert abs(r["ratio"] - r["mapped_kernel_gbps"] / r["pinned_copy_gbps"]) < 1e-9
