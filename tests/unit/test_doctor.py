"""`distore doctor` on this host, through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from distore_ucx.client.learner.device import cuda_present


def doctor(*args, env: dict | None = None) -> subprocess.Popen:
    """`distore doctor ARGS` started, with `env`'s changes to this process's
    environment (None: unset)."""
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    # Never from the repository root: that would import the uncompiled sources.
    return subprocess.Popen([sys.executable, "-m", "distore_ucx", "doctor", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tempfile.gettempdir(), env=full)


@pytest.fixture(scope="module")
def runs():
    """The module's four `distore doctor` runs, started together: each is
    2-3 s of one core, so the four take about half as long on two cores as
    one after another. "plain": the insert switches at their defaults (for
    the tests that read its plain report)."""
    procs = {
        "plain": doctor(env={"DISTORE_AM_INSERTS": None, "DISTORE_AM_INSERT_RUNS": None}),
        "am_inserts_off": doctor(env={"DISTORE_AM_INSERTS": "0"}),
        "runs_off": doctor(env={"DISTORE_AM_INSERTS": None, "DISTORE_AM_INSERT_RUNS": "0"}),
        "json": doctor("--json"),
    }
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


@pytest.fixture
def plain(runs):
    return runs["plain"]


def test_doctor_reports_ucx_and_what_is_missing(plain):
    out = plain
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("UCX 1.") and "transports:" in text and "tcp/" in text
    assert "CUDA support: cuda_copy=" in text and "hugepages:" in text
    assert "learner paths: device='cpu' -> host" in text
    # This kernel (>= 5.1) seals memfds against writable mappings.
    assert "same-host mapping: works" in text and "arena pages:" in text
    assert "same-host nodes -> mapped" in text
    # No RDMA here: inserts from other hosts come as active messages by default
    # (config.am_inserts_enabled), over the node's insert listener.
    assert ("inserts from other hosts: UCX active messages for items of 64 KiB and more "
            "(rendezvous over connections to the node's insert listener") in text
    # Samples by active message are on where UCX emulates RMA
    # (config.am_samples_enabled; storage/sample_server.why_not).
    assert ("remote samples: UCX active messages through the node's sample listener" in text
            or "remote samples: one-sided gets (UCX has an RDMA transport)" in text), text
    if not cuda_present():
        assert "GPUs: none found" in text
        assert "MISSING GPU: no NVIDIA GPU or driver found" in text
        assert "MISSING UCX CUDA support" in text
        assert "device='cuda' -> unavailable (no GPU)" in text
    for line in text.splitlines():
        if line.startswith("MISSING "):
            assert ": " in line and len(line) > 40, line  # says what to do


def test_doctor_says_inserts_go_by_gets_once_messages_are_off(runs):
    out = runs["am_inserts_off"]  # DISTORE_AM_INSERTS=0
    assert out.returncode == 0, out.stderr
    assert ("inserts from other hosts: one-sided gets (DISTORE_AM_INSERTS=0 turns "
            "active-message inserts off)") in out.stdout


def test_doctor_says_whether_small_inserts_go_in_runs(plain, runs):
    out = plain
    assert out.returncode == 0, out.stderr
    assert "items that fit several to 1 MiB go several to a message" in out.stdout
    out = runs["runs_off"]  # DISTORE_AM_INSERTS unset, DISTORE_AM_INSERT_RUNS=0
    assert out.returncode == 0, out.stderr
    assert "one item a message (DISTORE_AM_INSERT_RUNS=0)" in out.stdout


def test_doctor_json(runs):
    out = runs["json"]
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ucx"]["version"].startswith("1.")
    assert report["ucx"]["origin"] in ("wheel", "system")
    assert "host" in report["ucx"]["memory_types"]
    assert report["paths"]["cpu"] == "host"
    assert report["local_map"]["works"] is True and report["local_map"]["arena_pages"]
    assert all(len(m) == 2 for m in report["missing"])


def test_the_hugepages_line_says_what_arenas_will_get(plain):
    # It said nodes "fall back to transparent hugepages" above a line saying
    # shmem_enabled is never, where arenas get 4 KiB pages.
    text = plain.stdout
    line = next((ln for ln in text.splitlines() if "hugepages:" in ln and "MISSING" in ln), "")
    if not line:
        pytest.skip("this host has reserved hugepages: doctor reports none missing")
    assert "fall back" not in line
    pages = next(ln for ln in text.splitlines() if "arena pages:" in ln)
    if "4 KiB" in pages:
        assert "arenas get 4 KiB pages" in line, (line, pages)
    else:
        assert "use transparent hugepages" in line, (line, pages)
