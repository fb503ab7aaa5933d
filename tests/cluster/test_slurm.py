"""cluster/slurm/distore.sbatch, run on this machine with stand-ins for srun
and scontrol: every step starts, the learner reads verified bytes from as
many storage nodes as "hosts", and everything stops when the learner ends."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(ROOT, "cluster", "slurm", "distore.sbatch")

FAKE_SRUN = """\
#!{python}
# srun stand-in: runs --nodes copies of the command here; passes SIGTERM on.
import signal, subprocess, sys
args = sys.argv[1:]
nodes = 1
while args and args[0].startswith("--"):
    if args[0].startswith("--nodes="):
        nodes = int(args[0].split("=", 1)[1])
    args = args[1:]
procs = [subprocess.Popen(args) for _ in range(nodes)]
def forward(sig, frame):
    for p in procs:
        p.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
sys.exit(max(p.wait() for p in procs))
"""

FAKE_SCONTROL = """\
#!/bin/bash
# scontrol stand-in: `scontrol show hostnames LIST` for a comma-separated LIST.
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$3"
"""

LEARNER = """\
import os, sys
import numpy as np
import distore_ucx as ds
with ds.connect(os.environ["DISTORE_CONTROL"]) as client:
    nodes = [n for n in client.status()["nodes"] if n["alive"]]
    client.create_table("t", capacity=1000, spec=((128,), "uint8"))
    with client.writer(max_items=10) as w:
        w.insert("t", (np.arange(100)[:, None] + np.arange(128)).astype(np.uint8))
    with client.learner("t", batch_size=8) as learner:
        for _ in range(20):
            b = learner.sample().data
            assert np.array_equal(b, (b[:, :1] + np.arange(128)).astype(np.uint8))
print(f"LEARNER OK with {len(nodes)} nodes", flush=True)
import urllib.request
url = f"http://127.0.0.1:{os.environ['CONTROL_METRICS_PORT']}/metrics"
text = urllib.request.urlopen(url, timeout=10).read().decode()
assert 'distore_table_inserts_total{table="t"} 100.0' in text, text
print("METRICS OK", flush=True)
# The store listens on every interface: it must refuse a peer without the token.
os.environ.pop("DISTORE_TOKEN_FILE")
try:
    ds.connect(os.environ["DISTORE_CONTROL"], timeout=5).status()
except ds.AuthenticationFailed:
    print("TOKEN REQUIRED", flush=True)
"""


@pytest.mark.skipif(shutil.which("python3") is None, reason="the script uses python3")
def test_sbatch_script_runs_store_and_learner_and_stops_them(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "learner.py").write_text(textwrap.dedent(LEARNER))
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
        SLURM_SUBMIT_DIR=str(tmp_path),
        DISTORE=f"{sys.executable} -m distore_ucx --log-level WARNING",
        LEARNER=f"{sys.executable} {tmp_path / 'learner.py'}",
        ARENA="32MiB", UCX_TLS="tcp", UCX_NET_DEVICES="lo",
        RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY="false", STARTUP_TIMEOUT="90",
        DISTORE_NODE_HUGEPAGES="false", CONTROL_BIND="127.0.0.1",  # loopback only in tests
    )
    with socket.socket() as s:  # the script dials a fixed port: pick a free one
        s.bind(("127.0.0.1", 0))
        env["PORT"] = str(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["CONTROL_METRICS_PORT"] = str(s.getsockname()[1])
    env["NODE_METRICS_PORT"] = "auto"  # two "hosts" share this machine here
    out = subprocess.run(["bash", SBATCH], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=240, start_new_session=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "storage nodes on 2 hosts" in text
    assert "LEARNER OK with 2 nodes" in text
    assert "learner exited with 0; stopping the store" in text
    assert "TOKEN REQUIRED" in text
    assert "METRICS OK" in text
    assert "Traceback" not in text
    assert not list(tmp_path.glob(".distore-token-*")), "the job's token file was left behind"


def test_sbatch_script_refuses_to_run_without_a_learner(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LEARNER"}
    out = subprocess.run(["bash", SBATCH], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=30)
    assert out.returncode != 0 and "set LEARNER to your learner command" in out.stderr
