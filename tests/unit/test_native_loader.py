"""Loading UCX without its memory-hook grace period where no other thread can
be inside a hooked function (distore_ucx/_native_loader.py): 0.4 s of a core
saved in every process that imports distore (actors, learners, CLIs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROBE = """
import json, os, sys, threading, time
if sys.argv[1] == "spinning":
    threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
import numpy  # its thread pool starts, then sleeps
t0 = time.process_time()
import distore_ucx._native_loader as loader
print(json.dumps({"no_grace": loader._no_grace, "cpu": time.process_time() - t0,
                  "env": os.environ.get("UCX_MEM_BISTRO_GRACE_DURATION")}))
"""


def probe(mode: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "UCX_MEM_BISTRO_GRACE_DURATION"}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=environ, cwd="/",
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_whose_other_threads_sleep_loads_ucx_without_the_grace_period():
    got = probe("quiet")
    assert got["no_grace"] is True
    assert got["env"] is None  # not passed on to child processes


def test_a_thread_that_runs_keeps_the_grace_period_and_a_users_value_is_kept():
    assert probe("spinning")["no_grace"] is False
    got = probe("quiet", UCX_MEM_BISTRO_GRACE_DURATION="10ms")
    assert got["no_grace"] is False and got["env"] == "10ms"
