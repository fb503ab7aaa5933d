"""How one setting's value is read: sizes, numbers, switches, ports, tables.

Each ``to_*`` parser takes what a flag, a ``DISTORE_*`` variable or
distore.toml gives (text, or a TOML value) and returns the typed value, or
raises ValueError saying what was expected; the callers add where the value
came from. :func:`parse_size` is the public size parser (ConfigError).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from ..table_definition import TableDefinition
from ..transport.rpc import parse_address
from .auth import MIN_TOKEN_BYTES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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


def to_int(v: Any) -> int:
    """A whole number (an integer or its text; not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"expected an integer, got {v!r}") from None


def to_float(v: Any) -> float:
    """A number, e.g. of seconds (a number or its text; not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"expected a number (seconds), got {v!r}") from None


def to_str(v: Any) -> str:
    """A string, as given."""
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def to_bool(v: Any) -> bool:
    """A switch: true/false, or "1"/"0", "yes"/"no", "on"/"off" as text."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def to_size(v: Any) -> int:
    """A size in bytes: a whole number or text such as "4GiB" (parse_size)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected a size such as \"4GiB\", got {v!r}")
    try:
        return parse_size(v)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def to_address(v: Any) -> str:
    """A HOST:PORT address, checked and returned as given."""
    try:
        parse_address(to_str(v))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return v


def to_level(v: Any) -> str:
    """A log level name (any case), upper-cased."""
    level = to_str(v).upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{v!r} is not a log level (one of {', '.join(LOG_LEVELS)})")
    return level


def to_token_file(v: Any) -> str:
    """The path of a token file the processes would accept ("" = none)."""
    path = to_str(v)
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


def at_least(low: float, parse: Callable[[Any], Any], strict: bool, what: str,
             shown: str = "") -> Callable[[Any], Any]:
    """`parse`, then refuse values below `low` (or equal to it when `strict`),
    as the processes would at start."""
    def check(v: Any) -> Any:
        value = parse(v)
        if value < low or (strict and value == low):
            raise ValueError(f"{what} must be {'>' if strict else '>='} {shown or low}, "
                             f"got {v!r}")
        return value
    return check


def to_port(v: Any) -> int:
    """A TCP port, 0-65535 (0 = any free port)."""
    port = to_int(v)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port is 0-65535 (0 = any free port), got {v!r}")
    return port


def to_metrics_port(v: Any) -> int:
    """A /metrics port: 0-65535 (0 = serve none), or "auto" (-1: any free port)."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return -1  # any free port (metrics.AUTO_PORT)
    try:
        return to_port(v)
    except ValueError:
        raise ValueError(f"a metrics port is 0-65535 (0 = serve no metrics) or \"auto\" "
                         f"(any free port), got {v!r}") from None


def to_options(v: Any) -> dict[str, str]:
    """More UCX options: a table (or JSON object) of NAME = "value", names
    without their UCX_ prefix."""
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


def to_tables(v: Any) -> tuple[TableDefinition, ...]:
    """Tables to create: a list (or JSON list) of [[tables]] entries, every
    problem of every entry reported at once."""
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
