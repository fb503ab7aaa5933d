"""A storage node's session with the control plane.

Joining at start and re-joining after losing the control plane, for
`reconnect_timeout` s; after a re-join, re-sending the items the node holds
(to a control plane restored from a checkpoint) or discarding them (to one
that does not know them); what the node's heartbeat says (storage/heartbeat.py
sends it), and whether its event loop still runs; and the control plane's
pushes: frees, retirements, staging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import numpy as np

from ..errors import (
    AuthenticationFailed,
    CheckpointError,
    ConnectionFailed,
    Timeout,
    WrongPeer,
)
from ..progress import Progress
from ..protocol import STEP_FIELDS, parse_reply
from ..slot_format import is_cold
from ..transport.auth import PROBE_AFTER
from ..transport.rpc import AsyncClient
from ..transport.runtime import host_id
from .arena import granted_page_kind

log = logging.getLogger(__name__)

RESEND_BATCH = 1 << 16  # items per items_restored message after a re-join
# s without an event-loop tick after which the heartbeat thread stops beating
LOOP_WEDGED = 10.0
# s a connection attempt waits for the control plane's greeting, at most
CONNECT_TIMEOUT = 10.0
# ... and at least: a silent peer is asked whether it is HTTP after
# PROBE_AFTER s, and needs a moment to answer
MIN_ATTEMPT = PROBE_AFTER + 1.0


def _attempt_timeout(deadline: float) -> float:
    """How long one attempt to join may wait, so that the reconnect window
    (--reconnect-timeout) ends when it says."""
    return min(CONNECT_TIMEOUT, max(MIN_ATTEMPT, deadline - time.monotonic()))


class ControlSession:
    """Joins the control plane, keeps the node registered, answers its pushes.

    Mixed into StorageNode (storage/node.py): uses its config, name, runtime,
    arena, tier, local map, `puller`, `_frees`, `_stop`, `_token`, `_where`
    and `_slot_sizes`; sets node_id, store_id, control, `_interval`,
    `_joined`, `_loop_seen` and `_loop_wedged`. `_stage` and `_unstage` are in
    storage/staging.py.
    """

    async def _first_join(self) -> bool:
        """Join at start; a control plane not up yet (started after its nodes,
        or restarting) is waited for as after losing it, for
        `reconnect_timeout` s. False: none came, or we were stopped."""
        deadline = time.monotonic() + self.config.reconnect_timeout
        try:
            await self._join(_attempt_timeout(deadline))
            return True
        except (AuthenticationFailed, WrongPeer):
            # A control plane answered and refused us, or something else
            # answers there (an HTTP server, a storage node): waiting will not help.
            raise
        except (ConnectionFailed, Timeout) as exc:
            log.warning("no control plane at %s yet (%s); node %s tries to join for %g s "
                        "(--reconnect-timeout)", self.config.control, exc, self.name,
                        self.config.reconnect_timeout)
        # The window began with the first attempt, which may have used it up.
        if time.monotonic() < deadline and await self._rejoin(deadline):
            return True
        if not self._stop.is_set():
            log.error("no control plane at %s within %g s; node %s exits",
                      self.config.control, self.config.reconnect_timeout, self.name)
        return False

    async def _rejoin(self, deadline: float | None = None) -> bool:
        """Try to re-join until `deadline` (default: `reconnect_timeout` s from
        now) passes or we are stopped; an attempt outlasts it by MIN_ATTEMPT s at most."""
        if deadline is None:
            deadline = time.monotonic() + self.config.reconnect_timeout
        delay, last_error = 0.05, ""
        while not self._stop.is_set():
            old = self.control
            try:
                await self._join(_attempt_timeout(deadline))
                if old is not None:  # None: joining for the first time
                    await old.close()
                return True
            except Exception as exc:  # whatever went wrong, try again until the deadline
                if str(exc) != last_error:
                    log.info("re-joining the control plane: %s", exc,
                             exc_info=not isinstance(exc, (ConnectionFailed, Timeout,
                                                           CheckpointError)))
                    last_error = str(exc)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._stop.wait(), min(delay, left))
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 1.0)
        return False

    async def _join(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Connect (each read of the handshake within `timeout` s) and register
        (with our former id after a loss); then re-send or discard the items we
        hold, as the control plane asks."""
        cfg = self.config
        control = await AsyncClient.connect(
            cfg.control, "control plane", on_push=self._on_push, token=self._token,
            timeout=timeout, expect="control plane",
        )
        try:
            former = self.node_id
            host, port = self._where
            msg = await control.call(
                "register_node",
                name=self.name,
                host=host,
                port=port,
                worker_address=self.runtime.address,
                rkey=self.arena.region.pack_rkey(),
                arena_base=self.arena.base,
                arena_size=self.arena.size,
                pid=os.getpid(),
                host_id=host_id(),
                arena_id=self.arena.arena_id,
                page_kind=granted_page_kind(self.arena.page_kind),
                **({"local_socket": self.local_map.name} if self.local_map else {}),
                **({"node_id": former} if former is not None else {}),
                **({"store_id": self.store_id} if former is not None and self.store_id
                   else {}),
                **({"disk_size": self.tier.size} if self.tier is not None else {}),
                **({"insert_port": self.puller.insert_port} if self.puller.insert_port else {}),
                **({"insert_run_bytes": self.puller.insert_run_bytes}
                   if self.puller.insert_port and self.puller.insert_run_bytes else {}),
                **({"am_sample": True, "sample_port": self.sample_server.port}
                   if self.sample_server is not None else {}),
                **({"am_key": self.am_key}
                   if self.sample_server is not None or self.puller.insert_port else {}),
                beat_secret=self.beat_secret,
            )
            joined = parse_reply("register_node", msg, control.name)
            self.node_id = joined.node_id
            self.store_id = joined.store_id
            self._interval = joined.heartbeat_interval
            self.control = control
            if former is not None:
                if joined.restore:
                    await self._resend_items()
                    if joined.items_resent:  # lets the restore end without its grace
                        await control.call("items_resent", node_id=self.node_id)
                else:
                    self._discard_items()
                log.info("node %s re-joined the control plane as node %d", self.name,
                         self.node_id)
        except BaseException:
            await control.close()
            raise
        self._joined.set()

    def _held_items(self) -> dict:
        """LIVE items by table, both tiers: (keys, offsets, generations,
        priorities, slot size, steps); disk items have COLD offsets; steps:
        steps of episodes' (episodes, positions, flags), or None."""
        held = {t: (*slots.live(), slots.slot_size, slots.live_steps())
                for t, slots in self.arena.tables().items()}
        if self.tier is not None:
            for table in self.tier.tables():
                cold, cold_steps = self.tier.live(table), self.tier.live_steps(table)
                if table in held:
                    hot = held[table]
                    steps = None
                    if hot[5] is not None and cold_steps is not None:
                        steps = tuple(np.concatenate([a, b]) for a, b in zip(hot[5], cold_steps))
                    elif not len(cold[0]):
                        steps = hot[5]
                    elif not len(hot[0]):
                        steps = cold_steps
                    held[table] = (*(np.concatenate([a, b]) for a, b in zip(hot[:4], cold)),
                                   hot[4], steps)
                elif len(cold[0]):
                    # the arena has no slots of it: its slot size is the spec's
                    held[table] = (*cold, self._slot_sizes.get(table, 0), cold_steps)
        return held

    def _free(self, table: str, offsets, live_only: bool = False) -> None:
        """Free slots of either tier (COLD offsets are disk slots)."""
        offsets = np.asarray(offsets, np.uint64)
        cold = is_cold(offsets)
        if cold.any() and self.tier is not None:
            self.tier.free(table, offsets[cold], live_only)
            offsets = offsets[~cold]
        self.arena.free(table, offsets, live_only)

    async def _resend_items(self) -> None:
        """Send the restoring control plane every item we hold, in bounded batches."""
        for table, (keys, offsets, gens, prios, slot_size, steps) in self._held_items().items():
            totals = {"restored": 0, "adopted": 0, "discarded": 0}
            progress = Progress(f"re-sending table {table!r}", total=len(keys), unit="items",
                                logger=log, every=5.0)
            for i in range(0, len(keys), RESEND_BATCH):
                part = slice(i, i + RESEND_BATCH)
                msg = await self.control.call(
                    "items_restored", reply_timeout=60.0, node_id=self.node_id, table=table,
                    slot_size=slot_size, keys=keys[part], offsets=offsets[part],
                    generations=gens[part], priorities=prios[part],
                    **({} if steps is None else dict(zip(STEP_FIELDS, (a[part] for a in steps)))),
                )
                got = parse_reply("items_restored", msg, self.control.name)
                for k in totals:
                    totals[k] += getattr(got, k)
                progress.update(len(keys[part]))
            progress.close()
            if len(keys):
                log.info("re-sent %d items of table %r: %d restored from the checkpoint, %d "
                         "newer adopted, %d discarded", len(keys), table, totals["restored"],
                         totals["adopted"], totals["discarded"])

    def _discard_items(self) -> None:
        """The control plane does not know our items (it started afresh, or had
        dropped us): free them, loudly."""
        for table, (_, offsets, *_) in self._held_items().items():
            if len(offsets):
                self._free(table, offsets)
                log.warning("the control plane does not restore items (it started without "
                            "--restore, or had dropped this node): %d items of table %r on "
                            "node %s are discarded", len(offsets), table, self.name)

    async def _reader_ticks(self, interval: float) -> None:
        # Heartbeats are not sent from here (storage/heartbeat.py says why),
        # but the heartbeat thread stops when these ticks stop (_beat).
        while True:
            self._loop_seen = time.monotonic()
            self.puller.progress_between_pulls()
            await asyncio.sleep(interval)

    def _beat(self) -> dict | None:
        """The heartbeat's fields (read on the heartbeat thread); None while
        not registered with a control plane."""
        arena, node_id = self.arena, self.node_id
        if arena is None or node_id is None or not self._joined.is_set():
            return None
        # A busy loop is late by seconds (measured up to 5 s beside 128
        # actors); one that has not run for LOOP_WEDGED s serves nothing:
        # the node must not look live then.
        late = time.monotonic() - self._loop_seen
        if late > LOOP_WEDGED:
            if not self._loop_wedged:
                self._loop_wedged = True
                log.error("node %s: its event loop has not run for %.0f s; heartbeats stop "
                          "until it does (the control plane routes around this node)",
                          self.name, late)
            return None
        self._loop_wedged = False
        return {"node_id": node_id, "used_bytes": arena.used_bytes,
                "beat_secret": self.beat_secret}

    def _apply_free(self, fields: dict) -> None:
        try:
            self._free(fields["table"], fields["offsets"], live_only=True)
        except ValueError as exc:  # a confused control plane must not stop the node
            log.error("ignoring a free from the control plane: %s", exc)

    async def _on_push(self, op: str, fields: dict) -> None:
        if op == "free":
            # A free may name items of a registration whose reply came in but
            # whose insert has not committed its slots yet: it waits for the
            # registrations in flight now (storage/held_frees.py).
            self._frees.free(fields)
        elif op == "retire":
            # Evicted items a learner holds a lease on: their reads must fail
            # the header check from now on (control/retirements.py).
            self.arena.mark_retired(fields["offsets"], fields["generations"])
            self.control.push("retired", node_id=self.node_id, request=fields["request"])
        elif op == "stage" and self.tier is not None:
            asyncio.get_running_loop().create_task(self._stage(fields))
        elif op == "unstage" and self.staging is not None:
            self._unstage(fields["extents"])
        else:
            log.warning("ignoring unexpected push %r from the control plane", op)

    async def _until_joined(self, deadline: float, k: int) -> None:
        """Wait until we are registered with a control plane, or raise Timeout."""
        if self._joined.is_set():
            return
        try:
            await asyncio.wait_for(self._joined.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise Timeout(
                f"storage node {self.name} has no control plane (lost {self.config.control}); "
                f"the insert of {k} items waited its timeout and was not stored. Restart the "
                "control plane (with --restore to keep the store's contents)"
            ) from None

