"""Room for an insert in a storage node's full arena.

Without a disk tier, the table evicts its own items stored on this node, as
its remover picks them (control/room.py); with one, the node first demotes
items of the table from the arena to disk (storage/tier.py, control/tiers.py),
as the control plane picks them; StorageFull when neither can make room.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import Executor

import numpy as np

from ..errors import StorageFull
from ..protocol import check_reply, parse_reply
from ..slot_format import COLD
from .slots import ALLOCATED
from .state import NodeState

log = logging.getLogger(__name__)

DEMOTE_BATCH = 64  # items demoted at least at once when the arena is full


class RoomForInserts:
    """Arena slots for inserts, evicting or demoting to make room.

    Given the node's shared state (storage/state.py: its config, name,
    arena, tier, control connection, node id, `joined` and `slot_sizes`,
    which it sets) and, with a disk tier, the node's disk threads, on
    which demoted items are written. The insert server (storage/inserts.py)
    asks it for slots.
    """

    def __init__(self, state: NodeState, disk: Executor | None):
        self.state = state
        self._disk = disk
        self._demoting = asyncio.Lock()  # one demotion at a time

    def allocate_now(self, table: str, slot_size: int, k: int) -> np.ndarray | None:
        """Arena slots for an insert when the arena has room for it now (the
        common case, without a wait): their offsets; None when room must be
        made first (`allocate`)."""
        self.state.slot_sizes[table] = slot_size
        try:
            return self.state.arena.allocate(table, slot_size, k)
        except StorageFull:
            return None

    async def allocate(self, table: str, slot_size: int, k: int) -> np.ndarray:
        """Arena slots for an insert; with a disk tier, a full arena first
        demotes items of the table to disk (StorageFull when both are full);
        without one, the table evicts its own items here, by its remover
        (control/room.py; StorageFull when none can be)."""
        state = self.state
        state.slot_sizes[table] = slot_size
        delay = 0.01
        for _ in range(20):  # other inserts may take the room we made: try again
            try:
                return state.arena.allocate(table, slot_size, k)
            except StorageFull as exc:
                if state.control is None or not state.joined.is_set():
                    raise
                if state.tier is None:
                    if not await self._make_room(table, slot_size, k, exc):
                        await asyncio.sleep(delay)  # inserts in flight hold the space
                        delay = min(2 * delay, 0.5)
                    continue
            if await self._demote(table, slot_size, k) == 0:
                # Nothing to demote now: the table's items here are leased, or
                # inserts in flight have not reached the control plane yet.
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)
        return state.arena.allocate(table, slot_size, k)  # raises StorageFull as it is

    async def _make_room(self, table: str, slot_size: int, k: int, full: StorageFull) -> bool:
        """Have the control plane evict items of `table` stored here (by the
        table's remover) and free their slots. False when none could be
        evicted yet because inserts in flight hold the table's space here
        (their items become evictable once registered); StorageFull, saying
        why, when none can be."""
        state = self.state
        need = state.arena.shortfall(table, slot_size, k)
        if need == 0:
            return True  # another insert's eviction made the room meanwhile
        # Read the map, checked (check_reply): one evict per insert while the arena is full.
        reply = check_reply("evict", await state.control.call(
            "evict", node_id=state.node_id, table=table, n=need), state.control.name)
        offsets = np.frombuffer(reply["offsets"], np.uint64)
        if len(offsets):
            state.arena.free(table, offsets, live_only=True)
            return True
        slots = state.arena.tables().get(table)
        if slots is not None and (slots.cols["state"][:slots.n] == ALLOCATED).any():
            return False
        leased = reply["leased"]
        raise StorageFull(
            f"{full} [table {table!r} has no item on node {state.name} that could be evicted "
            "to make room"
            + (f": its {leased} items here are under lease (learners reading them; they are "
               "freed when released)" if leased else
               ": the space is held by other tables, which keep it (tables share arenas "
               "first come, first served)")
            + "]")

    async def _demote(self, table: str, slot_size: int, k: int) -> int:
        """Move at least k items of `table` (as the control plane picks them)
        from the arena to disk; how many moved."""
        state = self.state
        async with self._demoting:
            slots = state.arena.tables().get(table)
            if slots is not None and slots.free_slots >= k:
                return k  # another insert's demotion made the room meanwhile
            want = min(max(k, DEMOTE_BATCH), state.tier.room(table, slot_size))
            if want == 0:
                state.tier.allocate(table, slot_size, k)  # raises StorageFull: both tiers full
            picked = parse_reply("demote", await state.control.call(
                "demote", node_id=state.node_id, table=table, n=want), state.control.name)
            keys = picked.keys
            if len(keys) == 0:
                return 0
            offsets, gens = picked.offsets, picked.generations
            disk = state.tier.allocate(table, slot_size, len(keys))
            new_gens = state.arena.next_generations(len(keys))
            loop = asyncio.get_running_loop()
            statuses = await loop.run_in_executor(
                self._disk, state.tier.write, state.arena.region, offsets, slot_size, disk,
                keys, new_gens)
            ok = statuses == 0
            if not ok.all():
                bad = int(np.count_nonzero(~ok))
                state.tier.write_errors += bad
                state.tier.free(table, disk[~ok])
                log.error("node %s: could not write %d of %d items of table %r to the disk tier "
                          "%s (%s); they stay in the arena", state.name, bad, len(keys), table,
                          state.config.disk, os.strerror(int(statuses[~ok][0]))
                          if statuses[~ok][0] > 0 else "bad slot")
                if not ok.any():
                    raise StorageFull(
                        f"node {state.name}: arena full and the disk tier {state.config.disk} "
                        f"failed to write ({os.strerror(int(statuses[0]))}); the insert into "
                        f"table {table!r} was not stored and nothing in the arena was lost. "
                        "Check the disk (see the node's log)")
                keys, offsets, gens, disk, new_gens = (a[ok] for a in
                                                       (keys, offsets, gens, disk, new_gens))
            moved = parse_reply("items_moved", await state.control.call(
                "items_moved", node_id=state.node_id, table=table, keys=keys, offsets=offsets,
                generations=gens, new_offsets=disk | COLD, new_generations=new_gens),
                state.control.name)
            taken = moved.taken.astype(bool)
            state.tier.free(table, disk[~taken])  # evicted or sampled meanwhile: stay hot
            if taken.any():  # then the table still has these arena slots
                hot = state.arena.tables()[table]
                prios = hot.cols["priority"][hot.index(offsets[taken])]
                state.tier.commit(table, disk[taken], keys[taken], new_gens[taken], prios,
                                  hot.steps_of(offsets[taken]))
                state.arena.free(table, offsets[taken], live_only=True)
            state.tier.demoted += int(taken.sum())
            return int(taken.sum())

