"""What a new user still trips on in the first hour (issue 31): each test
does what the user did and checks that the store answers at once, in one
line that says what to do."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
from helpers import wait_for

import distore_ucx as ds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, timeout=60, cwd=None, env=None):
    # Never from the repository root unless asked: that would import the sources.
    return subprocess.run([sys.executable, "-m", "distore_ucx", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or tempfile.gettempdir(),
                          env=env, check=False)


@pytest.fixture(scope="module")
def store():
    with ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="WARNING") as cluster:
        yield cluster


# -- 1. ^C on a script using LocalCluster ----------------------------------------

# The learner holds a read lease and has nothing in flight: closing it on ^C
# releases that lease, to a control plane the same ^C has just stopped.
INTERRUPTED = """
import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stacks on a hang
import numpy as np
import distore_ucx as ds
cluster = ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="WARNING").start()
client = ds.connect(cluster.address)
client.create_table("t", capacity=100, spec=((8,), "uint8"))
with client.writer() as w:
    w.insert("t", np.zeros((10, 8), np.uint8))
with client.learner("t", batch_size=4, sample_ahead=1) as learner:
    learner.sample()
    print("sampling", cluster.log_dir, flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_ctrl_c_on_a_local_cluster_script_exits_at_once():
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(INTERRUPTED)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir(),
        start_new_session=True,  # a terminal's ^C reaches the whole process group
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        said, log_dir = proc.stdout.readline().split()
        assert said == "sampling", proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Hung: show where (every thread's stack, and what is left of the group).
            left = subprocess.run(["ps", "-o", "pid,stat,wchan:20,args", "-g", str(proc.pid)],
                                  capture_output=True, text=True, check=False).stdout
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"still running 60 s after ^C; processes:\n{left}\nstacks:\n{err}")
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Before: "lost the connection ... during release; sending it again", then
    # 30 s of reconnecting and a ConnectionFailed traceback after the ^C's.
    assert took < 10, f"took {took:.0f} s to exit after ^C:\n{err}"
    assert "sending it again" not in err and "ConnectionFailed" not in err, err
    assert err.strip().splitlines()[-1] == "KeyboardInterrupt", err
    assert not os.path.exists(log_dir)  # the cluster's folder went with it


# Worker processes that catch ^C as the README says, writing flat out: the
# store stops with the same ^C, so their writers' last flush fails.
WORKERS = """
import multiprocessing as mp, sys
import numpy as np
import distore_ucx as ds

def actor(address, stop):
    try:
        with ds.connect(address) as client, client.writer(max_items=32) as w:
            while not stop.is_set():
                w.insert("t", np.zeros((32, 4096), np.uint8))
    except KeyboardInterrupt:
        pass  # the main process says it

if __name__ == "__main__":
    try:
        with ds.LocalCluster(nodes=1, arena_bytes=64 << 20, log_level="WARNING") as cluster:
            client = ds.connect(cluster.address)
            client.create_table("t", capacity=10000, spec=((4096,), "uint8"))
            ctx = mp.get_context("spawn")
            stop = ctx.Event()
            for _ in range(4):
                ctx.Process(target=actor, args=(cluster.address, stop)).start()
            learner = client.learner("t", batch_size=32)
            while client.table_info("t")["size"] < 5000:  # the workers write flat out
                learner.sample(timeout=60)
            print("running", flush=True)
            while True:
                learner.sample(timeout=30)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
"""


def test_ctrl_c_on_a_script_with_worker_processes_is_one_line(tmp_path):
    # Issue 51: six tracebacks. A writer closing on ^C (its `with` exit) raised
    # ConnectionFailed over the KeyboardInterrupt, which the worker then could
    # not catch, after warning "lost storage node ...; resending".
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=str(tmp_path), start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted"], err


# -- 2. a batch no sample request can carry ----------------------------------------

def test_a_batch_size_beyond_the_protocol_limit_is_refused_at_creation(store):
    with ds.connect(store.address) as client:
        client.create_table("big_batch", capacity=100, spec=((8,), "uint8"))
        for batch_size in (100_000, 10**6, 0):
            with pytest.raises(ds.ConfigError, match=rf"batch_size={batch_size} is outside "
                                                     r"\[1, 65536\].*protocol's limit"):
                client.learner("big_batch", batch_size=batch_size)
        assert not client._children  # nothing was made, nothing allocated


def test_a_ring_larger_than_memory_is_refused_with_its_size(store):
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    item = 2 << 20  # 65536 x 2 MiB x 3 buffers = 384 GiB: more than this machine
    if 65536 * item * 3 <= memory:
        pytest.skip("this machine could map a 384 GiB ring")
    with ds.connect(store.address) as client:
        client.create_table("huge_items", capacity=1, spec=((item,), "uint8"))
        with pytest.raises(ds.ConfigError, match=r"its ring needs 384\.\d GiB \(3 buffers of "
                                                 r"batch_size=65536 .* use a smaller "
                                                 r"batch_size \(at most \d+\)"):
            client.learner("huge_items", batch_size=65536)


# -- 3. ds.connect() to the wrong kind of port ----------------------------------------

class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (the http.server spelling)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_connect_to_an_http_port_says_so_within_a_second():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(ds.ConnectionFailed, match=r"is an HTTP server \(a /metrics "
                                                      r"port\?\), not a control plane"):
            ds.connect(f"127.0.0.1:{server.server_address[1]}")
        assert time.monotonic() - start < 5  # was 30 s, then "sent no greeting"
    finally:
        server.shutdown()
        server.server_close()


def test_connect_to_a_metrics_port_says_so(tmp_path):
    with ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="WARNING",
                         metrics=True) as cluster:
        url = cluster.metrics_urls()["control"]
        address = url.split("//")[1].split("/")[0]
        start = time.monotonic()
        with pytest.raises(ds.ConnectionFailed, match="is an HTTP server"):
            ds.connect(address)
        assert time.monotonic() - start < 5
        out = run_cli("status", "--control", address)
        assert out.returncode == 2 and "is an HTTP server" in out.stderr
        assert "Traceback" not in out.stderr


def test_connect_to_a_storage_node_says_use_the_control_plane(store):
    node = store.nodes[0].info["address"]
    start = time.monotonic()
    with pytest.raises(ds.ConnectionFailed, match=r"is a storage node, not a control plane: "
                                                  r"use the control plane's address"):
        ds.connect(node)
    assert time.monotonic() - start < 5


def test_a_silent_peer_that_greets_late_is_still_served():
    """A control plane too busy to greet within the probe time still gets its
    connection (made again, without the probe)."""
    from distore_ucx import protocol
    from distore_ucx.transport import rpc
    from distore_ucx.transport.frames import send_frame

    listener = socket.create_server(("127.0.0.1", 0))
    served = []

    def late_server():
        for attempt in range(2):
            conn, _ = listener.accept()
            if attempt == 0:
                time.sleep(rpc.PROBE_AFTER + 0.5)  # greets after the probe went out
            send_frame(conn, protocol.hello(None, "control plane"))
            served.append(conn)

    thread = threading.Thread(target=late_server, daemon=True)
    thread.start()
    try:
        client = rpc.RpcClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout=10,
                               expect="control plane")
        assert client.connected and client.session == 1
        client.close()
        thread.join(10)
        assert len(served) == 2
    finally:
        for conn in served:
            conn.close()
        listener.close()


# -- 4. config check agrees with start; the checkpoint folder ---------------------------

def _token(tmp_path):
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    return token


def test_config_check_of_the_example_names_what_start_would_refuse(tmp_path):
    example = os.path.join(REPO, "cluster", "distore.toml")
    out = run_cli("config", "check", example)
    if os.path.exists("/etc/distore/token"):
        pytest.skip("this machine has /etc/distore/token")
    assert out.returncode == 1
    assert "token_file: cannot read token file /etc/distore/token" in out.stderr
    # Without a token in the file, the check refuses what `distore control` refuses.
    text = open(example).read().replace('token_file = "/etc/distore/token"', "")
    bare = tmp_path / "bare.toml"
    bare.write_text(text)
    out = run_cli("config", "check", str(bare))
    assert out.returncode == 1
    assert "[control] host: the control plane would listen on 0.0.0.0 and refuses to " \
           "without a token: set token_file under [auth]" in out.stderr
    start = run_cli("control", "--config", str(bare), "--port", "0", "--metrics-port", "0")
    assert start.returncode == 2 and "without a token" in start.stderr


def test_control_makes_a_missing_checkpoint_folder(tmp_path):
    token = _token(tmp_path)
    folder = tmp_path / "state" / "distore"
    cfg = tmp_path / "distore.toml"
    example = open(os.path.join(REPO, "cluster", "distore.toml")).read()
    cfg.write_text(example.replace("/etc/distore/token", str(token))
                   .replace("/var/lib/distore/store.ckpt", str(folder / "store.ckpt")))
    out = run_cli("config", "check", str(cfg))
    assert out.returncode == 0, out.stderr
    ready = tmp_path / "ready"
    # Loopback here: the test never listens beyond this machine.
    proc = subprocess.Popen(
        [sys.executable, "-m", "distore_ucx", "control", "--config", str(cfg), "--host",
         "127.0.0.1", "--port", "0", "--metrics-port", "0", "--ready-file", str(ready)],
        cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 60,
                 "the control plane to start")
        assert proc.poll() is None, proc.stdout.read()
        assert folder.is_dir()
    finally:
        proc.terminate()
        log, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, log
    assert f"made the checkpoint folder {folder}" in log
    assert (folder / "store.ckpt").exists()  # written on SIGTERM
    assert "previous one is intact" not in log


def test_a_checkpoint_folder_that_cannot_be_made_is_one_plain_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can make any folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        out = run_cli("control", "--port", "0", "--metrics-port", "0", "--checkpoint",
                      str(locked / "sub" / "store.ckpt"))
        assert out.returncode == 2
        assert f"the checkpoint folder {locked / 'sub'} does not exist and cannot be made" \
            in out.stderr and "Traceback" not in out.stderr
    finally:
        locked.chmod(0o700)


# -- 5. a second control plane on a port in use ----------------------------------------

def test_a_port_in_use_is_one_line(store):
    port = store.address.rsplit(":", 1)[1]
    out = run_cli("control", "--port", port, "--metrics-port", "0")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "OSError" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("distore control:")]
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


# -- 6. distore bench after `pip install .` -----------------------------------------------

def test_bench_finds_the_checkout_it_is_run_from(tmp_path, monkeypatch):
    # `pip install .` puts the package in site-packages and leaves perf/ in the
    # checkout; from inside the checkout, bench finds it.
    from distore_ucx import bench
    from distore_ucx.bench import find_perf_dir

    site = tmp_path / "site-packages" / "distore_ucx"
    site.mkdir(parents=True)
    monkeypatch.setattr(bench, "__file__", str(site / "bench.py"))
    checkout = tmp_path / "checkout"
    (checkout / "distore_ucx").mkdir(parents=True)
    shutil.copytree(os.path.join(REPO, "perf"), checkout / "perf")

    inside = checkout / "perf"
    assert find_perf_dir(cwd=str(inside)) == inside.resolve()
    assert find_perf_dir(cwd=str(checkout)) == inside.resolve()
    with pytest.raises(ds.ConfigError, match=r"is not inside a checkout\. Run it from inside "
                                             r"the repository's clone, or pass --perf-dir"):
        find_perf_dir(cwd=str(tmp_path))


@pytest.mark.slow
def test_bench_quick_runs_from_inside_the_checkout(tmp_path):
    out = run_cli("bench", "--quick", "--only", "latency", "--out", str(tmp_path / "out"),
                  cwd=os.path.join(REPO, "perf"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["results"][0]["exit_code"] == 0 and summary["results"][0]["rows"] > 0


# -- 8. the token recipe and the missing-token error ------------------------------------

def test_the_readme_token_recipe_makes_a_file_only_its_owner_reads(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    recipe = next(line.split("#")[0].strip() for line in readme.splitlines()
                  if "/dev/urandom" in line)
    subprocess.run(["bash", "-c", recipe], cwd=tmp_path, check=True)
    mode = stat.S_IMODE((tmp_path / "token").stat().st_mode)
    assert mode == 0o600, oct(mode)
    assert len((tmp_path / "token").read_bytes().strip()) >= 16


def test_status_without_a_token_names_the_flag_first(tmp_path):
    token = _token(tmp_path)
    with ds.LocalCluster(nodes=0, log_level="WARNING", token_file=str(token)) as cluster:
        out = run_cli("status", "--control", cluster.address)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "requires a token: pass --token-file FILE" in line, line
    assert line.index("--token-file") < line.index("token_file=")


# -- 9. a node started before its control plane ------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_node_started_before_the_control_plane_waits_for_it(tmp_path):
    port = _free_port()
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    node_ready, control_ready = tmp_path / "node.ready", tmp_path / "control.ready"
    node_log = tmp_path / "node.log"
    with open(node_log, "w") as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "distore_ucx", "node", "--control", f"127.0.0.1:{port}",
             "--arena", "4MiB", "--no-hugepages", "--metrics-port", "0",
             "--reconnect-timeout", "60", "--ready-file", str(node_ready)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    control = None
    try:
        wait_for(lambda: "tries to join for 60 s" in node_log.read_text(), 60,
                 "the node to say it waits for the control plane",
                 state=lambda: node_log.read_text())
        assert node.poll() is None  # before: it exited at once
        control = subprocess.Popen(
            [sys.executable, "-m", "distore_ucx", "control", "--port", str(port),
             "--metrics-port", "0", "--ready-file", str(control_ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            cwd=tempfile.gettempdir())
        wait_for(node_ready.exists, 60, "the node to join", state=lambda: node_log.read_text())
        with ds.connect(f"127.0.0.1:{port}") as client:
            assert [n["alive"] for n in client.nodes()] == [True]
    finally:
        for proc in (node, control):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def test_a_node_whose_control_plane_never_comes_exits_saying_so(tmp_path):
    out = run_cli("node", "--control", f"127.0.0.1:{_free_port()}", "--arena", "4MiB",
                  "--no-hugepages", "--metrics-port", "0", "--reconnect-timeout", "1",
                  env=dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo"))
    assert out.returncode == 3, out.stderr
    assert "tries to join for 1 s" in out.stderr
    assert "within 1 s; node" in out.stderr and "Traceback" not in out.stderr


def _node_at(address: str, *flags: str):
    start = time.monotonic()
    out = run_cli("node", "--control", address, "--arena", "4MiB", "--no-hugepages",
                  "--metrics-port", "0", *flags,
                  env=dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo"))
    return out, time.monotonic() - start


def test_a_node_given_an_http_port_says_so_at_once():
    # Issue 51: silent for 10 s, then "no valid greeting ...: " with no reason,
    # retried until the reconnect window ended.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out, took = _node_at(f"127.0.0.1:{server.server_address[1]}",
                             "--reconnect-timeout", "60")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 2, out.stderr
    assert ("is an HTTP server (a /metrics port?), not a control plane: use the control "
            "plane's address") in out.stderr
    assert "tries to join" not in out.stderr and "Traceback" not in out.stderr
    assert took < 15, took  # the probe answers after 1 s; the rest is the node's start


def test_a_node_given_a_storage_node_port_says_use_the_control_plane(store):
    # Issue 51: "does not serve 'register_node': is the peer a distore-ucx
    # client of the same version?"
    out, _ = _node_at(store.nodes[0].info["address"])
    assert out.returncode == 2, out.stderr
    assert ("is a storage node, not a control plane: use the control plane's address"
            in out.stderr), out.stderr
    assert "does not serve" not in out.stderr and "Traceback" not in out.stderr


def test_a_node_at_a_silent_peer_exits_when_its_window_ends():
    # Something listens but never greets (and is no HTTP server): the node
    # tries for --reconnect-timeout s, not 10 s per attempt beyond it
    # (issue 51: 20.5 s with --reconnect-timeout 8).
    listener = socket.create_server(("127.0.0.1", 0))  # accepts nothing: silent
    try:
        out, took = _node_at(f"127.0.0.1:{listener.getsockname()[1]}",
                             "--reconnect-timeout", "3")
    finally:
        listener.close()
    assert out.returncode == 3, out.stderr
    assert "sent no greeting" in out.stderr and "within 3 s; node" in out.stderr
    assert took < 3 + 6, took  # the window and the node's start (was 20 s)


# -- 11. small inconsistencies -------------------------------------------------------------

def test_status_says_the_pages_the_node_log_says(tmp_path):
    with ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="INFO",
                         hugepages=True, log_dir=str(tmp_path)) as cluster:
        out = run_cli("status", "--control", cluster.address, "--json", "--interval", "0")
        (node,) = json.loads(out.stdout)["nodes"]
        log = (tmp_path / "node0.log").read_text()
    # Asked for hugepages, a node on a host without them logs 4 KiB pages;
    # status said "thp" then.
    logged = {"hugetlb": "2 MiB (reserved hugepages)", "thp": "2 MiB (transparent hugepages)",
              "4k": "4 KiB"}
    assert f"arena on {logged[node['page_kind']]} pages" in log, (node, log)


def test_config_show_into_head_ends_quietly(tmp_path):
    # `distore config show | head`, with head gone before the first write.
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([sys.executable, "-m", "distore_ucx", "config", "show"],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                             cwd=tempfile.gettempdir())
    finally:
        os.close(write)
    assert out.returncode == 141  # as a tool killed by SIGPIPE
    assert "BrokenPipeError" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_fifo_remover_is_shown_without_alpha(store):
    with ds.connect(store.address) as client:
        info = client.create_table("shown", capacity=10, spec=((8,), "uint8"),
                                   sampler=ds.Prioritized(0.6), remover=ds.Fifo())
    assert info["remover"] == {"kind": "fifo"}
    assert info["sampler"] == {"kind": "prioritized", "alpha": 0.6}


# -- 7. the torchrl extra, installed from the checkout ------------------------------------

def test_the_torchrl_extra_pins_torch_as_the_examples_do():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    torch = [r for r in extras["examples"] if r.startswith("torch==")]
    assert torch and torch[0] in extras["torchrl"]  # no multi-GB download, no backtracking
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "pip install '.[torchrl]'" in readme  # the package is on no index
    assert "pip install 'distore-ucx[torchrl]'" not in readme


def test_a_node_with_the_wrong_token_still_fails_at_once(tmp_path):
    token, wrong = _token(tmp_path), tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32).hex().encode())
    wrong.chmod(0o600)
    with ds.LocalCluster(nodes=0, log_level="WARNING", token_file=str(token)) as cluster:
        start = time.monotonic()
        out = run_cli("node", "--control", cluster.address, "--arena", "4MiB",
                      "--no-hugepages", "--metrics-port", "0", "--token-file", str(wrong),
                      env=dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo"))
    assert out.returncode == 2 and "refused our token" in out.stderr, out.stderr
    assert "tries to join" not in out.stderr and time.monotonic() - start < 30


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_writer_paths_forget_a_node_that_left(make_cluster, tls):
    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=10_000, spec={"x": ((1024,), "uint8")})
        writer = client.writer(max_items=10)
        for _ in range(4):  # batches go to both nodes
            writer.insert("t", {"x": np.zeros((10, 1024), np.uint8)})
        writer.flush()
        ids = [n.info["node_id"] for n in cluster.nodes]
        assert set(writer.paths) == set(ids)
        cluster.kill_node(0)
        wait_for(lambda: all(n["node_id"] != ids[0] or n["state"] == "gone"
                             for n in client.status()["nodes"]), 10, "the node to be gone")
        deadline = time.monotonic() + 10
        while ids[0] in writer.paths and time.monotonic() < deadline:
            writer.insert("t", {"x": np.zeros((10, 1024), np.uint8)})  # lists the nodes again
            writer.flush()
            time.sleep(0.2)
        assert set(writer.paths) == {ids[1]}, writer.paths
        writer.close()
