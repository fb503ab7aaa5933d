"""The `distore` command: demo, status, control and node processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import distore_ucx as ds


def run_cli(*args, timeout=120, env=None, cwd=None):
    # Never from the repository root: that would import the uncompiled sources.
    return subprocess.run(
        [sys.executable, "-m", "distore_ucx", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
        cwd=cwd or tempfile.gettempdir(),
    )


def test_demo_verifies_every_item_and_exits_zero(tls, tmp_path):
    out = run_cli("demo", "--seconds", "3", "--arena", "256MiB", "--capacity", "1500",
                  "--json", timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["items_sampled"] > 1000 and summary["items_inserted"] > 0
    assert summary["bad_keys"] == 0 and summary["bad_checksums"] == 0
    assert "sampled" in out.stdout  # progress lines were printed


def test_status_shows_nodes_and_tables(cluster, client, tls):
    client.create_table("replay", capacity=50, spec=((16,), "uint8"))
    with client.writer() as w:
        w.insert("replay", np.zeros((5, 16), np.uint8))
    out = run_cli("status", "--control", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "replay" in out.stdout and out.stdout.count("True") == 2
    js = json.loads(run_cli("status", "--control", cluster.address, "--json").stdout)
    assert js["tables"][0]["size"] == 5


def test_status_of_nothing_is_a_clear_error():
    out = run_cli("status", "--control", "127.0.0.1:1")
    assert out.returncode == 2
    assert "cannot connect to the control plane" in out.stderr


def test_bad_arena_size_is_a_clear_error():
    out = run_cli("node", "--control", "127.0.0.1:1", "--arena", "lots")
    assert out.returncode == 2 and "is not a size" in out.stderr


def test_environment_reaches_every_process(tls):
    with ds.LocalCluster(nodes=1, arena_bytes=16 << 20, log_level="WARNING") as cluster:
        for pid in cluster.pids():
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(
                    kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv
                )
            assert env[b"UCX_TLS"] == tls.encode()
    assert os.environ["UCX_TLS"] == tls
