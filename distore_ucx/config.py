"""Typed configuration, and the one description of every setting.

A setting has one dotted name (``node.arena``), which is also its place in
``distore.toml`` (section ``[node]``, key ``arena``), one CLI flag
(``--arena``) and one environment variable (``DISTORE_ARENA``). Values are
taken in this order: CLI flag, then ``DISTORE_*`` variable, then the TOML
file, then the default. The CLI and the environment are read in one place
(cli.py) and handed to :func:`resolve`; nothing deeper reads either, and
processes get the typed dataclasses below.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .protocol import MAX_FRAME, MAX_SAMPLE
from .table_definition import TableDefinition, TableProblems
from .transport.rpc import parse_address

log = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296, '512M' -> 512000000, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{text!r} is not a size (examples: 4GiB, 512MiB, 1000000)")
    value, unit = m.group(1), (m.group(2) or "").lower()
    binary = "i" in unit
    unit = unit.replace("i", "").replace("b", "") if unit not in ("b",) else ""
    mult = 1024 ** "kmgt".index(unit) * 1024 if binary and unit else _UNITS[unit]
    return int(float(value) * mult)


MIN_TOKEN_BYTES = 16


def read_token(path: str | None) -> bytes | None:
    """The shared secret in `path` (or in $DISTORE_TOKEN_FILE when path is
    None); None when neither is set. Surrounding whitespace is ignored.

    The environment is read here in config.py, as everywhere below the
    command-line programs, so that library users get the same token the
    command line would use.

    Like ssh with a private key, it warns (logger ``distore_ucx.config``)
    when the file is readable or writable by its group or by others: anyone
    who can read the token can join the store.
    """
    path = path or os.environ.get("DISTORE_TOKEN_FILE") or None
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path!r}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"the token in {path!r} is {len(token)} bytes; use at least {MIN_TOKEN_BYTES} "
            "(e.g. (umask 077; head -c 32 /dev/urandom | base64 > FILE))"
        )
    if stat.S_ISREG(mode) and mode & 0o077:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007))
                           if mode & bits)
        log.warning("the token file %s is accessible to %s (mode %04o): anyone who can read "
                    "it can join the store. Run: chmod 600 %s", path, who,
                    stat.S_IMODE(mode), path)
    return token


@dataclass(frozen=True)
class ControlConfig:
    """Settings of the control plane process."""

    host: str = "127.0.0.1"  # loopback unless asked: see check_exposure
    port: int = 7700
    heartbeat_interval: float = 0.5  # seconds between a node's heartbeats
    heartbeat_timeout: float = 2.0  # a node silent this long is unresponsive (routed around)
    unresponsive_grace: float = 60.0  # an unresponsive node keeps its items this long
    lease_timeout: float = 30.0  # a sampled item's slot is kept this long at most
    seed: int | None = None
    tables: tuple[TableDefinition, ...] = ()  # created when the control plane starts
    token_file: str = ""  # shared secret every connection must prove ("" = none)
    checkpoint: str = ""  # checkpoint file ("" = no checkpoints)
    checkpoint_interval: float = 60.0  # seconds between periodic checkpoints (0 = none)
    restore: bool = False  # start from the checkpoint; nodes re-send their items
    restore_grace: float = 60.0  # how long nodes have to re-send them
    # What one connection may cost the control plane (docs/operations.md).
    max_sample: int = MAX_SAMPLE  # items one sample request may ask for
    max_leased_items: int = 1 << 20  # leased items one connection may hold at once
    max_writer_ids: int = 1024  # writers one connection may register
    max_frame: int = 256 << 20  # bytes of one message from an authenticated peer
    max_pending: int = 64  # requests of one connection waiting for their answers
    metrics_port: int = 0  # Prometheus /metrics (0 = none, -1 = any free port)
    # The port is nobody's choice (the default): when it is taken, warn and go on
    # without metrics rather than refuse to start.
    metrics_optional: bool = False
    # /metrics names tables and nodes: served on loopback unless asked (--metrics-host).
    metrics_host: str = "127.0.0.1"

    def __post_init__(self):
        if self.restore and not self.checkpoint:
            raise ConfigError("--restore needs --checkpoint PATH: the checkpoint file to "
                              "restore from")
        if self.unresponsive_grace <= 0:
            raise ConfigError("unresponsive_grace must be > 0 (seconds)")
        if self.checkpoint_interval < 0 or self.restore_grace <= 0:
            raise ConfigError("checkpoint_interval must be >= 0 and restore_grace > 0 (seconds)")
        if not 1 <= self.max_sample <= MAX_SAMPLE:
            raise ConfigError(f"control.max_sample is {self.max_sample}; it must be between 1 "
                              f"and {MAX_SAMPLE} (the protocol's limit)")
        if self.max_leased_items < self.max_sample:
            raise ConfigError(f"control.max_leased_items ({self.max_leased_items}) must be at "
                              f"least control.max_sample ({self.max_sample}), or no sample of "
                              "the largest size could ever be leased")
        if self.max_writer_ids < 1 or self.max_pending < 1:
            raise ConfigError("control.max_writer_ids and control.max_pending must be >= 1")
        if not 1 << 16 <= self.max_frame <= MAX_FRAME:
            raise ConfigError(f"control.max_frame is {self.max_frame} bytes; it must be "
                              f"between 64KiB and {MAX_FRAME} (1GiB)")


@dataclass(frozen=True)
class NodeConfig:
    """Settings of a storage node process."""

    control: str  # HOST:PORT of the control plane
    arena_bytes: int = 4 << 30
    host: str = ""  # address writers reach this node at; "" = the one that routes to control
    port: int = 0
    name: str = ""
    hugepages: bool = True
    drain_timeout: float = 2.0  # after deregistering, reads in flight get this long
    token_file: str = ""  # shared secret every connection must prove ("" = none)
    write_protect: bool = True  # peers read through a read-only mapping
    reconnect_timeout: float = 120.0  # keep data and retry this long after losing the control plane
    metrics_port: int = 0  # Prometheus /metrics (0 = none, -1 = any free port)
    # The port is nobody's choice (the default): when it is taken, warn and go on
    # without metrics rather than refuse to start.
    metrics_optional: bool = False
    # /metrics names tables and nodes: served on loopback unless asked (--metrics-host).
    metrics_host: str = "127.0.0.1"
    disk: str = ""  # the disk tier's file ("" = no disk tier; storage/tier.py)
    disk_bytes: int = 0  # its size
    disk_staging: int = 0  # arena bytes for staged cold items (0 = a quarter of the arena)

    def __post_init__(self):
        if self.arena_bytes < 1 << 20:
            raise ConfigError(f"arena of {self.arena_bytes} bytes is too small (at least 1MiB)")
        if self.reconnect_timeout < 0:
            raise ConfigError(f"reconnect_timeout={self.reconnect_timeout}: it must be >= 0 "
                              "seconds (how long a node keeps its data and retries after "
                              "losing the control plane)")
        if self.disk and self.disk_bytes < 1 << 20:
            raise ConfigError(f"--disk {self.disk} needs --disk-size of at least 1MiB "
                              f"(got {self.disk_bytes} bytes)")
        if self.disk_bytes and not self.disk:
            raise ConfigError("--disk-size given without --disk PATH: name the tier file")
        if self.disk and not 0 <= self.disk_staging <= self.arena_bytes - (1 << 20):
            raise ConfigError(f"--disk-staging {self.disk_staging} leaves the arena "
                              f"({self.arena_bytes} bytes) less than 1MiB for items: give a "
                              "larger --arena or a smaller --disk-staging")

    @property
    def staging_bytes(self) -> int:
        """Arena bytes kept for staged cold items (0 without a disk tier)."""
        if not self.disk:
            return 0
        return (self.disk_staging or self.arena_bytes // 4) // 4096 * 4096


@dataclass(frozen=True)
class UcxConfig:
    """UCX settings; each one set becomes a UCX_* variable of the process."""

    tls: str | None = None  # UCX_TLS, e.g. "rc,sm,self" on InfiniBand, "tcp" elsewhere
    net_devices: str | None = None  # UCX_NET_DEVICES, e.g. "mlx5_0:1"
    system_library: bool | None = None  # prefer the system UCX (verbs) over the wheel's
    options: Mapping[str, str] = field(default_factory=dict)  # more UCX_* (name without UCX_)

    def environment(self) -> dict[str, str]:
        """The environment variables these settings stand for.

        >>> UcxConfig(tls="tcp", net_devices="eth0").environment()
        {'UCX_TLS': 'tcp', 'UCX_NET_DEVICES': 'eth0'}
        """
        env = {f"UCX_{k.upper()}": str(v) for k, v in self.options.items()}
        if self.tls is not None:
            env["UCX_TLS"] = self.tls
        if self.net_devices is not None:
            env["UCX_NET_DEVICES"] = self.net_devices
        if self.system_library is not None:
            env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] = "true" if self.system_library else "false"
        return env


# -- the settings --------------------------------------------------------------

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def switch_from_env(name: str, default: bool = True) -> bool:
    """A measuring or debugging switch read from the environment
    (DISTORE_LOCAL_MAP, DISTORE_AM_INSERTS): "0", "false", "no" or "off"
    turn it off, "1", "true", "yes" or "on" on; unset or empty, `default`.
    Anything else is a ConfigError naming the variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return _to_bool(value)
    except ValueError:
        raise ConfigError(f"{name} must be 0 or 1 (or false/true, no/yes, off/on), "
                          f"got {value!r}") from None


def size_from_env(name: str, default: int) -> int:
    """A size in bytes read from the environment ("65536", "64KiB");
    unset or empty, `default`. Anything else is a ConfigError naming the
    variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


# -- switches read where they are used -------------------------------------------
# Measuring and debugging switches, and the UCX variables the runtime reports.
# Read at each call (not once at import), as the code below config did before
# they moved here, so that a process or test that sets them late is heard.

# A rendezvous message costs three control messages besides the bytes, a
# get one: below this size per-item overhead wins over the copies saved.
# perf/insert_bandwidth.py measures the crossover (docs/performance.md).
AM_MIN_ITEM_BYTES = 64 << 10


def am_inserts_enabled() -> bool:
    """True only with `DISTORE_AM_INSERTS=1` (nodes and writers).

    Off by default since 2026-11-25: the zero-copy rendezvous needs writer
    endpoints without peer-failure handling, and UCX 1.21 then crashes the
    receiving node (a segfault in ucp_do_am_single or
    ucp_proto_rndv_send_reply) when it answers a rendezvous of a writer that
    was killed mid-batch (in some runs of the kill-writer test). A node
    crash loses everything the node holds; TCP inserts by gets are slower
    (docs/performance.md), but a dying writer costs nothing."""
    return switch_from_env("DISTORE_AM_INSERTS", default=False)


def am_min_item_bytes() -> int:
    """Items smaller than this go by one-sided gets even to nodes that take
    active messages (`DISTORE_AM_MIN_ITEM`, bytes or e.g. "64KiB"; default
    AM_MIN_ITEM_BYTES)."""
    return size_from_env("DISTORE_AM_MIN_ITEM", AM_MIN_ITEM_BYTES)


def local_map_default() -> bool:
    """Whether learners map same-host arenas unless told otherwise
    (`DISTORE_LOCAL_MAP=0` turns it off, for measuring and debugging)."""
    return switch_from_env("DISTORE_LOCAL_MAP")


def disk_bounce(default: bool) -> bool:
    """Whether cold reads go through hugepage buffers (storage/tier.py
    `bounce_reads`): `DISTORE_DISK_BOUNCE=0/1` overrides the node's choice,
    `default`."""
    return switch_from_env("DISTORE_DISK_BOUNCE", default)


def sample_ahead_from_env() -> int | None:
    """Batches per control-plane request that `DISTORE_SAMPLE_AHEAD` asks
    for (a learner's `sample_ahead` left out); None when unset or empty."""
    env = os.environ.get("DISTORE_SAMPLE_AHEAD", "").strip()
    if not env:
        return None
    try:
        return int(env)
    except ValueError:
        raise ConfigError(f"DISTORE_SAMPLE_AHEAD={env!r} is not a whole number of "
                          "batches; set it to 1 (no sampling ahead) or more") from None


def ucx_tls() -> str | None:
    """UCX_TLS as the environment sets it (None when unset), which UCX reads
    too: the transport layer reports and narrows it (transport/runtime.py)."""
    return os.environ.get("UCX_TLS")


def rendezvous_config() -> dict[str, str]:
    """UCX options of clients' and storage nodes' runtimes: the `put_zcopy`
    rendezvous scheme, unless UCX_RNDV_SCHEME is set. Writers send their
    items to nodes as rendezvous messages (storage/pulls.py); with this
    scheme (the sender's choice) each goes from the staging buffer into its
    slot with no bounce copy on a software transport (TCP). It concerns
    rendezvous only: one-sided gets are unchanged."""
    if os.environ.get("UCX_RNDV_SCHEME"):
        return {}
    return {"RNDV_SCHEME": "put_zcopy"}


def _to_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"expected an integer, got {v!r}") from None


def _to_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"expected a number (seconds), got {v!r}") from None


def _to_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _to_size(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected a size such as \"4GiB\", got {v!r}")
    try:
        return parse_size(v)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _to_address(v: Any) -> str:
    try:
        parse_address(_to_str(v))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return v


def _to_level(v: Any) -> str:
    level = _to_str(v).upper()
    if level not in _LOG_LEVELS:
        raise ValueError(f"{v!r} is not a log level (one of {', '.join(_LOG_LEVELS)})")
    return level


def _to_token_file(v: Any) -> str:
    path = _to_str(v)
    if path == "":
        return path
    try:
        with open(path, "rb") as fh:
            token = fh.read(4096).strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"token file {path} is empty: put the shared secret in it")
    if len(token) < MIN_TOKEN_BYTES:  # the processes refuse it (read_token)
        raise ValueError(f"the token in {path} is {len(token)} bytes; use at least "
                         f"{MIN_TOKEN_BYTES} (e.g. (umask 077; head -c 32 /dev/urandom | "
                         "base64 > FILE))")
    return path


def _at_least(low: float, parse: Callable[[Any], Any], strict: bool, what: str,
              shown: str = ""):
    """`parse`, then refuse values below `low` (or equal to it when `strict`),
    as the processes would at start."""
    def check(v: Any) -> Any:
        value = parse(v)
        if value < low or (strict and value == low):
            raise ValueError(f"{what} must be {'>' if strict else '>='} {shown or low}, "
                             f"got {v!r}")
        return value
    return check


def _to_port(v: Any) -> int:
    port = _to_int(v)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port is 0-65535 (0 = any free port), got {v!r}")
    return port


METRICS_PORT_CONTROL = 9770  # `distore control` serves /metrics here unless told
METRICS_PORT_NODE = 9771  # `distore node`


def _to_metrics_port(v: Any) -> int:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return -1  # any free port (metrics.AUTO_PORT)
    try:
        return _to_port(v)
    except ValueError:
        raise ValueError(f"a metrics port is 0-65535 (0 = serve no metrics) or \"auto\" "
                         f"(any free port), got {v!r}") from None


def _to_options(v: Any) -> dict[str, str]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError(f"expected a JSON object of UCX options, got {v!r}") from None
    if not isinstance(v, Mapping):
        raise ValueError(f"expected a table of UCX options (NAME = \"value\"), got {v!r}")
    out = {}
    for k, val in v.items():
        name = str(k).upper().removeprefix("UCX_")
        if not re.fullmatch(r"[A-Z0-9_]+", name):
            raise ValueError(f"{k!r} is not a UCX option name (e.g. RNDV_THRESH)")
        if isinstance(val, (dict, list)):
            raise ValueError(f"UCX option {k!r}: expected a string, got {val!r}")
        out[name] = str(val).lower() if isinstance(val, bool) else str(val)
    return out


def _to_tables(v: Any) -> tuple[TableDefinition, ...]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError(f"expected a JSON list of tables, got {v!r}") from None
    if not isinstance(v, list):
        raise ValueError("expected a list of tables ([[tables]] entries)")
    out, problems, seen = [], [], set()
    for i, entry in enumerate(v):
        try:
            table = TableDefinition.from_config(entry)
        except ValueError as exc:
            problems.append(f"[[tables]] #{i + 1}: {exc}")
            continue
        if table.name in seen:
            problems.append(f"[[tables]] #{i + 1}: a second table named {table.name!r}")
        seen.add(table.name)
        out.append(table)
    if problems:
        raise ValueError("; ".join(problems))
    return tuple(out)


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
        return self.name.split(".")[0]

    @property
    def key(self) -> str:
        return self.name.split(".", 1)[1]

    @property
    def variable(self) -> str:
        return self.env or "DISTORE_" + self.name.replace(".", "_").upper()


_NODE, _CTRL, _STATUS = ("node",), ("control",), ("status",)
_CLIENTS = ("node", "status", "checkpoint")  # commands that talk to a control plane

SETTINGS: tuple[Setting, ...] = (
    Setting("control.address", _to_address, None, "--control", _CLIENTS,
            "control plane HOST:PORT, as nodes and clients reach it", env="DISTORE_CONTROL"),
    Setting("control.host", _to_str, "127.0.0.1", "--host", _CTRL,
            "address the control plane listens on (default loopback only; another one "
            "needs a token file or --insecure)", env="DISTORE_HOST"),
    Setting("control.port", _to_port, 7700, "--port", _CTRL,
            "control plane port (0 = any free port)", env="DISTORE_PORT"),
    Setting("control.heartbeat_timeout", _at_least(0, _to_float, True, "a time"), 2.0, "--heartbeat-timeout", _CTRL,
            "a storage node silent this long is unresponsive: clients route around it, "
            "its items stay (s)"),
    Setting("control.unresponsive_grace", _at_least(0, _to_float, True, "a time"), 60.0,
            "--unresponsive-grace", _CTRL,
            "an unresponsive storage node keeps its items this long; silent longer, it is "
            "gone and its items leave the tables (s)"),
    Setting("control.lease_timeout", _at_least(0, _to_float, True, "a time"), 30.0, "--lease-timeout", _CTRL,
            "a sampled slot is protected this long at most (s)"),
    Setting("control.seed", _to_int, None, "--seed", _CTRL, "seed the samplers (tests)"),
    Setting("control.checkpoint", _to_str, "", "--checkpoint", _CTRL,
            "checkpoint file: tables, priorities and use counts are written there "
            "periodically, on SIGTERM and on `distore checkpoint` (\"\" = none)"),
    Setting("control.checkpoint_interval", _at_least(0, _to_float, False, "a time"), 60.0, "--checkpoint-interval", _CTRL,
            "seconds between periodic checkpoints (0 = only on SIGTERM and on demand)"),
    Setting("control.restore", _to_bool, False, "--restore", _CTRL,
            "start from the checkpoint file; storage nodes re-send the items they hold"),
    Setting("control.restore_grace", _at_least(0, _to_float, True, "a time"), 60.0, "--restore-grace", _CTRL,
            "after --restore, how long nodes have to re-send their items before the "
            "checkpointed items no node re-sent are dropped (s)"),
    Setting("control.max_sample", _to_int, MAX_SAMPLE, "--max-sample", _CTRL,
            "items one sample request may ask for (at most 65536)"),
    Setting("control.max_leased_items", _to_int, 1 << 20, "--max-leased-items", _CTRL,
            "leased items one connection may hold at once; a sample over it fails with "
            "LimitExceeded (learners release each batch with their next request)"),
    Setting("control.max_writer_ids", _to_int, 1024, "--max-writer-ids", _CTRL,
            "writers one connection may register (writer ids are never reused)"),
    Setting("control.max_frame", _to_size, 256 << 20, "--max-frame", _CTRL,
            "largest message the control plane reads from an authenticated peer, e.g. "
            "256MiB (before authenticating, only the handshake's few hundred bytes)"),
    Setting("control.max_pending", _to_int, 64, "--max-pending", _CTRL,
            "requests of one connection waiting for answers before the control plane "
            "stops reading it"),
    Setting("control.metrics_port", _to_metrics_port, METRICS_PORT_CONTROL, "--metrics-port",
            _CTRL, "port of the control plane's Prometheus /metrics, on --metrics-host (0 = none, "
            "auto = any free port)"),
    Setting("control.metrics_host", _to_str, "127.0.0.1", "--metrics-host", _CTRL,
            "address of the control plane's /metrics (default loopback only: it names "
            "tables, nodes and hosts to anyone who can reach it; 0.0.0.0 = every interface)"),
    Setting("auth.token_file", _to_token_file, "", "--token-file", ("control",) + _CLIENTS,
            "file holding the shared secret every connection must prove (HMAC challenge)",
            env="DISTORE_TOKEN_FILE"),
    Setting("auth.insecure", _to_bool, False, "--insecure", ("control", "node"),
            "listen on a non-loopback address without a token file: anyone who can reach "
            "it can read and write the store (trusted, isolated networks only)"),
    Setting("node.arena", _at_least(1 << 20, _to_size, False, "an arena", "1MiB"), 4 << 30, "--arena", _NODE, "arena size, e.g. 64GiB",
            env="DISTORE_ARENA"),
    Setting("node.disk", _to_str, "", "--disk", _NODE,
            "file of the node's disk tier on local NVMe (created and preallocated; "
            "default: none). Items move there when the arena is full"),
    Setting("node.disk_size", _to_size, 0, "--disk-size", _NODE,
            "size of the disk tier, e.g. 1TiB (with --disk)"),
    Setting("node.disk_staging", _to_size, 0, "--disk-staging", _NODE,
            "arena bytes kept for sampled cold items until their lease ends "
            "(0 = a quarter of the arena; with --disk)"),
    Setting("node.host", _to_str, "", "--host", _NODE,
            "address writers and learners reach this node at (default: the one that routes "
            "to the control plane)"),
    Setting("node.port", _to_port, 0, "--port", _NODE, "insert port (0 = any free)"),
    Setting("node.name", _to_str, "", "--name", _NODE, "node name in status output"),
    Setting("node.hugepages", _to_bool, True, "--hugepages", _NODE,
            "back the arena with 2 MiB pages where possible (--no-hugepages: never)"),
    Setting("node.write_protect", _to_bool, True, "--write-protect", _NODE,
            "peers read the arena through a read-only mapping, so a remote write faults "
            "(--no-write-protect: one writable mapping, transparent hugepages)"),
    Setting("node.drain_timeout", _at_least(0, _to_float, False, "a time"), 2.0, "--drain-timeout", _NODE,
            "on SIGTERM, after deregistering, reads in flight get this long (s)"),
    Setting("node.reconnect_timeout", _at_least(0, _to_float, False, "a time"), 120.0, "--reconnect-timeout", _NODE,
            "after losing the control plane, keep the arena and try to re-join this long "
            "before exiting (s)"),
    Setting("node.metrics_port", _to_metrics_port, METRICS_PORT_NODE, "--metrics-port", _NODE,
            "port of the node's Prometheus /metrics, on --metrics-host (0 = none, auto = any free "
            "port)"),
    Setting("node.metrics_host", _to_str, "127.0.0.1", "--metrics-host", _NODE,
            "address of the node's /metrics (default loopback only: it names tables and "
            "hosts to anyone who can reach it; 0.0.0.0 = every interface)"),
    Setting("ucx.tls", _to_str, None, "--ucx-tls", ("control", "node", "status"),
            "UCX_TLS for this process, e.g. rc,sm,self (InfiniBand) or tcp"),
    Setting("ucx.net_devices", _to_str, None, "--ucx-net-devices", ("control", "node", "status"),
            "UCX_NET_DEVICES for this process, e.g. mlx5_0:1"),
    Setting("ucx.system_library", _to_bool, None, "--ucx-system-library",
            ("control", "node", "status"),
            "load the system UCX (with verbs) instead of the wheel's "
            "(sets RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY)"),
    Setting("ucx.options", _to_options, {}, "--ucx-options", ("control", "node", "status"),
            "more UCX options as JSON, e.g. '{\"RNDV_THRESH\": \"8192\"}'"),
    Setting("log.level", _to_level, "INFO", "--log-level", (), "DEBUG, INFO, WARNING, ERROR"),
    Setting("tables", _to_tables, (), "--tables", _CTRL,
            "tables to create at start, as a JSON list of {name, capacity, spec, ...}"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def _show_default(s: Setting) -> str:
    v = s.default
    if v is None or v == "" or v == () or v == {}:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if s.parse is _to_size or s.name == "node.arena":
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
        if s.parse is _to_bool and s.default is True:
            flag += f" / `--no-{s.flag[2:]}`"
        if not s.commands:
            flag += " (before the subcommand)"
        elif flags.count(s.flag) > 1:
            flag += f" ({s.commands[0]})"
        text = " ".join(s.help.split()).replace("|", "\\|")
        rows.append(f"| {toml} | {flag} | `{s.variable}` | {_show_default(s)} | {text} |")
    return "\n".join(rows) + "\n"
SECTIONS = sorted({s.section for s in SETTINGS if "." in s.name})


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration, and where it is."""

    where: str  # "distore.toml:12 [node] arena", "DISTORE_ARENA", "--arena"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def _toml_loads(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    return tomllib.loads(text)


def _locate(lines: list[str], section: str, key: str, index: int = 0) -> int | None:
    """Line number (1-based) of `key` in `[section]` (or the index-th `[[section]]`)."""
    current, seen = None, -1
    head = re.compile(r"^\s*\[(\[)?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    assign = re.compile(r"^\s*(\"?)" + re.escape(key) + r"\1\s*=")
    for no, line in enumerate(lines, 1):
        m = head.match(line)
        if m:
            current = m.group(2)
            if current == section and m.group(1):
                seen += 1
            if current == section and not key and (not m.group(1) or seen == index):
                return no
            continue
        if current == section and (not key or assign.match(line)) and seen in (index, -1):
            return no
    return None


def load_file(path: str) -> tuple[dict[str, Any], list[Problem]]:
    """Read and check a distore.toml: ({setting name: value}, problems).

    Every problem is reported with the file, line and key, not only the first.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        return {}, [Problem(path, f"cannot read the configuration file: {exc.strerror}")]
    try:
        doc = _toml_loads(text)
    except ValueError as exc:
        return {}, [Problem(path, f"not valid TOML: {exc}")]
    lines = text.splitlines()
    values: dict[str, Any] = {}
    problems: list[Problem] = []

    def where(section: str, key: str = "", index: int = 0) -> str:
        line = _locate(lines, section, key, index)
        loc = f"{path}:{line}" if line else path
        return f"{loc} [{section}]" + (f" {key}" if key else "")

    for section, body in doc.items():
        if section == "tables":
            if not isinstance(body, list):
                problems.append(Problem(path, "tables must be [[tables]] entries"))
                continue
            good = []
            for i, entry in enumerate(body):
                try:
                    good.append(TableDefinition.from_config(entry))
                except TableProblems as exc:
                    line = _locate(lines, "tables", "", i)
                    problems += [Problem(f"{path}:{line or '?'} [[tables]] #{i + 1}", text)
                                 for text in exc.problems]
            names = [t.name for t in good]
            for dup in sorted({n for n in names if names.count(n) > 1}):
                problems.append(Problem(f"{path} [[tables]]", f"two tables named {dup!r}"))
            values["tables"] = tuple(good)
            continue
        if section not in SECTIONS:
            hint = difflib.get_close_matches(section, SECTIONS + ["tables"], n=1)
            problems.append(Problem(
                where(section), "unknown section" + (f"; did you mean [{hint[0]}]?" if hint else
                                                     f" (known: {', '.join(SECTIONS)}, tables)")))
            continue
        if not isinstance(body, dict):
            problems.append(Problem(path, f"{section} must be a [{section}] section"))
            continue
        keys = [s.key for s in SETTINGS if s.section == section]
        for key, raw in body.items():
            setting = BY_NAME.get(f"{section}.{key}")
            if setting is None:
                hint = difflib.get_close_matches(key, keys, n=1)
                text = f"; did you mean {hint[0]!r}?" if hint else f" (known: {', '.join(keys)})"
                problems.append(Problem(where(section, key), "unknown key" + text))
                continue
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError as exc:
                problems.append(Problem(where(section, key), str(exc)))
    return values, problems


class Settings:
    """Resolved settings: value and source ("flag", "env", "file", "default")."""

    def __init__(self, values: dict[str, tuple[Any, str]], path: str | None):
        self._values = values
        self.path = path

    def __getitem__(self, name: str) -> Any:
        return self._values[name][0]

    def source(self, name: str) -> str:
        """Where the value of `name` came from."""
        return self._values[name][1]

    def as_dict(self) -> dict[str, dict]:
        """{name: {"value": v, "source": s}} (for `distore config show`)."""
        return {k: {"value": v, "source": s} for k, (v, s) in sorted(self._values.items())}

    def ucx(self) -> UcxConfig:
        """The UCX settings."""
        return UcxConfig(self["ucx.tls"], self["ucx.net_devices"], self["ucx.system_library"],
                         dict(self["ucx.options"]))

    def control(self) -> ControlConfig:
        """The control plane's configuration."""
        timeout = self["control.heartbeat_timeout"]
        if timeout <= 0 or self["control.lease_timeout"] <= 0:
            raise ConfigError("control.heartbeat_timeout and control.lease_timeout must be > 0")
        return ControlConfig(
            host=self["control.host"], port=self["control.port"],
            heartbeat_timeout=timeout, heartbeat_interval=min(0.5, timeout / 4),
            unresponsive_grace=self["control.unresponsive_grace"],
            lease_timeout=self["control.lease_timeout"], seed=self["control.seed"],
            tables=tuple(self["tables"]), token_file=self["auth.token_file"],
            checkpoint=self["control.checkpoint"],
            checkpoint_interval=self["control.checkpoint_interval"],
            restore=self["control.restore"], restore_grace=self["control.restore_grace"],
            max_sample=self["control.max_sample"],
            max_leased_items=self["control.max_leased_items"],
            max_writer_ids=self["control.max_writer_ids"], max_frame=self["control.max_frame"],
            max_pending=self["control.max_pending"],
            metrics_port=self["control.metrics_port"],
            metrics_optional=self.source("control.metrics_port") == "default",
            metrics_host=self["control.metrics_host"],
        )

    def control_address(self) -> str:
        """The control plane's address, or a ConfigError saying how to give it."""
        address = self["control.address"]
        if not address:
            raise ConfigError(
                "no control plane address: pass --control HOST:PORT, set DISTORE_CONTROL, "
                "or put address = \"HOST:PORT\" under [control] in distore.toml"
            )
        return address

    def node(self) -> NodeConfig:
        """A storage node's configuration."""
        return NodeConfig(
            control=self.control_address(), arena_bytes=self["node.arena"],
            host=self["node.host"], port=self["node.port"], name=self["node.name"],
            hugepages=self["node.hugepages"], drain_timeout=self["node.drain_timeout"],
            token_file=self["auth.token_file"], write_protect=self["node.write_protect"],
            reconnect_timeout=self["node.reconnect_timeout"],
            metrics_port=self["node.metrics_port"],
            metrics_optional=self.source("node.metrics_port") == "default",
            metrics_host=self["node.metrics_host"],
            disk=self["node.disk"], disk_bytes=self["node.disk_size"],
            disk_staging=self["node.disk_staging"],
        )


def is_loopback(host: str) -> bool:
    """Whether listening on `host` is reachable from this machine only
    ("" and 0.0.0.0 mean every interface; a name counts when every address it
    resolves to is loopback)."""
    import ipaddress
    import socket

    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_exposure(role: str, host: str, token_file: str, insecure: bool) -> str | None:
    """Refuse to listen beyond loopback without a token, unless `insecure`.

    Returns the warning to log loudly when a non-loopback address is served
    without a token because `insecure` was given; None when all is well.
    Raises ConfigError otherwise, saying what to pass.
    """
    if is_loopback(host) or token_file:
        return None
    where = host or "every interface"
    if not insecure:
        raise ConfigError(
            f"refusing to run the {role} on {where} without a token: anyone who can reach "
            "it could read and overwrite the store. Pass --token-file FILE (the same file "
            "to every process; make one with: "
            "(umask 077; head -c 32 /dev/urandom | base64 > FILE)), "
            "or --insecure on a trusted, isolated network, or listen on loopback "
            "(--host 127.0.0.1)"
        )
    return (f"INSECURE: the {role} listens on {where} without a token (--insecure): anyone "
            "who can reach this address can read, insert and delete data. Use --token-file "
            "FILE outside trusted, isolated networks")


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str],
            path: str | None = None) -> Settings:
    """Every setting's value: CLI flag > DISTORE_* variable > TOML file > default.

    `flags` maps setting names to values given on the command line (None or
    absent = not given); `environ` is the process environment, passed in by
    the CLI. Raises ConfigError listing every problem, each with its place.

    >>> s = resolve({"node.arena": "1GiB"}, {"DISTORE_CONTROL": "10.0.0.1:7700"})
    >>> s.node().arena_bytes, s.node().control
    (1073741824, '10.0.0.1:7700')
    """
    file_values, problems = load_file(path) if path else ({}, [])
    values: dict[str, tuple[Any, str]] = {}
    for s in SETTINGS:
        raw = flags.get(s.name)
        try:
            if raw is not None:
                values[s.name] = (s.parse(raw), "flag")
                continue
            if environ.get(s.variable, "") != "":
                values[s.name] = (s.parse(environ[s.variable]), "env")
                continue
        except ValueError as exc:
            where = s.flag if raw is not None else s.variable
            problems.append(Problem(where, str(exc)))
            continue
        if s.name in file_values:
            values[s.name] = (file_values[s.name], "file")
        else:
            values[s.name] = (s.default, "default")
    if problems:
        raise ConfigError(
            f"{len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    return Settings(values, path)


# What a process refuses at start depends on these, from the file or DISTORE_*.
_START_SETTINGS = ("auth.token_file", "auth.insecure", "control.host", "node.host",
                   "control.checkpoint")


def check_file(path: str, environ: Mapping[str, str] | None = None) -> list[Problem]:
    """Problems of a distore.toml (empty when it is valid); for `distore config check`.

    Besides each value on its own, it reports what `distore control` and
    `distore node` would refuse at start with this file and `environ` (the
    DISTORE_* variables the CLI passes; none by default): listening beyond
    loopback without a token, a checkpoint folder that cannot be made.
    """
    values, problems = load_file(path)
    if problems:
        return problems
    for name in _START_SETTINGS:
        s = BY_NAME[name]
        if (environ or {}).get(s.variable, "") != "":
            try:
                values[name] = s.parse(environ[s.variable])
            except ValueError as exc:
                problems.append(Problem(s.variable, str(exc)))
    return problems or _refused_at_start(path, values)


def _refused_at_start(path: str, values: dict[str, Any]) -> list[Problem]:
    """What the processes refuse at start given these values (flags may still
    supply what is missing: this file is meant to be enough)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []

    def where(section: str, key: str) -> str:
        line = _locate(lines, section, key)
        return f"{path}:{line} [{section}] {key}" if line else f"{path} [{section}] {key}"

    def value(name: str) -> Any:
        return values.get(name, BY_NAME[name].default)

    problems = []
    token, insecure = value("auth.token_file"), value("auth.insecure")
    for role, section in (("control plane", "control"), ("storage node", "node")):
        host = values.get(f"{section}.host")
        if not host:  # the default, or a flag's: loopback, or not this file's to say
            continue
        try:
            check_exposure(role, host, token, insecure)
        except ConfigError:
            problems.append(Problem(
                where(section, "host"),
                f"the {role} would listen on {host} and refuses to without a token: set "
                "token_file under [auth] (the same file on every host; make one with "
                "(umask 077; head -c 32 /dev/urandom | base64 > FILE)), or insecure = true "
                "under [auth] on a trusted, isolated network"))
    checkpoint = value("control.checkpoint")
    if checkpoint:
        folder = os.path.dirname(os.path.abspath(checkpoint))
        parent = folder
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if parent != folder and not os.access(parent, os.W_OK | os.X_OK):
            problems.append(Problem(
                where("control", "checkpoint"),
                f"the folder {folder} does not exist and this user cannot make it ({parent} "
                "is not writable): create it, or choose a checkpoint path in a folder "
                "this user can write (distore control makes a missing folder when it can)"))
        elif parent == folder and not os.access(folder, os.W_OK | os.X_OK):
            problems.append(Problem(
                where("control", "checkpoint"),
                f"this user cannot write in {folder}: the control plane could not write "
                "its checkpoints there"))
    return problems


__all__ = [
    "ControlConfig", "NodeConfig", "UcxConfig", "Settings", "Setting",
    "SETTINGS", "Problem", "resolve", "load_file", "check_file", "parse_size", "settings_table",
    "TableProblems", "check_exposure", "is_loopback",
]
