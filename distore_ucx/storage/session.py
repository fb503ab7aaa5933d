"""A storage node's session with the control plane.

Joining at start and re-joining after losing the control plane, for
`reconnect_timeout` s; after a re-join, re-sending the items the node holds
(to a control plane restored from a checkpoint) or discarding them (to one
that does not know them); what the node's heartbeat says (storage/heartbeat.py
sends it), and whether its event loop still runs; and the control plane's
pushes, routed like requests (transport/dispatch.py): frees and
retirements here, staging to storage/staging.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

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
from ..transport.dispatch import Dispatcher
from ..transport.rpc import AsyncClient
from .held_frees import HeldFrees
from .state import NodeState

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

    Given the node's shared state (storage/state.py: its config, name,
    arena, tier and `slot_sizes`; it sets node_id, store_id, control and
    `joined`), the store's token, `offer()` (register_node's fields that
    say what the node serves and where: storage/node.py), `on_tick` (called
    on each tick of the event loop: the pull thread's progress between
    pulls, storage/puller.py), the node's stop event, and the handlers of
    the pushes it does not answer itself (storage/staging.py, with a disk
    tier). Inserts hold frees behind their registrations in `frees`.

    >>> session = ControlSession(state, token, offer, puller.progress_between_pulls,
    ...                          stop, ColdStaging(state, disk))
    >>> await session.first_join()
    """

    def __init__(self, state: NodeState, token: bytes | None, offer: Callable[[], dict],
                 on_tick: Callable[[], None], stop: asyncio.Event, *pushes: object):
        self.state = state
        self._token = token
        self._offer = offer
        self._on_tick = on_tick
        self._stop = stop
        self.interval = 0.5  # heartbeat interval the control plane asked for
        self._loop_seen = time.monotonic()  # the event loop's last tick (heartbeat thread reads)
        self._loop_wedged = False
        # What this node's heartbeats carry: only the control plane knows it.
        self.beat_secret = secrets.token_bytes(16)
        # Frees from the control plane, held until the registrations in
        # flight when they came are done (storage/held_frees.py).
        self.frees = HeldFrees(self._apply_free)
        # Pushes have no reply: one nobody serves is logged (_on_push).
        self._pushes = Dispatcher(self, *pushes, server=f"storage node {state.name}",
                                  peers="the control plane")

    async def first_join(self) -> bool:
        """Join at start; a control plane not up yet (started after its nodes,
        or restarting) is waited for as after losing it, for
        `reconnect_timeout` s. False: none came, or we were stopped."""
        state = self.state
        deadline = time.monotonic() + state.config.reconnect_timeout
        try:
            await self._join(_attempt_timeout(deadline))
            return True
        except (AuthenticationFailed, WrongPeer):
            # A control plane answered and refused us, or something else
            # answers there (an HTTP server, a storage node): waiting will not help.
            raise
        except (ConnectionFailed, Timeout) as exc:
            log.warning("no control plane at %s yet (%s); node %s tries to join for %g s "
                        "(--reconnect-timeout)", state.config.control, exc, state.name,
                        state.config.reconnect_timeout)
        # The window began with the first attempt, which may have used it up.
        if time.monotonic() < deadline and await self.rejoin(deadline):
            return True
        if not self._stop.is_set():
            log.error("no control plane at %s within %g s; node %s exits",
                      state.config.control, state.config.reconnect_timeout, state.name)
        return False

    async def rejoin(self, deadline: float | None = None) -> bool:
        """Try to re-join until `deadline` (default: `reconnect_timeout` s from
        now) passes or we are stopped; an attempt outlasts it by MIN_ATTEMPT s at most."""
        state = self.state
        if deadline is None:
            deadline = time.monotonic() + state.config.reconnect_timeout
        delay, last_error = 0.05, ""
        while not self._stop.is_set():
            old = state.control
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
        state = self.state
        cfg = state.config
        control = await AsyncClient.connect(
            cfg.control, "control plane", on_push=self._on_push, token=self._token,
            timeout=timeout, expect="control plane",
        )
        try:
            former = state.node_id
            msg = await control.call(
                "register_node",
                **self._offer(),
                **({"node_id": former} if former is not None else {}),
                **({"store_id": state.store_id} if former is not None and state.store_id
                   else {}),
                beat_secret=self.beat_secret,
            )
            joined = parse_reply("register_node", msg, control.name)
            state.node_id = joined.node_id
            state.store_id = joined.store_id
            self.interval = joined.heartbeat_interval
            state.control = control
            if former is not None:
                if joined.restore:
                    await self._resend_items()
                    if joined.items_resent:  # lets the restore end without its grace
                        await control.call("items_resent", node_id=state.node_id)
                else:
                    self._discard_items()
                log.info("node %s re-joined the control plane as node %d", state.name,
                         state.node_id)
        except BaseException:
            await control.close()
            raise
        state.joined.set()

    def _held_items(self) -> dict:
        """LIVE items by table, both tiers: (keys, offsets, generations,
        priorities, slot size, steps); disk items have COLD offsets; steps:
        steps of episodes' (episodes, positions, flags), or None."""
        state = self.state
        held = {t: (*slots.live(), slots.slot_size, slots.live_steps())
                for t, slots in state.arena.tables().items()}
        if state.tier is not None:
            for table in state.tier.tables():
                cold, cold_steps = state.tier.live(table), state.tier.live_steps(table)
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
                    held[table] = (*cold, state.slot_sizes.get(table, 0), cold_steps)
        return held

    def _free(self, table: str, offsets, live_only: bool = False) -> None:
        """Free slots of either tier (COLD offsets are disk slots)."""
        state = self.state
        offsets = np.asarray(offsets, np.uint64)
        cold = is_cold(offsets)
        if cold.any() and state.tier is not None:
            state.tier.free(table, offsets[cold], live_only)
            offsets = offsets[~cold]
        state.arena.free(table, offsets, live_only)

    async def _resend_items(self) -> None:
        """Send the restoring control plane every item we hold, in bounded batches."""
        state = self.state
        for table, (keys, offsets, gens, prios, slot_size, steps) in self._held_items().items():
            totals = {"restored": 0, "adopted": 0, "discarded": 0}
            progress = Progress(f"re-sending table {table!r}", total=len(keys), unit="items",
                                logger=log, every=5.0)
            for i in range(0, len(keys), RESEND_BATCH):
                part = slice(i, i + RESEND_BATCH)
                msg = await state.control.call(
                    "items_restored", reply_timeout=60.0, node_id=state.node_id, table=table,
                    slot_size=slot_size, keys=keys[part], offsets=offsets[part],
                    generations=gens[part], priorities=prios[part],
                    **({} if steps is None else dict(zip(STEP_FIELDS, (a[part] for a in steps)))),
                )
                got = parse_reply("items_restored", msg, state.control.name)
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
        state = self.state
        for table, (_, offsets, *_) in self._held_items().items():
            if len(offsets):
                self._free(table, offsets)
                log.warning("the control plane does not restore items (it started without "
                            "--restore, or had dropped this node): %d items of table %r on "
                            "node %s are discarded", len(offsets), table, state.name)

    async def ticks(self, interval: float) -> None:
        """Note every `interval` s that the event loop runs, and call `on_tick`."""
        # Heartbeats are not sent from here (storage/heartbeat.py says why),
        # but the heartbeat thread stops when these ticks stop (beat).
        while True:
            self._loop_seen = time.monotonic()
            self._on_tick()
            await asyncio.sleep(interval)

    def beat(self) -> dict | None:
        """The heartbeat's fields (read on the heartbeat thread); None while
        not registered with a control plane."""
        state = self.state
        arena, node_id = state.arena, state.node_id
        if arena is None or node_id is None or not state.joined.is_set():
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
                          state.name, late)
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
        if op not in self._pushes.routes:  # e.g. `stage` to a node without a disk tier
            log.warning("ignoring unexpected push %r from the control plane", op)
            return
        await self._pushes.handle(None, op, fields)

    def op_free(self, peer, fields: dict) -> None:
        """Free slots (`peer`: None, a push). A free may name items of a
        registration whose reply came in but whose insert has not committed
        its slots yet: it waits for the registrations in flight now
        (storage/held_frees.py)."""
        self.frees.free(fields)

    def op_retire(self, peer, fields: dict) -> None:
        """Evicted items a learner holds a lease on: their reads must fail
        the header check from now on (control/retirements.py)."""
        state = self.state
        state.arena.mark_retired(fields["offsets"], fields["generations"])
        state.control.push("retired", node_id=state.node_id, request=fields["request"])
