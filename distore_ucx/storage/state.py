"""What a storage node's parts share, in one explicit object.

The node (storage/node.py) is made of parts, each given what it uses when
it is made: the session with the control plane (storage/session.py), the
insert server (storage/inserts.py), room for inserts (storage/room.py) and
cold staging (storage/staging.py). What more than one of them reads and
some of them change is here, each field saying who sets it. Thread safety:
the node's event loop only, except that the heartbeat thread reads
`arena`, `node_id` and `joined` (storage/session.py `beat`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import NodeConfig
from ..errors import ConnectionFailed

if TYPE_CHECKING:
    from ..transport.rpc import AsyncClient
    from .arena import Arena
    from .tier import DiskTier, StagingArea


@dataclass(eq=False)
class NodeState:
    """A storage node's shared, changing state (see the module).

    >>> state = NodeState(config, "node a")
    >>> state.arena = Arena(runtime, config.arena_bytes)   # the node, at start-up
    >>> session, inserts = ControlSession(state, ...), InsertServer(state, ...)
    """

    config: NodeConfig
    name: str
    # Made by the node at start-up; the arena is None again once the node
    # unmapped it (an insert that waited past that frees nothing).
    arena: Arena | None = None
    tier: DiskTier | None = None  # the disk tier (--disk), storage/tier.py
    staging: StagingArea | None = None  # where sampled cold items are read to (with a tier)
    # Set by the session when it joins the control plane.
    node_id: int | None = None
    store_id: str | None = None  # the store this node's items belong to
    control: AsyncClient | None = None
    # Registered with a live control plane: set by the session when it
    # joins, cleared by the node when it loses the control plane and by an
    # insert that finds the control connection closed.
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the node when it stops: inserts in flight fail as "shutting down".
    leaving: bool = False
    # table -> slot size, as inserts said (storage/room.py sets it; the
    # session re-sends a table that only the disk tier holds with it)
    slot_sizes: dict[str, int] = field(default_factory=dict)

    def used_bytes(self) -> int:
        """Arena bytes in use (0 before start-up and after teardown)."""
        arena = self.arena
        return arena.used_bytes if arena is not None else 0

    def commit_registered(self, table: str, offsets, keys, generations, priorities,
                          steps: tuple | None, twice) -> None:
        """Slots whose items the control plane registered, of one or many
        inserts, made LIVE in one call (storage/registrations.py); `twice`:
        slots of keys the table held already, freed. Raises (changing
        nothing) when the node stopped meanwhile."""
        arena = self.arena
        if arena is None:
            raise ConnectionFailed(f"storage node {self.name} is shutting down")
        if len(twice):
            arena.free(table, twice)
        arena.commit(table, offsets, keys, generations, priorities, steps)
