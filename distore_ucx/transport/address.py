"""Control-channel addresses: 'host:port' strings, parsed with a clear error."""

from __future__ import annotations

from .. import errors

__all__ = ["parse_address"]


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'host:port' (or ':port') -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ConfigError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:7700)")
    return host.strip("[]") or default_host, int(port)
