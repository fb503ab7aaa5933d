"""Deploy a store on a Ray cluster: `distore_ucx.ray.deploy(...)` (extra `ray`).

The control plane runs as a detached, named actor; each chosen Ray node gets
one storage node actor pinned to it (node affinity, not soft). Each actor
runs the ordinary `distore control` / `distore node` process beside itself,
so signals, logs and graceful shutdown are those of the CLI, and the process
dies with its actor. Ray schedules; distore does not.

>>> import ray, distore_ucx.ray as dray
>>> ray.init(address="auto")
>>> address = dray.deploy(arena="64GiB")          # one storage node per Ray node
>>> client = distore_ucx.connect(address)
>>> dray.shutdown()                               # nodes deregister, then stop
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

from .config import check_file, load_file, parse_size
from .errors import ConfigError, ConnectionFailed, DistoreError, install_hint
from .roles import spawn, wait_ready

log = logging.getLogger(__name__)

DEFAULT_NAME = "distore"


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"distore_ucx.ray needs Ray: {install_hint('ray')}"
        ) from None
    return ray


class _Service:
    """One `distore` process run by an actor; stopped with SIGTERM when asked,
    and killed by the kernel if the actor's worker dies (PR_SET_PDEATHSIG)."""

    def __init__(self, role: str, args: list[str], env: Mapping[str, str], timeout: float):
        self.role = role
        self.dir = tempfile.mkdtemp(prefix=f"distore-ray-{role}-")
        full_env = dict(os.environ, **env)
        full_env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        full_env["PYTHONUNBUFFERED"] = "1"
        self.process = spawn(role, args, self.dir, full_env)
        self.log_path = self.process.log_path
        self.info = wait_ready(self.process, timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a node deregisters first), then SIGKILL after `timeout` s."""
        popen = self.process.popen
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        return popen.returncode


class ControlPlaneActor:
    """Ray actor running `distore control` on its node."""

    def __init__(self, args: list[str], env: dict, timeout: float):
        ray = _ray()
        self.service = _Service("control", ["control", *args], env, timeout)
        port = self.service.info["address"].rsplit(":", 1)[1]
        self._address = f"{ray.util.get_node_ip_address()}:{port}"

    def address(self) -> str:
        """HOST:PORT that nodes, writers and learners use."""
        return self._address

    def metrics_target(self) -> str | None:
        """HOST:PORT of the control plane's Prometheus /metrics (None: off)."""
        port = self.service.info.get("metrics_port")
        return f"{self._address.rsplit(':', 1)[0]}:{port}" if port else None

    def pid(self) -> int:
        """Process id of the control plane process."""
        return self.service.process.pid

    def log_tail(self, lines: int = 50) -> str:
        """The last lines of the control plane's log."""
        return self.service.process.log_tail(lines)

    def stop(self) -> int | None:
        """Stop the control plane (SIGTERM); its exit code."""
        return self.service.stop()


class StorageNodeActor:
    """Ray actor running `distore node` on the Ray node it is pinned to."""

    def __init__(self, control: str, args: list[str], env: dict, timeout: float):
        ray = _ray()
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.host = host = ray.util.get_node_ip_address()
        self.service = _Service(
            "node",
            ["node", "--control", control, "--host", host,
             "--name", f"ray-{self.ray_node_id[:12]}", *args],
            env, timeout,
        )

    def describe(self) -> dict:
        """Ray node id, distore node id, address and pid of this storage node."""
        port = self.service.info.get("metrics_port")
        return {"ray_node_id": self.ray_node_id, "pid": self.service.process.pid,
                **self.service.info, "metrics_target": f"{self.host}:{port}" if port else None}

    def log_tail(self, lines: int = 50) -> str:
        """The last lines of the storage node's log."""
        return self.service.process.log_tail(lines)

    def stop(self) -> int | None:
        """Stop the storage node (SIGTERM: it deregisters, drains, exits)."""
        return self.service.stop()


def _alive_nodes(ray) -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def _choose(ray, nodes: int | Sequence[str] | None) -> list[str]:
    alive = _alive_nodes(ray)
    if nodes is None:
        return alive
    if isinstance(nodes, int):
        if not 0 < nodes <= len(alive):
            raise ConfigError(f"asked for {nodes} storage nodes, but the Ray cluster has "
                              f"{len(alive)} live nodes")
        return alive[:nodes]
    chosen = list(nodes)
    missing = [n for n in chosen if n not in alive]
    if missing:
        raise ConfigError(f"Ray nodes {missing} are not alive members of this cluster "
                          f"(alive: {alive})")
    if len(set(chosen)) != len(chosen):
        raise ConfigError("each Ray node can hold one storage node; the list has duplicates")
    return chosen


def deploy(
    nodes: int | Sequence[str] | None = None,
    *,
    arena: int | str = "4GiB",
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    control_node: str | None = None,
    port: int = 0,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    hugepages: bool = True,
    heartbeat_timeout: float | None = None,
    startup_timeout: float = 120.0,
    token_file: str | None = None,
    insecure: bool = False,
    metrics_port: int | str | None = None,
    node_metrics_port: int | str | None = None,
    disk: str | None = None,
    disk_size: int | str | None = None,
    metrics_host: str = "0.0.0.0",
) -> str:
    """Start a store on the connected Ray cluster; returns the control plane address.

    nodes: None (every live Ray node), a count (that many of them) or a list
    of Ray node ids; each gets one storage node with an `arena`-sized arena.
    control_node: the Ray node id for the control plane (default: any).
    config_file: a distore.toml present at that path on every Ray node; flags
    given here win over it. env: extra environment (UCX_TLS, UCX_NET_DEVICES,
    ...) for every process. Actors are detached and named `{name}-control`,
    `{name}-node-{i}`: they outlive the driver until `shutdown(name)`.
    token_file: the store's shared secret, a file at that path on every Ray
    node (clients pass it to `connect(address, token_file=...)`); also taken
    from `env`'s or this process's DISTORE_TOKEN_FILE, or config_file's
    [auth] token_file. The processes listen on their Ray node's address, so
    a token is required unless `insecure=True` (trusted, isolated networks).
    metrics_port / node_metrics_port: the control plane's and each storage
    node's Prometheus /metrics port (None: config_file's or distore's
    default, 9770 and 9771; 0: none; "auto": any free port);
    `metrics_targets(name)` lists what to scrape. metrics_host: where they
    listen; every interface by default, so that those targets can be scraped
    from another Ray node ("127.0.0.1": this host only). /metrics has no
    token and names tables and hosts: keep its ports inside the cluster.
    disk / disk_size: a disk tier for every storage node, a file at that
    path on its Ray node's local NVMe (--disk, --disk-size).

    >>> address = deploy(nodes=4, arena="64GiB", env={"UCX_TLS": "rc,sm,self"})
    """
    ray = _ray()
    if not ray.is_initialized():
        raise ConfigError("connect to a Ray cluster first: ray.init(address=...)")
    parse_size(arena)
    if config_file:
        problems = check_file(config_file)
        if problems:
            raise ConfigError(f"{config_file}: " + "; ".join(map(str, problems)))
    chosen = _choose(ray, nodes)
    _refuse_a_second(ray, name, namespace)
    env = dict(env or {})
    common = _auth_args(config_file, env, token_file, insecure)
    control_args = _control_args(common, port, heartbeat_timeout, metrics_port, metrics_host)
    node_args = _node_args(common, arena, hugepages, disk, disk_size, node_metrics_port,
                           metrics_host)
    address = _start(ray, name, namespace, control_node, chosen, control_args, node_args, env,
                     startup_timeout)
    log.info("store %r deployed on Ray: control plane %s, %d storage nodes", name, address,
             len(chosen))
    return address


def _refuse_a_second(ray, name: str, namespace: str | None) -> None:
    """A store of that name already deployed is named, with what to do."""
    try:
        existing = ray.get_actor(f"{name}-control", namespace=namespace)
    except ValueError:
        return
    raise ConfigError(
        f"a store named {name!r} is already deployed at "
        f"{ray.get(existing.address.remote())}: use address({name!r}) or "
        f"shutdown({name!r}) first"
    )


def _auth_args(config_file: str | None, env: dict, token_file: str | None,
               insecure: bool) -> list[str]:
    """The flags every process of the store takes: the config file, and the
    token file (or --insecure); a store without either is refused, as its
    processes listen on their Ray nodes' addresses."""
    common = ["--config", config_file] if config_file else []
    token_file = (token_file or env.get("DISTORE_TOKEN_FILE")
                  or os.environ.get("DISTORE_TOKEN_FILE"))
    if token_file:
        common += ["--token-file", os.path.abspath(token_file)]
    elif insecure:
        common += ["--insecure"]
    elif not (config_file and load_file(config_file)[0].get("auth.token_file")):
        raise ConfigError(
            "deploy: the control plane and storage nodes listen on their Ray nodes' "
            "addresses, reachable by anyone on that network: pass token_file= (a file "
            "holding the shared secret at that path on every Ray node; make one with "
            "(umask 077; head -c 32 /dev/urandom | base64 > FILE)), or insecure=True on a "
            "trusted, isolated network"
        )
    return common


def _control_args(common: list[str], port: int, heartbeat_timeout: float | None,
                  metrics_port: int | str | None, metrics_host: str) -> list[str]:
    """The flags of the control plane: where it listens, its heartbeat
    timeout and its /metrics."""
    args = [*common, "--host", "0.0.0.0", "--port", str(port)]
    if heartbeat_timeout is not None:
        args += ["--heartbeat-timeout", str(heartbeat_timeout)]
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    return args + ["--metrics-host", metrics_host]


def _node_args(common: list[str], arena: int | str, hugepages: bool, disk: str | None,
               disk_size: int | str | None, metrics_port: int | str | None,
               metrics_host: str) -> list[str]:
    """The flags of each storage node: its arena, pages, disk tier and /metrics."""
    args = [*common, "--arena", str(arena)] + ([] if hugepages else ["--no-hugepages"])
    if disk:
        if not disk_size:
            raise ConfigError("deploy: disk= needs disk_size= (e.g. disk_size=\"1TiB\")")
        args += ["--disk", disk, "--disk-size", str(parse_size(disk_size))]
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    return args + ["--metrics-host", metrics_host]


def _start(ray, name: str, namespace: str | None, control_node: str | None, chosen: list[str],
           control_args: list[str], node_args: list[str], env: dict,
           startup_timeout: float) -> str:
    """Start the control plane's actor, then a storage node's on each chosen
    Ray node, each pinned there; the control plane's address once every one
    is up. On any failure every actor started is killed."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def pinned(ray_node: str | None) -> dict:
        opts = {"lifetime": "detached", "num_cpus": 0, "max_restarts": 0,
                "namespace": namespace}
        if ray_node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray_node, soft=False)
        return opts

    control = ray.remote(ControlPlaneActor).options(
        name=f"{name}-control", **pinned(control_node)
    ).remote(control_args, env, startup_timeout)
    started = [control]
    try:
        address = ray.get(control.address.remote(), timeout=startup_timeout + 30)
        actors = [
            ray.remote(StorageNodeActor).options(name=f"{name}-node-{i}", **pinned(node))
            .remote(address, node_args, env, startup_timeout)
            for i, node in enumerate(chosen)
        ]
        started += actors
        ray.get([a.describe.remote() for a in actors], timeout=startup_timeout + 30)
    except BaseException as exc:
        for actor in reversed(started):
            ray.kill(actor, no_restart=True)
        if isinstance(exc, ray.exceptions.RayError):
            raise ConnectionFailed(f"deploying store {name!r} on Ray failed: {exc}") from exc
        raise
    return address


def address(name: str = DEFAULT_NAME, namespace: str | None = None) -> str:
    """The control plane address of a store deployed with `deploy(name=...)`."""
    ray = _ray()
    try:
        control = ray.get_actor(f"{name}-control", namespace=namespace)
    except ValueError:
        raise ConfigError(f"no store named {name!r} is deployed on this Ray cluster") from None
    return ray.get(control.address.remote())


def storage_nodes(name: str = DEFAULT_NAME, namespace: str | None = None) -> list[dict]:
    """Ray node id, distore node id, address and pid of each storage node of `name`."""
    ray = _ray()
    return ray.get([a.describe.remote() for a in _node_actors(ray, name, namespace)])


def metrics_targets(name: str = DEFAULT_NAME, namespace: str | None = None) -> list[str]:
    """HOST:PORT of every /metrics endpoint of the store `name` (control plane
    first), for a Prometheus static_configs or file_sd target list."""
    ray = _ray()
    try:
        control = ray.get_actor(f"{name}-control", namespace=namespace)
    except ValueError:
        raise ConfigError(f"no store named {name!r} is deployed on this Ray cluster") from None
    targets = [ray.get(control.metrics_target.remote())]
    targets += [n["metrics_target"] for n in storage_nodes(name, namespace)]
    return [t for t in targets if t]


def _node_actors(ray, name: str, namespace: str | None) -> list:
    actors, i = [], 0
    while True:
        try:
            actors.append(ray.get_actor(f"{name}-node-{i}", namespace=namespace))
        except ValueError:
            return actors
        i += 1


def shutdown(name: str = DEFAULT_NAME, namespace: str | None = None) -> None:
    """Stop a deployed store: storage nodes first (they deregister), then the
    control plane; the actors are removed. Safe to call twice."""
    ray = _ray()
    nodes = _node_actors(ray, name, namespace)
    try:
        control = ray.get_actor(f"{name}-control", namespace=namespace)
    except ValueError:
        control = None
    errors = []
    for group in (nodes, [control] if control is not None else []):
        try:
            ray.get([a.stop.remote() for a in group], timeout=60)
        except ray.exceptions.RayError as exc:  # an actor already gone: kill the rest anyway
            errors.append(exc)
        for actor in group:
            ray.kill(actor, no_restart=True)
    if errors:
        log.warning("store %r: %d actors failed to stop cleanly: %s", name, len(errors),
                    errors[0])


__all__ = ["deploy", "address", "storage_nodes", "metrics_targets", "shutdown", "ControlPlaneActor",
           "StorageNodeActor", "DistoreError"]
