"""The typed configuration each process gets: control plane, storage node, UCX.

A field fed by a setting is declared with :func:`from_setting`, which takes
its default from the settings table (:mod:`.settings`) and records the
setting's name, so that :func:`build` fills it from resolved settings. The
table is the one place such a default is written; the few fields that are
not settings (derived values, the control plane's address of a node) say so
where they are declared. Each class checks its own values when made.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from ..errors import ConfigError
from ..protocol import MAX_FRAME, MAX_SAMPLE
from ..table_definition import TableDefinition
from .settings import BY_NAME

_SETTING = "setting"  # a field's metadata key: the name of the setting that feeds it

# Seconds between a node's heartbeats, at most: a quarter of the heartbeat
# timeout when that is shorter (Settings.control).
HEARTBEAT_INTERVAL = 0.5


def from_setting(name: str, library_default: Any = MISSING) -> Any:
    """A dataclass field fed by setting `name`, with the table's default.

    `library_default` is for the rare field whose default, for code that
    makes the configuration itself, is not the command line's (metrics are
    served by `distore control` unless told otherwise, but not by a control
    plane a program starts)."""
    default = BY_NAME[name].default if library_default is MISSING else library_default
    metadata = {_SETTING: name}
    if isinstance(default, (dict, list, set)):  # mutable: a copy for each instance
        return field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def setting_of(f) -> str | None:
    """The name of the setting that feeds dataclass field `f` (None if none)."""
    return f.metadata.get(_SETTING)


Config = TypeVar("Config")


def build(cls: type[Config], value: Callable[[str], Any], **given: Any) -> Config:
    """An instance of `cls` with each setting-fed field set to `value(setting)`
    and the other fields from `given` (or their defaults)."""
    values = {f.name: value(setting_of(f)) for f in fields(cls) if setting_of(f)}
    values.update(given)
    return cls(**values)


@dataclass(frozen=True)
class ControlConfig:
    """Settings of the control plane process."""

    host: str = from_setting("control.host")  # loopback unless asked: see check_exposure
    port: int = from_setting("control.port")
    # Not a setting: derived from heartbeat_timeout by Settings.control.
    heartbeat_interval: float = HEARTBEAT_INTERVAL  # seconds between a node's heartbeats
    # a node silent this long is unresponsive (routed around)
    heartbeat_timeout: float = from_setting("control.heartbeat_timeout")
    # an unresponsive node keeps its items this long
    unresponsive_grace: float = from_setting("control.unresponsive_grace")
    # a sampled item's slot is kept this long at most
    lease_timeout: float = from_setting("control.lease_timeout")
    seed: int | None = from_setting("control.seed")
    # created when the control plane starts
    tables: tuple[TableDefinition, ...] = from_setting("tables")
    # shared secret every connection must prove ("" = none)
    token_file: str = from_setting("auth.token_file")
    checkpoint: str = from_setting("control.checkpoint")  # checkpoint file ("" = no checkpoints)
    # seconds between periodic checkpoints (0 = none)
    checkpoint_interval: float = from_setting("control.checkpoint_interval")
    # start from the checkpoint; nodes re-send their items
    restore: bool = from_setting("control.restore")
    # how long nodes have to re-send them
    restore_grace: float = from_setting("control.restore_grace")
    # What one connection may cost the control plane (docs/operations.md).
    max_sample: int = from_setting("control.max_sample")  # items one sample request may ask for
    # leased items one connection may hold at once
    max_leased_items: int = from_setting("control.max_leased_items")
    # writers one connection may register
    max_writer_ids: int = from_setting("control.max_writer_ids")
    # bytes of one message from an authenticated peer
    max_frame: int = from_setting("control.max_frame")
    # requests of one connection waiting for their answers
    max_pending: int = from_setting("control.max_pending")
    # Prometheus /metrics (0 = none, -1 = any free port); none unless a program asks,
    # while `distore control` serves on the table's default.
    metrics_port: int = from_setting("control.metrics_port", library_default=0)
    # Not a setting: True when the port is nobody's choice (the default): when it is
    # taken, warn and go on without metrics rather than refuse to start.
    metrics_optional: bool = False
    # /metrics names tables and nodes: served on loopback unless asked (--metrics-host).
    metrics_host: str = from_setting("control.metrics_host")

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

    # HOST:PORT of the control plane (the setting control.address, which has no
    # default: Settings.control_address says how to give it).
    control: str
    arena_bytes: int = from_setting("node.arena")
    # address writers reach this node at; "" = the one that routes to control
    host: str = from_setting("node.host")
    port: int = from_setting("node.port")
    name: str = from_setting("node.name")
    hugepages: bool = from_setting("node.hugepages")
    # make every page of the arena at start (no first-touch faults on inserts)
    prefault: bool = from_setting("node.prefault")
    # after deregistering, reads in flight get this long
    drain_timeout: float = from_setting("node.drain_timeout")
    # shared secret every connection must prove ("" = none)
    token_file: str = from_setting("auth.token_file")
    # peers read through a read-only mapping
    write_protect: bool = from_setting("node.write_protect")
    # keep data and retry this long after losing the control plane
    reconnect_timeout: float = from_setting("node.reconnect_timeout")
    # Prometheus /metrics (0 = none, -1 = any free port); none unless a program asks,
    # while `distore node` serves on the table's default.
    metrics_port: int = from_setting("node.metrics_port", library_default=0)
    # Not a setting: True when the port is nobody's choice (the default): when it is
    # taken, warn and go on without metrics rather than refuse to start.
    metrics_optional: bool = False
    # /metrics names tables and nodes: served on loopback unless asked (--metrics-host).
    metrics_host: str = from_setting("node.metrics_host")
    # the disk tier's file ("" = no disk tier; storage/tier.py)
    disk: str = from_setting("node.disk")
    disk_bytes: int = from_setting("node.disk_size")  # its size
    # arena bytes for staged cold items (0 = a quarter of the arena)
    disk_staging: int = from_setting("node.disk_staging")

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

    # UCX_TLS, e.g. "rc,sm,self" on InfiniBand, "tcp" elsewhere
    tls: str | None = from_setting("ucx.tls")
    net_devices: str | None = from_setting("ucx.net_devices")  # UCX_NET_DEVICES, e.g. "mlx5_0:1"
    # prefer the system UCX (verbs) over the wheel's
    system_library: bool | None = from_setting("ucx.system_library")
    # more UCX_* (name without UCX_)
    options: Mapping[str, str] = from_setting("ucx.options")

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
