"""Several hosts, made of network namespaces on this machine.

A control plane, two storage nodes and a learner each run in a namespace of
their own, joined by veth pairs to a bridge in a fifth namespace, on a
private 10.x network that exists only inside them; UCX goes over tcp on the
veth devices. After inserting and sampling with verified bytes, one storage
node's link is taken down: the learner must go on sampling from the other
within 3 s and never receive a wrong byte. Needs root (CI is root); skips
with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SUBNET = "10.211.77"  # private, and only inside the namespaces made here
ROLES = {"ctl": 1, "n1": 2, "n2": 3, "lrn": 4}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            kids = [int(k) for k in fh.read().split()]
    except OSError:  # gone
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _wait_link_up(namespaces: list[str], timeout: float = 10.0) -> None:
    """Wait until eth0 is operationally up in every namespace. The kernel
    sets a link's operational state (IFF_RUNNING) a moment after `link set
    up`, and until then UCX finds no usable device there ("No such device")."""
    deadline = time.monotonic() + timeout
    for ns in namespaces:
        while True:
            state = _ip("netns", "exec", ns, "cat", "/sys/class/net/eth0/operstate").stdout
            if state.strip() == "up":
                break
            if time.monotonic() > deadline:
                pytest.fail(f"eth0 in namespace {ns} is still {state.strip()!r} after {timeout} s")
            time.sleep(0.05)  # polling the kernel's link state, with a deadline


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    probe = f"dsprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """Namespaces, one per role, on one bridge; processes started in them."""

    tag: str
    tmp: str
    procs: list[tuple[str, subprocess.Popen, str]] = field(default_factory=list)
    made: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"ds{self.tag}{role}"

    def addr(self, role: str) -> str:
        return f"{SUBNET}.{ROLES[role]}"

    def build(self) -> None:
        bridge = self.ns("br")
        for name in [bridge] + [self.ns(r) for r in ROLES]:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for role in ROLES:
            # One end, "eth0", in the host's namespace; the other on the bridge.
            _ip("-n", bridge, "link", "add", f"p{role}", "type", "veth",
                "peer", "name", "eth0", "netns", self.ns(role))
            _ip("-n", bridge, "link", "set", f"p{role}", "master", "br0", "up")
            _ip("-n", self.ns(role), "addr", "add", f"{self.addr(role)}/24", "dev", "eth0")
            _ip("-n", self.ns(role), "link", "set", "eth0", "up")
        _wait_link_up([self.ns(r) for r in ROLES])

    def fast_tcp_failure_detection(self, role: str) -> None:
        """Make TCP in `role`'s namespace give up on a silent peer within about
        a second instead of ~15 min: UCX's tcp transport learns of a cut link only
        from its socket, and a read cannot be cancelled before that."""
        _ip("netns", "exec", self.ns(role), "sysctl", "-q", "-w", "net.ipv4.tcp_retries2=1")

    def link(self, role: str, state: str) -> None:
        _ip("-n", self.ns(role), "link", "set", "eth0", state)

    def start(self, role: str, args: list[str]) -> subprocess.Popen:
        # Every process listens on a non-loopback address: the store needs a token.
        token = os.path.join(self.tmp, "token")
        if not os.path.exists(token):
            with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
                fh.write(os.urandom(24).hex())
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0", PYTHONUNBUFFERED="1",
                   DISTORE_TOKEN_FILE=token,
                   UCX_WARN_UNUSED_ENV_VARS="n", UCX_LOG_LEVEL="error",
                   # Find a cut-off peer fast. UCX probes each endpoint every 0.5 s
                   # (data that TCP then retransmits, and gives up on per
                   # tcp_retries2), and TCP keepalive covers connections with
                   # nothing outstanding (whole seconds: the kernel's unit).
                   UCX_KEEPALIVE_INTERVAL="500ms", UCX_TCP_KEEPIDLE="1s",
                   UCX_TCP_KEEPINTVL="1s", UCX_TCP_KEEPCNT="1")
        log = os.path.join(self.tmp, f"{role}.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                # A pid namespace too, as on separate machines: the learner then
                # treats each node as remote (UCX peer-failure detection on).
                ["ip", "netns", "exec", self.ns(role), "unshare", "--pid", "--fork",
                 "--kill-child=SIGTERM", sys.executable, *args],
                stdout=subprocess.PIPE if role == "lrn" else out, stderr=out,
                stdin=subprocess.DEVNULL, env=env, cwd=self.tmp,
            )
        self.procs.append((role, proc, log))
        return proc

    def log(self, role: str) -> str:
        for r, _, path in self.procs:
            if r == role:
                with open(path, errors="replace") as fh:
                    return fh.read()[-4000:]
        return ""

    def wait_file(self, path: str, timeout: float, role: str) -> dict:
        deadline = time.monotonic() + timeout
        proc = next(p for r, p, _ in self.procs if r == role)
        while not os.path.exists(path):
            if proc.poll() is not None:
                pytest.fail(f"{role} exited with {proc.returncode}:\n{self.log(role)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{role} not ready within {timeout} s:\n{self.log(role)}")
            time.sleep(0.05)  # polling a file, with a deadline
        with open(path) as fh:
            return json.load(fh)

    def teardown(self) -> None:
        # SIGTERM goes to the store's process itself: `unshare --fork`, which
        # `ip netns exec` runs it under, does not pass it on (each process
        # took the whole 5 s, then a SIGKILL).
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                for pid in _descendants(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare's --kill-child then ends what it runs
                proc.wait()
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)


@pytest.fixture
def hosts(tmp_path):
    """Five namespaces (control plane, two storage nodes, learner, bridge)."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    h = Hosts(tag=str(os.getpid() % 100000), tmp=str(tmp_path))
    try:
        h.build()
        yield h
    finally:
        h.teardown()
    leftover = _ip("netns", "list").stdout
    assert f"ds{h.tag}" not in leftover, f"namespaces left behind: {leftover}"


@pytest.mark.slow
def test_learner_survives_a_storage_host_losing_its_link(hosts):
    tmp = hosts.tmp
    ctl = f"{hosts.addr('ctl')}:7700"
    hosts.start("ctl", ["-m", "distore_ucx", "control", "--host", hosts.addr("ctl"),
                        "--port", "7700", "--heartbeat-timeout", "1.0",
                        "--ready-file", f"{tmp}/ctl.ready"])
    hosts.wait_file(f"{tmp}/ctl.ready", 60, "ctl")
    for role in ("n1", "n2"):
        hosts.start(role, ["-m", "distore_ucx", "node", "--control", ctl,
                           "--host", hosts.addr(role), "--arena", "64MiB", "--no-hugepages",
                           "--name", role, "--ready-file", f"{tmp}/{role}.ready"])
    n1 = hosts.wait_file(f"{tmp}/n1.ready", 60, "n1")
    n2 = hosts.wait_file(f"{tmp}/n2.ready", 60, "n2")
    assert n1["address"].startswith(hosts.addr("n1") + ":")

    hosts.fast_tcp_failure_detection("lrn")
    learner = hosts.start("lrn", [os.path.join(HERE, "netns_learner.py"), "--control", ctl,
                                  "--ready-file", f"{tmp}/lrn.ready",
                                  "--stop-file", f"{tmp}/lrn.stop"])
    hosts.wait_file(f"{tmp}/lrn.ready", 90, "lrn")

    # The learner's namespace cannot reach the other hosts except over the bridge.
    down_at = time.time()
    hosts.link("n1", "down")
    # Sample on for 5 s after the cut (polled, not slept through blindly).
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and learner.poll() is None:
        time.sleep(0.1)
    open(f"{tmp}/lrn.stop", "w").close()
    stdout, _ = learner.communicate(timeout=60)
    # Back up for the teardown: cut off, n1 would wait out its 5 s to
    # deregister from the control plane and then be killed.
    hosts.link("n1", "up")
    assert learner.returncode == 0, hosts.log("lrn")
    result = json.loads(stdout.strip().splitlines()[-1])

    assert result["bad"] == 0, "the learner received wrong bytes"
    assert sorted(result["nodes_before"]) == sorted([n1["node_id"], n2["node_id"]])
    assert result["nodes_after"] == [n2["node_id"]], "the cut-off node is still listed as live"
    after = [t for t in result["ok_times"] if t > down_at]
    assert after, f"no batch after the link went down; errors: {result['errors'][-3:]}"
    gaps = [b - a for a, b in zip([down_at] + after, after)]
    print(f"longest gap after the cut: {max(gaps):.2f} s; {len(after)} batches after it")
    assert max(gaps) < 3.0, f"sampling stalled {max(gaps):.2f} s after the link went down"
    assert after[-1] - down_at > 4.0  # and it went on, to the end
    assert len(after) > 20


# --------------------------------------------------------------------------- two hosts

PAIR_SUBNET = "10.211.78"  # private, and only inside the two namespaces made here


@dataclass
class TwoHosts:
    """Two namespaces joined by one veth pair: "store" (control plane and
    storage nodes) at .1 and "client" (writer and learner) at .2; each
    process also gets a pid namespace of its own, as on separate machines."""

    tag: str
    tmp: str
    procs: list[tuple[str, subprocess.Popen, str]] = field(default_factory=list)
    made: list[str] = field(default_factory=list)

    def ns(self, side: str) -> str:
        return f"ds{self.tag}{side}"

    def addr(self, side: str) -> str:
        return f"{PAIR_SUBNET}.{1 if side == 'store' else 2}"

    def build(self) -> None:
        for side in ("store", "client"):
            _ip("netns", "add", self.ns(side))
            self.made.append(self.ns(side))
            _ip("-n", self.ns(side), "link", "set", "lo", "up")
        _ip("-n", self.ns("store"), "link", "add", "eth0", "type", "veth",
            "peer", "name", "eth0", "netns", self.ns("client"))
        for side in ("store", "client"):
            _ip("-n", self.ns(side), "addr", "add", f"{self.addr(side)}/24", "dev", "eth0")
            _ip("-n", self.ns(side), "link", "set", "eth0", "up")
        _wait_link_up([self.ns("store"), self.ns("client")])

    def start(self, role: str, side: str, args: list[str]) -> subprocess.Popen:
        # Listening on a non-loopback address: the store needs a token.
        token = os.path.join(self.tmp, "token")
        if not os.path.exists(token):
            with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
                fh.write(os.urandom(24).hex())
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0",
                   PYTHONUNBUFFERED="1",
                   DISTORE_TOKEN_FILE=token, UCX_WARN_UNUSED_ENV_VARS="n",
                   UCX_LOG_LEVEL="error")
        log = os.path.join(self.tmp, f"{role}.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(side), "unshare", "--pid", "--fork",
                 "--kill-child=SIGTERM", sys.executable, *args],
                stdout=subprocess.PIPE if side == "client" else out, stderr=out,
                stdin=subprocess.DEVNULL, env=env, cwd=self.tmp)
        self.procs.append((role, proc, log))
        return proc

    # The same log, wait_file and teardown as Hosts.
    log = Hosts.log
    wait_file = Hosts.wait_file
    teardown = Hosts.teardown


@pytest.fixture
def two_hosts(tmp_path):
    """Two namespaces on one veth pair (store, client), always deleted."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    h = TwoHosts(tag=str(os.getpid() % 100000) + "p", tmp=str(tmp_path))
    try:
        h.build()
        yield h
    finally:
        h.teardown()
    leftover = _ip("netns", "list").stdout
    assert f"ds{h.tag}" not in leftover, f"namespaces left behind: {leftover}"


@pytest.mark.slow
def test_writer_and_learner_on_another_host_get_every_byte_dense(two_hosts):
    """The learner and a writer in one namespace, the store in another, over
    UCX tcp on the veth pair: every sampled item holds its key's bytes, and
    every field of every batch is one C-contiguous [batch, *shape] array."""
    h, tmp = two_hosts, two_hosts.tmp
    ctl = f"{h.addr('store')}:7700"
    h.start("ctl", "store", ["-m", "distore_ucx", "control", "--host", h.addr("store"),
                             "--port", "7700", "--ready-file", f"{tmp}/ctl.ready"])
    h.wait_file(f"{tmp}/ctl.ready", 60, "ctl")
    for name in ("n1", "n2"):
        h.start(name, "store", ["-m", "distore_ucx", "node", "--control", ctl,
                                "--host", h.addr("store"), "--arena", "32MiB",
                                "--no-hugepages", "--name", name,
                                "--ready-file", f"{tmp}/{name}.ready"])
    for name in ("n1", "n2"):
        h.wait_file(f"{tmp}/{name}.ready", 60, name)

    width, n_items = 112_896, 256  # 110 KB items: UCX rendezvous sizes, over both nodes
    client = h.start("client", "client", [
        os.path.join(HERE, "netns_client.py"), "--control", ctl, "--width", str(width),
        "--items", str(n_items), "--batches", "40", "--batch-size", "32"])
    try:
        stdout, _ = client.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        client.kill()
        client.communicate()
        pytest.fail(f"the client did not finish within 240 s:\n{h.log('client')}")
    assert client.returncode == 0, h.log("client")
    result = json.loads(stdout.strip().splitlines()[-1])
    print(f"client: {result}")

    assert result["bad_batches"] == 0, "a sampled item held bytes not its key's"
    assert result["not_dense"] == [], f"fields not C-contiguous: {result['not_dense']}"
    assert result["sampled_items"] == 40 * 32
    assert result["distinct_keys"] > 32 and result["max_key"] < n_items
    # Both sides saw each other as remote: UCX over tcp, no mapping or CMA;
    # 110 KB items go as active messages over the nodes' insert listeners.
    assert result["writer_paths"] and all(p == "ucx active messages (UCX_TLS=tcp)"
                                          for p in result["writer_paths"]), result
    # No RDMA between the namespaces: the nodes send samples as active messages.
    assert result["learner_paths"] and all(p.startswith("ucx-am:") and "tcp" in p
                                           for p in result["learner_paths"]), result
