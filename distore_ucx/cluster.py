"""LocalCluster: a control plane and storage nodes as real local processes.

For tests, the demo, benchmarks and trying things out. Every process it
starts is stopped when the cluster is closed (SIGTERM, then SIGKILL), and
also if the parent dies (PR_SET_PDEATHSIG), so a failed test leaves nothing
running. The environment, including UCX settings such as UCX_TLS, reaches
every process.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .config import parse_size
from .errors import ConnectionFailed
from .roles import Process, spawn, wait_ready

log = logging.getLogger(__name__)


class LocalCluster:
    """A control plane and `nodes` storage nodes on this machine.

    Nothing starts until `start()`, or entering it as a context manager;
    `stop()` (or leaving the `with`) stops every process and removes the
    log folder it made. Times are in seconds; a setting left None keeps the
    default of the ``distore`` flag of the same name.

    >>> with ds.LocalCluster(nodes=2, arena_bytes=1 << 30) as cluster:
    ...     client = ds.connect(cluster.address)

    Args:
        nodes: Storage nodes to start.
        arena_bytes: Each node's arena, in bytes or as a size ("64MiB").
        host: The address every process listens on.
        env: Variables added to this process's environment for the children
            (UCX settings such as UCX_TLS reach them anyway).
        log_dir: Where the processes' logs go (default: a new temporary
            folder, removed by `stop()` unless DISTORE_KEEP_LOGS=1).
        startup_timeout: How long each process may take to serve.
        hugepages: Back the arenas with 2 MiB pages where possible.
        prefault: Make every page of each arena at the node's start (what
            ``distore node`` does unless ``--no-prefault``): inserts then take
            no first-touch fault. Off by default here: a cluster on one
            machine takes an arena's memory only as items arrive.
        heartbeat_timeout: A node silent this long is unresponsive
            (``--heartbeat-timeout``).
        log_level: The processes' log level.
        token_file: The store's shared secret (``--token-file``).
        checkpoint: The control plane's checkpoint file; then
            `restart_control(restore=True)` brings the store back.
        checkpoint_interval: ``--checkpoint-interval``.
        restore_grace: ``--restore-grace``.
        reconnect_timeout: The nodes' ``--reconnect-timeout``.
        metrics: Every process serves Prometheus /metrics on a free port
            (`metrics_urls()`).
        disk_bytes: Give every node a disk tier of that size, its file
            ``node<i>.tier`` in `disk_dir`.
        disk_dir: Where the tier files go (default: the log folder).
        disk_staging: ``--disk-staging``.
        unresponsive_grace: ``--unresponsive-grace``.
        lease_timeout: ``--lease-timeout``.

    Attributes:
        address: The control plane's "host:port", once started.
        control: The control plane's `Process`.
        nodes: The storage nodes' processes, in the order started.
        log_dir: The folder of the processes' logs.
    """

    def __init__(
        self,
        nodes: int = 2,
        arena_bytes: int | str = 1 << 30,
        host: str = "127.0.0.1",
        env: dict | None = None,
        log_dir: str | None = None,
        startup_timeout: float = 60.0,
        hugepages: bool = False,
        prefault: bool = False,
        heartbeat_timeout: float = 2.0,
        log_level: str = "INFO",
        token_file: str | None = None,
        checkpoint: str | None = None,
        checkpoint_interval: float | None = None,
        restore_grace: float | None = None,
        reconnect_timeout: float | None = None,
        metrics: bool = False,
        disk_bytes: int | str = 0,
        disk_dir: str | None = None,
        disk_staging: int | str = 0,
        unresponsive_grace: float | None = None,
        lease_timeout: float | None = None,
    ):
        """See the class docstring; nothing starts here."""
        self.n_nodes = nodes
        self.disk_bytes = parse_size(disk_bytes)
        self.disk_staging = parse_size(disk_staging)
        self._disk_dir = disk_dir
        self.arena_bytes = parse_size(arena_bytes)
        self.host = host
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        if host.startswith("127.") or host == "localhost":
            # Keep UCX's TCP traffic on the loopback device too (it would
            # otherwise also open lanes over every other interface).
            self.env.setdefault("UCX_NET_DEVICES", "lo")
        self.env["PYTHONUNBUFFERED"] = "1"
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="distore-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        # A script that never stops its cluster (or ends on ^C) leaves no
        # folder behind either: its processes die with it (PR_SET_PDEATHSIG).
        self._at_exit = functools.partial(_remove_log_dir, self.log_dir)
        if self._own_log_dir:
            atexit.register(self._at_exit)
        self.startup_timeout = startup_timeout
        self.hugepages = hugepages
        self.prefault = prefault
        self.heartbeat_timeout = heartbeat_timeout
        self.log_level = log_level
        self.token_file = token_file
        self.checkpoint = checkpoint
        self.checkpoint_interval = checkpoint_interval
        self.restore_grace = restore_grace
        self.unresponsive_grace = unresponsive_grace
        self.lease_timeout = lease_timeout
        self.reconnect_timeout = reconnect_timeout
        self.metrics = metrics
        self.port = 0  # the control plane's, fixed after its first start
        self._control_runs = 0
        self.control: Process | None = None
        self.nodes: list[Process] = []
        self.address: str | None = None

    # -- lifecycle -------------------------------------------------------
    def start(self) -> LocalCluster:
        """Start the control plane and the nodes side by side; wait until all
        are serving. A process's start is mostly its own (importing, loading
        UCX, mapping an arena): the control plane gets a free port first, so
        that the nodes, told it, start with it (a node joins once it serves).

        Returns:
            The cluster itself.

        Raises:
            ConnectionFailed: A process exited while starting (the message
                holds its log's end); every process is stopped then.
            Timeout: A process did not serve within `startup_timeout`.
        """
        try:
            if self.port == 0 and _is_ipv4(self.host):
                nodes = self._start_side_by_side()
            elif self.port:
                control = self._spawn_control()
                self.address = f"{self.host}:{self.port}"
                nodes = [self._spawn_node() for _ in range(self.n_nodes)]
                self._control_ready(control)
            else:  # the control plane's port is known once it serves
                self.start_control()
                nodes = [self._spawn_node() for _ in range(self.n_nodes)]
            for proc in nodes:
                proc.info = self._wait_ready(proc)
        except BaseException:
            self.stop()
            raise
        log.info("local cluster up: control plane %s, %d nodes, logs in %s",
                 self.address, self.n_nodes, self.log_dir)
        return self

    def _start_side_by_side(self) -> list[Process]:
        """Start the control plane on a free port and the nodes beside it;
        the nodes, not waited for. A port another process took between the
        pick and the control plane's bind (an outgoing connection's ephemeral
        port, another cluster's pick) is picked again: the nodes told the
        old one are stopped and started anew."""
        attempt = 1
        while True:
            self.port = _free_port(self.host)
            control = self._spawn_control()
            self.address = f"{self.host}:{self.port}"
            nodes = [self._spawn_node() for _ in range(self.n_nodes)]
            try:
                self._control_ready(control)
                return nodes
            except ConnectionFailed as exc:
                if attempt == PORT_PICKS or "already in use" not in str(exc).lower():
                    raise
            log.info("port %d was taken before the control plane bound it; picking another "
                     "(%d of %d)", self.port, attempt + 1, PORT_PICKS)
            for proc in nodes:
                proc.popen.kill()
                proc.popen.wait()
                self.nodes.remove(proc)
            attempt += 1

    def start_control(self, restore: bool = False) -> Process:
        """Start the control plane (on the port it had before, if it ran
        already) and wait until it serves.

        Args:
            restore: Start it from the checkpoint file.

        Returns:
            Its `Process`.

        Raises:
            ConnectionFailed: It exited while starting.
            Timeout: It did not serve within `startup_timeout`.
        """
        proc = self._spawn_control(restore)
        self._control_ready(proc)
        return proc

    def _spawn_control(self, restore: bool = False) -> Process:
        """Start the control plane (see start_control); not waited for."""
        args = ["control", "--host", self.host, "--port", str(self.port),
                "--heartbeat-timeout", str(self.heartbeat_timeout)]
        if self.checkpoint:
            args += ["--checkpoint", os.path.abspath(self.checkpoint)]
        for flag, value in (("--checkpoint-interval", self.checkpoint_interval),
                            ("--restore-grace", self.restore_grace),
                            ("--unresponsive-grace", self.unresponsive_grace),
                            ("--lease-timeout", self.lease_timeout)):
            if value is not None:
                args += [flag, str(value)]
        if restore:
            args.append("--restore")
        args += ["--metrics-port", "auto" if self.metrics else "0"]
        role = "control" if not self._control_runs else f"control-{self._control_runs}"
        self._control_runs += 1
        proc = self._spawn(role, args)
        self.control = proc
        return proc

    def _control_ready(self, proc: Process) -> None:
        """Wait until the control plane `proc` serves; its address."""
        proc.info = self._wait_ready(proc)
        self.address = proc.info["address"]
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill_control(self, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to the control plane (default SIGKILL) and wait for it.

        Returns:
            Its exit code.
        """
        if self.control.alive():
            self.control.popen.send_signal(sig)
        return self.control.popen.wait(timeout=30)

    def restart_control(self, restore: bool = True, sig: int = signal.SIGKILL) -> Process:
        """Stop the control plane with `sig` and start it again on the same
        port, from its checkpoint when `restore`; nodes re-join by themselves.

        Returns:
            The new control plane's `Process`; raises as `start_control`.
        """
        self.kill_control(sig)
        return self.start_control(restore)

    def add_node(self, arena_bytes: int | None = None,
                 extra_args: list[str] | None = None) -> Process:
        """Start one more storage node and wait until it has registered.

        Args:
            arena_bytes: Its arena (default: the cluster's `arena_bytes`).
            extra_args: More ``distore node`` flags (``["--no-write-protect"]``).

        Returns:
            Its `Process`; raises as `start`.
        """
        proc = self._spawn_node(arena_bytes, extra_args)
        proc.info = self._wait_ready(proc)
        return proc

    def _spawn_node(self, arena_bytes: int | None = None,
                    extra_args: list[str] | None = None) -> Process:
        """Start one more storage node (see add_node); not waited for."""
        args = ["node", "--control", self.address, "--host", self.host,
                "--arena", str(arena_bytes or self.arena_bytes), *(extra_args or [])]
        if not self.hugepages:
            args.append("--no-hugepages")
        args.append("--prefault" if self.prefault else "--no-prefault")
        if self.reconnect_timeout is not None:
            args += ["--reconnect-timeout", str(self.reconnect_timeout)]
        args += ["--metrics-port", "auto" if self.metrics else "0"]
        if self.disk_bytes and "--disk" not in args:
            args += ["--disk", self.disk_path(len(self.nodes)), "--disk-size",
                     str(self.disk_bytes)]
            if self.disk_staging:
                args += ["--disk-staging", str(self.disk_staging)]
        proc = self._spawn(f"node{len(self.nodes)}", args)
        self.nodes.append(proc)
        return proc

    def disk_path(self, index: int) -> str:
        """The path of storage node `index`'s tier file (with `disk_bytes`)."""
        return os.path.join(self._disk_dir or self.log_dir, f"node{index}.tier")

    def kill_node(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to storage node `index` (default SIGKILL) and reap it."""
        proc = self.nodes[index]
        if proc.alive():
            proc.popen.send_signal(sig)
            proc.popen.wait(timeout=30)

    def stop(self) -> None:
        """Stop every process: SIGTERM, then SIGKILL after 5 s. Idempotent."""
        procs = [p for p in self.nodes + ([self.control] if self.control else []) if p]
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", p.role, p.pid)
                p.popen.kill()
                p.popen.wait()
        if self._own_log_dir:
            atexit.unregister(self._at_exit)
            _remove_log_dir(self.log_dir)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def metrics_urls(self) -> dict[str, str]:
        """The /metrics URLs of the running processes.

        Returns:
            ``{role: "http://HOST:PORT/metrics"}`` (roles "control", "node0",
            ...); empty unless the cluster was made with metrics=True.
        """
        procs = ([self.control] if self.control else []) + self.nodes
        return {p.role: f"http://{self.host}:{p.info['metrics_port']}/metrics" for p in procs
                if p.alive() and p.info and p.info.get("metrics_port")}

    def pids(self) -> list[int]:
        """Process ids of the control plane and nodes still running."""
        procs = ([self.control] if self.control else []) + self.nodes
        return [p.pid for p in procs if p.alive()]

    # -- internals -------------------------------------------------------
    def _spawn(self, role: str, args: list[str]) -> Process:
        args = ["--log-level", self.log_level, *args]
        if self.token_file:
            args += ["--token-file", os.path.abspath(self.token_file)]
        return spawn(role, args, self.log_dir, self.env)

    def _wait_ready(self, proc: Process) -> dict:
        return wait_ready(proc, self.startup_timeout)


def _is_ipv4(host: str) -> bool:
    """Whether `host` is a dotted IPv4 address."""
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return host.count(".") == 3


# times start() picks a free port for the control plane, at most
PORT_PICKS = 5


def _free_port(host: str) -> int:
    """A TCP port free on `host` now (the kernel's pick; a process may take
    it before the control plane binds it: start() then picks another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _remove_log_dir(path: str) -> None:
    """Remove a cluster's own log folder, unless DISTORE_KEEP_LOGS=1."""
    if os.environ.get("DISTORE_KEEP_LOGS") != "1":
        shutil.rmtree(path, ignore_errors=True)
