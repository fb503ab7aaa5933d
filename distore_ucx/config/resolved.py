"""Resolving every setting: CLI flag > DISTORE_* variable > distore.toml > default.

:func:`resolve` gives :class:`Settings`, each value with where it came from,
and Settings gives each process its typed configuration (:mod:`.roles`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .roles import HEARTBEAT_INTERVAL, ControlConfig, NodeConfig, UcxConfig, build
from .settings import SETTINGS
from .toml_file import Problem, load_file


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
        return build(UcxConfig, self.__getitem__, options=dict(self["ucx.options"]))

    def control(self) -> ControlConfig:
        """The control plane's configuration."""
        timeout = self["control.heartbeat_timeout"]
        if timeout <= 0 or self["control.lease_timeout"] <= 0:
            raise ConfigError("control.heartbeat_timeout and control.lease_timeout must be > 0")
        return build(
            ControlConfig, self.__getitem__,
            heartbeat_interval=min(HEARTBEAT_INTERVAL, timeout / 4),
            metrics_optional=self.source("control.metrics_port") == "default",
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
        return build(
            NodeConfig, self.__getitem__, control=self.control_address(),
            metrics_optional=self.source("node.metrics_port") == "default",
        )


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
