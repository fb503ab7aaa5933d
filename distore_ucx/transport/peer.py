"""One accepted connection on a server, and what the server keeps about it.

`Peer` is what a request handler gets (transport/server.py): where the
connection came from, how to push to it, the requests of it being answered.
`PeerState` is the per-connection state the roles keep on it, one typed
field each (the roles cannot import each other's types, so the fields are
declared here, each saying which role sets it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .. import protocol
from .frames import Outbox

__all__ = ["Peer", "PeerState"]

_UNSET = object()


@dataclass(slots=True)
class PeerState:
    """Per-connection state of a server, one field per thing kept.

    Read and write it as attributes (``peer.state.node_id``). The
    dict-style access (``get``, ``[]``, ``setdefault``, ``pop``) reaches the
    same fields, for code written when this was a dict: a field holding
    None counts as absent there; a name not declared here raises KeyError.
    """

    # transport: the connection answered its challenge (or none was asked)
    authenticated: bool = False
    # control plane: the storage node registered on this connection
    node_id: int | None = None
    # control plane: writer ids handed out on it (control.max_writer_ids)
    writer_ids: set[int] = field(default_factory=set)
    # control plane: release requests naming another connection's leases,
    # and whether that was logged (once per connection)
    leases_refused: int = 0
    refusal_logged: bool = False
    # storage node: the writer's staging buffers it read from (storage/pulls.py)
    sources: OrderedDict | None = None
    # storage node: the UCX worker addresses those reads use an endpoint to
    worker_addresses: set[bytes] | None = None
    # storage node: a same-host writer's pid, checked to own this connection
    verified_pid: int | None = None
    # storage node: a task watches the writer for an exit mid-insert
    watched: bool = False

    def _field(self, key: str) -> str:
        if key not in _NAMES:
            raise KeyError(f"{key!r} is not per-connection state: declare it as a field of "
                           "transport.peer.PeerState")
        return key

    def get(self, key: str, default: Any = None) -> Any:
        """The field `key`, or `default` while it holds None."""
        value = getattr(self, self._field(key))
        return default if value is None else value

    def setdefault(self, key: str, default: Any = None) -> Any:
        """The field `key`, set to `default` first while it holds None."""
        value = getattr(self, self._field(key))
        if value is None:
            setattr(self, key, default)
            value = default
        return value

    def pop(self, key: str, default: Any = _UNSET) -> Any:
        """The field `key` (or `default` while it holds None), reset to its default."""
        value = getattr(self, self._field(key))
        spec = _FIELDS[key]
        setattr(self, key, spec.default if spec.default_factory is dataclasses.MISSING
                else spec.default_factory())
        if value is None:
            if default is _UNSET:
                raise KeyError(key)
            return default
        return value

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, self._field(key))
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, self._field(key), value)


_FIELDS = {f.name: f for f in dataclasses.fields(PeerState)}
_NAMES = frozenset(_FIELDS)


class Peer:
    """One accepted connection on a server: where it came from, how to push."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        addr = writer.get_extra_info("peername")
        self.address = f"{addr[0]}:{addr[1]}" if addr else "?"
        self.state = PeerState()
        self.closed = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()  # requests being answered concurrently
        self._outbox = Outbox(writer)

    def send(self, frames: list) -> None:
        """Queue encoded frames for this connection: those of one turn of the
        event loop go in one write, in order (frames.Outbox)."""
        self._outbox.send(frames)

    def flush(self) -> None:
        """Write what is queued now (before the connection closes)."""
        self._outbox.flush()

    def push(self, op: str, **fields: Any) -> None:
        """Send a message that expects no reply (id 0)."""
        if not self.writer.is_closing():
            self.send(protocol.encode(protocol.request(op, 0, **fields)))

    def close(self) -> None:
        """Close the connection; the serving task then ends."""
        if not self.writer.is_closing():
            self.writer.close()
