"""Typed configuration. The CLI and the environment are read in one place
(cli.py) and passed down as these dataclasses; nothing deeper reads either.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ConfigError

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

    Besides cli.py this is the one place that reads the environment, so that
    library users get the same token the command line would use.
    """
    path = path or os.environ.get("DISTORE_TOKEN_FILE") or None
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path!r}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"the token in {path!r} is {len(token)} bytes; use at least {MIN_TOKEN_BYTES} "
            "(e.g. head -c 32 /dev/urandom | base64 > FILE)"
        )
    return token


@dataclass(frozen=True)
class ControlConfig:
    """Settings of the control plane process."""

    host: str = "0.0.0.0"
    port: int = 7700
    heartbeat_interval: float = 0.5  # seconds between a node's heartbeats
    heartbeat_timeout: float = 2.0  # a node silent this long is dropped
    lease_timeout: float = 30.0  # a sampled item's slot is kept this long at most
    seed: int | None = None
    token_file: str | None = None  # shared secret every connection must prove


@dataclass(frozen=True)
class NodeConfig:
    """Settings of a storage node process."""

    control: str  # HOST:PORT of the control plane
    arena_bytes: int = 4 << 30
    host: str = ""  # address writers reach this node at; "" = the one that routes to control
    port: int = 0
    name: str = ""
    hugepages: bool = True
    token_file: str | None = None  # shared secret (control plane and writers)
    write_protect: bool = True  # peers read through a read-only mapping

    def __post_init__(self):
        if self.arena_bytes < 1 << 20:
            raise ConfigError(f"arena of {self.arena_bytes} bytes is too small (at least 1MiB)")
