"""A staging buffer freed after its writer's runtime, with sends UCX left to
finish at its unmap, neither crashes nor hangs (transport/runtime.py,
RegionOwner).

The CI run of 908a9ae hung in test_sample_path's storage-full test: the
garbage collector freed a staging buffer kept by a StorageFull traceback
after the writer's runtime (and its UCX worker) had gone, and unmapping it
spun forever on the destroyed worker's lock. held_send_peer.py makes that
order happen every time; glibc's MALLOC_PERTURB_ fills freed memory, so a
destroyed worker is not silently still usable. Of the two guards, am_send's
passing the region's own registration (aborted sends end at once) is
tested alone by the `bare` run; regions holding their workers is tested
alone by test_regions_keep_their_workers.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("held_send_peer.py")


def live_workers() -> int:
    """ucxx worker objects alive in this process."""
    from distore_ucx.transport.runtime import _ucxx

    return sum(type(o) is _ucxx.UCXWorker for o in gc.get_objects())


def test_regions_keep_their_workers():
    # A runtime closed and collected leaves its workers to its regions until
    # the last is freed; a region made on the bare context keeps none.
    from distore_ucx._native_loader import _native
    from distore_ucx.transport.runtime import UcxRuntime

    gc.collect()
    before = live_workers()
    runtime = UcxRuntime()
    runtime.reader_worker  # noqa: B018 - made on first use: both workers exist now
    region = runtime.map_region(1 << 16, remote_read=True)
    bare = _native.MemoryRegion(runtime.context, 1 << 16)
    runtime.close()
    del runtime
    gc.collect()
    assert live_workers() == before + 2  # the region holds them
    del region
    gc.collect()
    assert live_workers() == before  # gone with the last region (bare holds none)
    del bare


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
