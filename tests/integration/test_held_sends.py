"""A staging buffer freed after its writer's runtime, with sends UCX left to
finish at its unmap, neither crashes nor hangs (transport/runtime.py,
RegionOwner).

The CI run of 908a9ae hung in test_sample_path's storage-full test: the
garbage collector freed a staging buffer kept by a StorageFull traceback
after the writer's runtime (and its UCX worker) had gone, and unmapping it
spun forever on the destroyed worker's lock. held_send_peer.py makes that
order happen every time; glibc's MALLOC_PERTURB_ fills freed memory, so a
destroyed worker is not silently still usable. Each of the two guards
(regions hold their workers; am_send passes the region's own registration,
so aborted sends end at once) is tested alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("held_send_peer.py")


@pytest.mark.parametrize("mode", ["staging", "bare"])
def test_staging_buffer_freed_after_its_runtime(tmp_path, mode):
    # Over TCP, where UCX handles peer failures (under shared memory only it
    # does not, and never leaves a send to the unmap).
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", MALLOC_PERTURB_="85",
               UCX_WARN_UNUSED_ENV_VARS="n")
    for attempt in range(3):  # a crash was one run in three; the warning every run
        run = subprocess.run([sys.executable, str(PEER), mode], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        out = f"attempt {attempt}: rc {run.returncode}\n{run.stdout}\n{run.stderr}"
        assert run.returncode == 0, out
        assert run.stdout.split() == ["held", "2", "ok"], out
        # UCX's warning that a request outlived its worker (never completed).
        assert "was not returned to mpool" not in run.stderr, out
