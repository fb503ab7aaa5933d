"""Writer ids: the high bits of every key, so never handed out twice.

A key is `writer_id << KEY_BITS | the writer's sequence number`. Ids come
from IdState (control/checkpoint.py), which persists them beside the
checkpoint, so a restarted control plane never repeats one either. A
connection may hold at most control.max_writer_ids writers; a writer whose
2**KEY_BITS keys are used asks for another id with `previous`, which does
not count against that limit again.
"""

from __future__ import annotations

from ..config import ControlConfig
from ..errors import ConfigError, LimitExceeded
from ..transport.rpc import Peer
from .checkpoint import KEY_BITS, IdState

# A writer whose 2**24 keys are used takes another id (register_writer
# `previous`), so the 2**40 ids last centuries even at 26k registrations a
# second.
MAX_WRITERS = 1 << (64 - KEY_BITS)


class Writers:
    """The `register_writer` request; one per control plane."""

    def __init__(self, config: ControlConfig, ids: IdState):
        self.config = config
        self.ids = ids

    def op_register_writer(self, peer: Peer, f: dict) -> dict:
        """A writer id never handed out before; at most control.max_writer_ids
        writers per connection. Ids are not reused (keys `writer_id << 24 |
        seq` of a closed writer may still be in tables, in nodes' slots and in
        checkpoints) but cannot run out: there are 2**40, and a writer whose
        2**24 keys are used asks for the next with `previous`, which this
        connection's count does not see again."""
        limit = self.config.max_writer_ids
        mine = peer.state.setdefault("writer_ids", set()) if peer is not None else set()
        previous = f.get("previous")
        if previous not in mine:  # a new writer (or one whose connection was made again)
            previous = None
        if previous is None and len(mine) >= limit:
            raise LimitExceeded(
                f"this connection registered {len(mine)} writers, the most one connection may "
                f"(control.max_writer_ids = {limit}): reuse a writer instead of making one per "
                "batch, connect again (ds.connect) for more, or raise --max-writer-ids"
            )
        wid = self.ids.writer_id()
        if wid >= MAX_WRITERS:  # 2**40 ids: not in this universe's lifetime
            raise ConfigError(f"this control plane handed out all {MAX_WRITERS} writer ids; "
                              "start a new store (a new --checkpoint path)")
        mine.discard(previous)
        mine.add(wid)
        return {"writer_id": wid, "key_bits": KEY_BITS}
