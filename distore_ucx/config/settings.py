"""The settings table: every setting's name, parser, default, flag and variable.

This table is the one place a setting's default is written. The typed
configurations of the processes (:mod:`.roles`) take their defaults from it,
the CLI makes its flags from it (cli.py), distore.toml is checked against it
(:mod:`.toml_file`) and docs/deployment.md shows it (:func:`settings_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import MAX_SAMPLE
from .values import (
    at_least,
    to_address,
    to_bool,
    to_float,
    to_int,
    to_level,
    to_metrics_port,
    to_options,
    to_port,
    to_size,
    to_str,
    to_tables,
    to_token_file,
)

METRICS_PORT_CONTROL = 9770  # `distore control` serves /metrics here unless told
METRICS_PORT_NODE = 9771  # `distore node`


@dataclass(frozen=True)
class Setting:
    """One setting: dotted name (= TOML place), parser, default, flag, variable."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    flag: str | None
    commands: tuple[str, ...]  # subcommands that take the flag
    help: str
    env: str = ""

    @property
    def section(self) -> str:
        """The TOML section ("node" of "node.arena")."""
        return self.name.split(".")[0]

    @property
    def key(self) -> str:
        """The key in its section ("arena" of "node.arena")."""
        return self.name.split(".", 1)[1]

    @property
    def variable(self) -> str:
        """Its environment variable (DISTORE_NODE_ARENA unless named)."""
        return self.env or "DISTORE_" + self.name.replace(".", "_").upper()


# Parsers several settings share: refused below what the processes accept.
_time_over_0 = at_least(0, to_float, True, "a time")  # seconds, > 0
_time = at_least(0, to_float, False, "a time")  # seconds, >= 0
_arena = at_least(1 << 20, to_size, False, "an arena", "1MiB")

_NODE, _CTRL, _STATUS = ("node",), ("control",), ("status",)
_CLIENTS = ("node", "status", "checkpoint")  # commands that talk to a control plane

SETTINGS: tuple[Setting, ...] = (
    Setting("control.address", to_address, None, "--control", _CLIENTS,
            "control plane HOST:PORT, as nodes and clients reach it", env="DISTORE_CONTROL"),
    Setting("control.host", to_str, "127.0.0.1", "--host", _CTRL,
            "address the control plane listens on (default loopback only; another one "
            "needs a token file or --insecure)", env="DISTORE_HOST"),
    Setting("control.port", to_port, 7700, "--port", _CTRL,
            "control plane port (0 = any free port)", env="DISTORE_PORT"),
    Setting("control.heartbeat_timeout", _time_over_0, 2.0, "--heartbeat-timeout", _CTRL,
            "a storage node silent this long is unresponsive: clients route around it, "
            "its items stay (s)"),
    Setting("control.unresponsive_grace", _time_over_0, 60.0,
            "--unresponsive-grace", _CTRL,
            "an unresponsive storage node keeps its items this long; silent longer, it is "
            "gone and its items leave the tables (s)"),
    Setting("control.lease_timeout", _time_over_0, 30.0, "--lease-timeout", _CTRL,
            "a sampled slot is protected this long at most (s)"),
    Setting("control.seed", to_int, None, "--seed", _CTRL, "seed the samplers (tests)"),
    Setting("control.checkpoint", to_str, "", "--checkpoint", _CTRL,
            "checkpoint file: tables, priorities and use counts are written there "
            "periodically, on SIGTERM and on `distore checkpoint` (\"\" = none)"),
    Setting("control.checkpoint_interval", _time, 60.0, "--checkpoint-interval", _CTRL,
            "seconds between periodic checkpoints (0 = only on SIGTERM and on demand)"),
    Setting("control.restore", to_bool, False, "--restore", _CTRL,
            "start from the checkpoint file; storage nodes re-send the items they hold"),
    Setting("control.restore_grace", _time_over_0, 60.0, "--restore-grace", _CTRL,
            "after --restore, how long nodes have to re-send their items before the "
            "checkpointed items no node re-sent are dropped (s)"),
    Setting("control.max_sample", to_int, MAX_SAMPLE, "--max-sample", _CTRL,
            "items one sample request may ask for (at most 65536)"),
    Setting("control.max_leased_items", to_int, 1 << 20, "--max-leased-items", _CTRL,
            "leased items one connection may hold at once; a sample over it fails with "
            "LimitExceeded (learners release each batch with their next request)"),
    Setting("control.max_writer_ids", to_int, 1024, "--max-writer-ids", _CTRL,
            "writers one connection may register (writer ids are never reused)"),
    Setting("control.max_frame", to_size, 256 << 20, "--max-frame", _CTRL,
            "largest message the control plane reads from an authenticated peer, e.g. "
            "256MiB (before authenticating, only the handshake's few hundred bytes)"),
    Setting("control.max_pending", to_int, 64, "--max-pending", _CTRL,
            "requests of one connection waiting for answers before the control plane "
            "stops reading it"),
    Setting("control.metrics_port", to_metrics_port, METRICS_PORT_CONTROL, "--metrics-port",
            _CTRL, "port of the control plane's Prometheus /metrics, on --metrics-host (0 = none, "
            "auto = any free port)"),
    Setting("control.metrics_host", to_str, "127.0.0.1", "--metrics-host", _CTRL,
            "address of the control plane's /metrics (default loopback only: it names "
            "tables, nodes and hosts to anyone who can reach it; 0.0.0.0 = every interface)"),
    Setting("auth.token_file", to_token_file, "", "--token-file", ("control",) + _CLIENTS,
            "file holding the shared secret every connection must prove (HMAC challenge)",
            env="DISTORE_TOKEN_FILE"),
    Setting("auth.insecure", to_bool, False, "--insecure", ("control", "node"),
            "listen on a non-loopback address without a token file: anyone who can reach "
            "it can read and write the store (trusted, isolated networks only)"),
    Setting("node.arena", _arena, 4 << 30, "--arena", _NODE, "arena size, e.g. 64GiB",
            env="DISTORE_ARENA"),
    Setting("node.disk", to_str, "", "--disk", _NODE,
            "file of the node's disk tier on local NVMe (created and preallocated; "
            "default: none). Items move there when the arena is full"),
    Setting("node.disk_size", to_size, 0, "--disk-size", _NODE,
            "size of the disk tier, e.g. 1TiB (with --disk)"),
    Setting("node.disk_staging", to_size, 0, "--disk-staging", _NODE,
            "arena bytes kept for sampled cold items until their lease ends "
            "(0 = a quarter of the arena; with --disk)"),
    Setting("node.host", to_str, "", "--host", _NODE,
            "address writers and learners reach this node at (default: the one that routes "
            "to the control plane)"),
    Setting("node.port", to_port, 0, "--port", _NODE, "insert port (0 = any free)"),
    Setting("node.name", to_str, "", "--name", _NODE, "node name in status output"),
    Setting("node.hugepages", to_bool, True, "--hugepages", _NODE,
            "back the arena with 2 MiB pages where possible (--no-hugepages: never)"),
    Setting("node.prefault", to_bool, True, "--prefault", _NODE,
            "make every page of the arena at start, so inserts take no first-touch fault and "
            "a host without the memory fails at start (--no-prefault: as items arrive)"),
    Setting("node.write_protect", to_bool, True, "--write-protect", _NODE,
            "peers read the arena through a read-only mapping, so a remote write faults "
            "(--no-write-protect: one writable mapping, transparent hugepages)"),
    Setting("node.drain_timeout", _time, 2.0, "--drain-timeout", _NODE,
            "on SIGTERM, after deregistering, reads in flight get this long (s)"),
    Setting("node.reconnect_timeout", _time, 120.0, "--reconnect-timeout", _NODE,
            "after losing the control plane, keep the arena and try to re-join this long "
            "before exiting (s)"),
    Setting("node.metrics_port", to_metrics_port, METRICS_PORT_NODE, "--metrics-port", _NODE,
            "port of the node's Prometheus /metrics, on --metrics-host (0 = none, auto = any free "
            "port)"),
    Setting("node.metrics_host", to_str, "127.0.0.1", "--metrics-host", _NODE,
            "address of the node's /metrics (default loopback only: it names tables and "
            "hosts to anyone who can reach it; 0.0.0.0 = every interface)"),
    Setting("ucx.tls", to_str, None, "--ucx-tls", ("control", "node", "status"),
            "UCX_TLS for this process, e.g. rc,sm,self (InfiniBand) or tcp"),
    Setting("ucx.net_devices", to_str, None, "--ucx-net-devices", ("control", "node", "status"),
            "UCX_NET_DEVICES for this process, e.g. mlx5_0:1"),
    Setting("ucx.system_library", to_bool, None, "--ucx-system-library",
            ("control", "node", "status"),
            "load the system UCX (with verbs) instead of the wheel's "
            "(sets RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY)"),
    Setting("ucx.options", to_options, {}, "--ucx-options", ("control", "node", "status"),
            "more UCX options as JSON, e.g. '{\"RNDV_THRESH\": \"8192\"}'"),
    Setting("log.level", to_level, "INFO", "--log-level", (), "DEBUG, INFO, WARNING, ERROR"),
    Setting("tables", to_tables, (), "--tables", _CTRL,
            "tables to create at start, as a JSON list of {name, capacity, spec, ...}"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def _show_default(s: Setting) -> str:
    v = s.default
    if v is None or v == "" or v == () or v == {}:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if s.parse is to_size or s.name == "node.arena":
        if v == 0:
            return "0"
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v % (1 << shift) == 0:
                return f"{v >> shift}{unit}"
    return f"`{v}`" if isinstance(v, str) else str(v)


def settings_table() -> str:
    """The settings as the Markdown table of docs/deployment.md (which holds
    it between markers; tests/unit/test_docs.py keeps the two equal).

    Regenerate with: python -c "from distore_ucx.config import settings_table as t; print(t())"
    """
    flags = [s.flag for s in SETTINGS]
    rows = ["| TOML | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        toml = f"`[{s.section}] {s.key}`" if "." in s.name else f"`[[{s.name}]]`"
        flag = f"`{s.flag}`"
        if s.parse is to_bool and s.default is True:
            flag += f" / `--no-{s.flag[2:]}`"
        if not s.commands:
            flag += " (before the subcommand)"
        elif flags.count(s.flag) > 1:
            flag += f" ({s.commands[0]})"
        text = " ".join(s.help.split()).replace("|", "\\|")
        rows.append(f"| {toml} | {flag} | `{s.variable}` | {_show_default(s)} | {text} |")
    return "\n".join(rows) + "\n"


SECTIONS = sorted({s.section for s in SETTINGS if "." in s.name})
