"""The `distore` command: demo, status, control and node processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from helpers import wait_for

import distore_ucx as ds

# The control plane never loads UCX (test_system_ucx_setting_... checks it):
# tests of it alone run over one transport.
CONTROL_PLANE_ONLY = pytest.mark.parametrize("tls", ["tcp"], indirect=True)


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
    summary = json.loads(out.stdout)  # stdout is the JSON summary alone
    assert summary["ok"] is True
    assert summary["items_sampled"] > 1000 and summary["items_inserted"] > 0
    assert summary["bad_keys"] == 0 and summary["bad_checksums"] == 0
    assert "sampled" in out.stderr  # progress lines went to stderr
    # It says how each node is read (the tls fixture turns same-host mapping off).
    # Same host, not mapped; over tcp the nodes send samples as active messages.
    path = "cma" if tls == "sm" else f"ucx-am:{tls}"
    assert set(summary["read_paths"].values()) == {path}
    assert f"reads node 1: {path}" in out.stderr


@pytest.mark.parametrize("tls", ["sm"], indirect=True)
def test_demo_runs_on_the_smallest_arena_it_accepts_and_refuses_less(tls, tmp_path):
    # Its default capacity (2,000 items of 113 KB) is many times such an
    # arena: inserts evict by the table's remover instead of failing.
    from distore_ucx.demo import min_arena

    least = min_arena(2, 32)
    out = run_cli("demo", "--seconds", "3", "--arena", str(least), "--json", timeout=180,
                  cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)
    assert summary["ok"] is True and summary["evicted"] > 0
    assert summary["bad_keys"] == 0 and summary["bad_checksums"] == 0
    out = run_cli("demo", "--arena", str(least - 1), cwd=tmp_path)
    assert out.returncode == 2 and "too small for the demo" in out.stderr
    assert "Traceback" not in out.stderr


def test_status_shows_nodes_and_tables(cluster, client, tls):
    client.create_table("replay", capacity=50, spec=((16,), "uint8"))
    with client.writer() as w:
        w.insert("replay", np.zeros((5, 16), np.uint8))
    out = run_cli("status", "--control", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "replay" in out.stdout and out.stdout.count(" live ") == 2  # both nodes
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


def test_a_cluster_whose_picked_port_is_taken_picks_another(monkeypatch):
    # Another process may bind the port picked for the control plane before
    # the control plane does (it failed a test once): the start picks again.
    import socket

    import distore_ucx.cluster as cluster_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = []
    free_port = cluster_module._free_port

    def pick(host):
        picks.append(taken.getsockname()[1] if not picks else free_port(host))
        return picks[-1]

    monkeypatch.setattr(cluster_module, "_free_port", pick)
    with taken, ds.LocalCluster(nodes=1, arena_bytes=16 << 20, log_level="WARNING") as cluster:
        assert len(picks) == 2 and cluster.port == picks[1]
        assert len(cluster.nodes) == 1 and cluster.nodes[0].alive()
        with ds.connect(cluster.address) as client:
            assert [n["state"] for n in client.status()["nodes"]] == ["live"]


# -- configuration, status --watch, SIGTERM -------------------------------------

import signal  # noqa: E402


def spawn(*args, env=None, cwd=None):
    return subprocess.Popen(
        [sys.executable, "-m", "distore_ucx", *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd or tempfile.gettempdir(),
    )


def test_config_check_says_what_is_wrong_and_where(tmp_path):
    bad = tmp_path / "distore.toml"
    bad.write_text('[node]\narena = "lots"\nhugepage = true\n')
    out = run_cli("config", "check", str(bad))
    assert out.returncode == 1
    assert f"{bad}:2 [node] arena: 'lots' is not a size" in out.stderr
    assert f"{bad}:3 [node] hugepage: unknown key; did you mean 'hugepages'?" in out.stderr
    good = tmp_path / "good.toml"
    good.write_text('[control]\naddress = "127.0.0.1:7700"\n')
    out = run_cli("config", "check", str(good))
    assert out.returncode == 0 and "ok" in out.stdout


def test_config_show_tells_each_value_and_its_source(tmp_path):
    cfg = tmp_path / "distore.toml"
    cfg.write_text('[node]\narena = "2GiB"\nname = "from-file"\n')
    env = dict(os.environ, DISTORE_CONFIG=str(cfg), DISTORE_NODE_NAME="from-env",
               DISTORE_AM_SAMPLES="0")
    shown = json.loads(run_cli("config", "show", env=env).stdout)
    assert shown["node.arena"] == {"value": 2 << 30, "source": "file"}
    assert shown["node.name"] == {"value": "from-env", "source": "env"}
    assert shown["control.lease_timeout"]["source"] == "default"
    # Switches read where they are used are listed too.
    assert shown["DISTORE_AM_SAMPLES"] == {"value": "0", "source": "env"}


@CONTROL_PLANE_ONLY
def test_control_plane_creates_configured_tables_and_stops_on_sigterm(tmp_path, tls):
    cfg = tmp_path / "distore.toml"
    cfg.write_text(
        '[control]\nhost = "127.0.0.1"\nport = 7700\n\n'
        '[[tables]]\nname = "replay"\ncapacity = 500\n'
        'spec = { obs = [[8, 8], "uint8"], reward = [[], "float32"] }\n\n'
        '[[tables]]\nname = "flat"\ncapacity = 7\nspec = [[16], "uint8"]\n'
    )
    ready = tmp_path / "control.ready"
    # The flag (port 0) wins over the file's port 7700.
    proc = spawn("control", "--config", str(cfg), "--port", "0", "--ready-file", str(ready))
    try:
        wait_for(ready.exists, 60, "the control plane to start")
        address = json.loads(ready.read_text())["address"]
        assert not address.endswith(":7700")
        with ds.connect(address) as client:
            tables = {t["name"]: t for t in client.tables()}
            assert tables["replay"]["capacity"] == 500 and tables["flat"]["capacity"] == 7
            assert tables["replay"]["sampler"]["kind"] == "uniform"
            assert client.spec("replay").item_bytes >= 8 * 8 + 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_watch_shows_rates_and_stops_on_sigterm(cluster, client, tls):
    client.create_table("replay", capacity=1000, spec=((64,), "uint8"))
    proc = spawn("status", "--control", cluster.address, "--watch", "--json",
                 "--interval", "0.2")
    try:
        with client.writer() as w:
            w.insert("replay", np.zeros((50, 64), np.uint8))
        first = json.loads(proc.stdout.readline())
        assert first["tables"][0]["inserts_per_s"] is None  # no earlier look yet
        for _ in range(200):  # a refresh every 0.2 s; the inserts show up in one of them
            later = json.loads(proc.stdout.readline())
            table = later["tables"][0]
            assert table["inserts_per_s"] is not None and later["rate_interval_s"] > 0
            if table["size"] == 50:
                break
        assert table["size"] == 50
        assert all("used_bytes" in n and "arena_size" in n for n in later["nodes"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_table_has_memory_and_rate_columns(cluster, client, tls):
    client.create_table("replay", capacity=100, spec=((16,), "uint8"))
    out = run_cli("status", "--control", cluster.address, "--interval", "0.1")
    assert out.returncode == 0, out.stderr
    assert "used%" in out.stdout and "inserts/s" in out.stdout and "samples/s" in out.stdout
    assert "2 of 2 nodes alive" in out.stdout


@CONTROL_PLANE_ONLY
def test_system_ucx_setting_reaches_the_process_before_ucx_loads(tmp_path, tls):
    # No system UCX here: libucx falls back to the wheel's. The setting must be
    # in the environment before UCX loads: the CLI reads the configuration
    # without loading UCX, and the control plane never loads it at all.
    ready = tmp_path / "control.ready"
    env = {k: v for k, v in os.environ.items() if k != "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"}
    env["DISTORE_UCX_SYSTEM_LIBRARY"] = "true"
    proc = spawn("control", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                 env=env)
    try:
        info = wait_for(lambda: ready.exists() and json.loads(ready.read_text()), 60,
                        "the control plane to start")
        assert info["pid"] == proc.pid
        with open(f"/proc/{proc.pid}/maps") as fh:
            assert "libucp" not in fh.read()  # nothing for the setting to be too late for
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A storage node loads UCX, after the CLI has applied the configuration.
    probe = (
        "import os, sys\n"
        "from distore_ucx import cli\n"
        "args = cli.build_parser().parse_args(['node', '--control', '127.0.0.1:1'])\n"
        "cli._apply_ucx(cli.settings_from(args), None)\n"
        "assert 'libucx' not in sys.modules\n"
        "assert os.environ['RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY'] == 'true'\n"
        "import distore_ucx.storage.node\n"
        "assert 'libucx' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_checkpoint_command_writes_one_and_status_shows_it(tmp_path):
    ckpt = str(tmp_path / "store.ckpt")
    with ds.LocalCluster(nodes=1, arena_bytes=16 << 20, log_level="WARNING",
                         env={"UCX_TLS": "tcp"}, checkpoint=ckpt,
                         checkpoint_interval=0) as cluster, ds.connect(cluster.address) as c:
        c.create_table("replay", capacity=50, spec=((16,), "uint8"))
        with c.writer() as w:
            w.insert("replay", np.zeros((7, 16), np.uint8))
        out = run_cli("checkpoint", "--control", cluster.address)
        assert out.returncode == 0, out.stderr
        assert f"checkpoint written to {ckpt}: 7 items in 1 tables" in out.stdout
        assert os.path.exists(ckpt) and os.path.exists(ckpt + ".ids")
        status = run_cli("status", "--control", cluster.address, "--interval", "0")
        assert "last checkpoint: 7 items" in status.stdout and "(on demand)" in status.stdout


def test_checkpoint_without_a_checkpoint_file_and_restore_without_one_are_clear_errors():
    with ds.LocalCluster(nodes=1, arena_bytes=16 << 20, log_level="WARNING",
                         env={"UCX_TLS": "tcp"}) as cluster:
        out = run_cli("checkpoint", "--control", cluster.address)
    assert out.returncode == 2
    assert "has no checkpoint file: start it with --checkpoint PATH" in out.stderr
    out = run_cli("control", "--port", "0", "--restore")
    assert out.returncode == 2 and "--restore needs --checkpoint PATH" in out.stderr


@pytest.mark.parametrize("tls", ["sm"], indirect=True)
def test_demo_live_lines_and_summary_name_their_figures_alike(tls, tmp_path):
    # The live lines showed ~4.3 GB/s and the summary 6.7: one counts the
    # verification, the other the sample path alone; both now say which.
    out = run_cli("demo", "--seconds", "2", "--arena", "256MiB", "--capacity", "1500",
                  timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    live = [ln for ln in text.splitlines() if "items/s" in ln and "GB/s" in ln]
    assert live and all("GB/s with verification" in ln for ln in live), live
    summary = next(ln for ln in text.splitlines() if ln.startswith("summary:"))
    assert "with verification (the live lines' figure)" in summary
    assert "the sample path alone" in summary


@pytest.mark.parametrize("tls", ["sm"], indirect=True)
def test_demo_on_ctrl_c_prints_what_it_measured_without_tracebacks(tls, tmp_path):
    # Issue 51: exit 130 with a traceback from its writer process, and no summary.
    out_file = tmp_path / "out.txt"
    with open(out_file, "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "distore_ucx", "demo", "--seconds", "120", "--nodes", "1",
             "--arena", "256MiB", "--capacity", "1500"], stdout=out, stderr=err,
            cwd=tmp_path, start_new_session=True,  # a terminal's ^C reaches the whole group
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: "GB/s with verification" in out_file.read_text(), 120,
                 "the demo's first live line", state=lambda: out_file.read_text())
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text, err = out_file.read_text(), (tmp_path / "err.txt").read_text()
    assert proc.returncode == 130, text + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    summary = next(ln for ln in text.splitlines() if ln.startswith("summary:"))
    assert "items in" in summary and "wrong keys 0" in summary, summary
    assert "interrupted (^C): the figures so far" in text
