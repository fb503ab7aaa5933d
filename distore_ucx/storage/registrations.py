"""Registering stored inserts with the control plane, several per request.

A node acknowledges an insert only once the control plane has registered
its items (`items_added`). Under fan-in (hundreds of actors sending a few
items each) a request per insert costs the node and the control plane more
than the items do, so a node keeps one `items_added` in flight per table
(and node id, and placement epoch): the inserts stored while it is answered
wait and go together in the next one; a lone insert goes at once. When
the reply comes and fewer than COALESCE_ITEMS items (and COALESCE_BYTES
bytes) wait, the next request also waits, until that many have come or
`delay` seconds have passed since the last one was sent (the node's
`DISTORE_REGISTER_DELAY`, 10 ms by default): a fast control plane
answers within a few batches' time, and a request per two or three
batches of a few items each cost the node and the control plane more CPU
per item than the items (perf/fanin.py). Large batches (a writer's 8 MiB)
never wait; an acknowledgement waits at most one round trip and `delay`.

Each insert is still admitted, checked and refused on its own by the
control plane (control/inserts.py): one refused (its rate limiter's
timeout passed, it was placed before the node was last unresponsive) fails
alone, and the others are registered. A request that fails as a whole (the
control plane went away) fails every insert in it, and each one's caller
retries or reports it as it did before.

The slots of every insert a reply registered are committed (made LIVE) in
one call when the reply comes, before any of the inserts' callers resumes:
a request's acknowledgement costs one slot-table update, not one per insert.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..protocol import STEP_FIELDS, batch_errors, check_reply
from ..transport.rpc import AsyncClient

# s added to a request's longest timeout before its reply is given up on
REPLY_GRACE = 10.0
# Inserts waiting for the next request that send it at once, delay or not:
# this many items, or this many bytes.
COALESCE_ITEMS = 256
COALESCE_BYTES = 1 << 20
# The request's joined fields the commit takes, in its order (steps last).
_COMMITTED = ("offsets", "keys", "generations", "priorities", *STEP_FIELDS)


@dataclass
class Stored:
    """An insert stored in slots, to be registered: its items' keys,
    offsets, generations, priorities, steps (a table of slices:
    episodes, positions, flags; else None), the monotonic time by which
    the rate limiter must have admitted it, and its bytes."""

    keys: np.ndarray
    offsets: np.ndarray
    generations: np.ndarray
    priorities: np.ndarray
    steps: tuple | None
    deadline: float
    done: asyncio.Future = field(default=None)  # type: ignore[assignment]
    nbytes: int = 0  # the items' bytes (COALESCE_BYTES)


@dataclass(frozen=True)
class Registered:
    """What registering an insert did: the items evicted from the table (the
    request's, counted once: on its last insert registered). Its slots are
    committed, but those of keys the table held already, which are freed."""

    evicted: int


# commit(table, offsets, keys, generations, priorities, steps, twice): make the
# registered slots LIVE and free `twice` (NodeState.commit_registered).
Commit = Callable[[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, "tuple | None",
                   np.ndarray], None]


class Registrations:
    """A node's `items_added` requests: one in flight per (control plane
    connection, node id, table, epoch); inserts stored meanwhile go in the
    next; `commit` makes the slots of those registered LIVE, a request's in
    one call. All on the node's event loop."""

    def __init__(self, used_bytes: Callable[[], int], commit: Commit, delay: float = 0.0):
        """`delay`: seconds the next request of a key may wait for more
        inserts after the last was sent (see the module; 0: none)."""
        self._used_bytes = used_bytes
        self._commit = commit
        self._delay = delay
        self._waiting: dict[tuple, list[Stored]] = {}  # a key in here: a request in flight
        # Keys whose next request waits for more inserts: what wakes it early,
        # and the items and bytes waiting meanwhile.
        self._held: dict[tuple, tuple[asyncio.Future, list[int]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.requests = 0  # items_added sent (metrics: inserts per request)
        self.inserts = 0
        # The node's event loop, asked once (Python 3.11's get_running_loop()
        # makes a getpid system call each time).
        self._loop: asyncio.AbstractEventLoop | None = None

    async def register(self, control: AsyncClient, node_id: int, table: str,
                       epoch: int | None, insert: Stored) -> Registered:
        """Register one stored insert; returns once the control plane has
        its items (or raises what refused it, or what failed the request)."""
        loop = self._loop = self._loop or asyncio.get_running_loop()
        insert.done = loop.create_future()
        key = (control, node_id, table, epoch, insert.steps is not None)
        waiting = self._waiting.get(key)
        if waiting is not None:  # a request is in flight: this one goes in the next
            waiting.append(insert)
            held = self._held.get(key)
            if held is not None:
                wake, size = held
                size[0] += len(insert.keys)
                size[1] += insert.nbytes
                if not wake.done() and _enough(*size):
                    wake.set_result(None)
        else:
            self._waiting[key] = []
            task = loop.create_task(self._send(key, [insert]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await insert.done

    async def _send(self, key: tuple, inserts: list[Stored]) -> None:
        """Send `inserts` in one request, then those that waited meanwhile,
        until none wait."""
        try:
            while inserts:
                inserts = [s for s in inserts if not s.done.done()]  # cancelled callers
                sent = self._loop.time()
                if inserts:
                    await self._request(key, inserts)
                await self._gather(key, sent)
                inserts = self._waiting[key]
                self._waiting[key] = []
        except BaseException as exc:
            for s in inserts + self._waiting.get(key, []):
                _fail(s, exc)
            raise
        finally:
            self._waiting.pop(key, None)

    async def _gather(self, key: tuple, sent: float) -> None:
        """Before the next request of `key` (the last sent at loop time
        `sent`): wait while few inserts wait, until enough come or `delay`
        has passed since `sent` (see the module)."""
        waiting = self._waiting[key]
        left = sent + self._delay - self._loop.time()
        if left <= 0 or not waiting:
            return
        size = [sum(len(s.keys) for s in waiting), sum(s.nbytes for s in waiting)]
        if _enough(*size):
            return
        wake = self._loop.create_future()
        self._held[key] = (wake, size)
        timer = self._loop.call_later(left, _settle_once, wake)
        try:
            await wake
        finally:
            timer.cancel()
            del self._held[key]

    async def _request(self, key: tuple, inserts: list[Stored]) -> None:
        """One items_added for `inserts`; settles each one's future."""
        control, node_id, table, epoch, has_steps = key
        now = time.monotonic()
        lefts = [max(0.0, s.deadline - now) for s in inserts]
        fields = {
            "node_id": node_id, "table": table,
            "keys": _joined([s.keys for s in inserts]),
            "offsets": _joined([s.offsets for s in inserts]),
            "generations": _joined([s.generations for s in inserts]),
            "priorities": _joined([s.priorities for s in inserts]),
            "used_bytes": self._used_bytes(),
            "timeout": max(lefts),
        }
        if epoch is not None:
            fields["epoch"] = epoch
        if has_steps:
            for j, name in enumerate(STEP_FIELDS):
                fields[name] = _joined([s.steps[j] for s in inserts])
        if len(inserts) > 1:
            fields["batches"] = [len(s.keys) for s in inserts]
            fields["timeouts"] = lefts
        self.requests += 1
        self.inserts += len(inserts)
        try:
            reply = await control.call("items_added", reply_timeout=max(lefts) + REPLY_GRACE,
                                       **fields)
            check_reply("items_added", reply, control.name)  # the map: once per request
            refused = batch_errors(reply, control.name)
        except Exception as exc:
            for s in inserts:
                _fail(s, exc)
            return
        self._settle(table, inserts, fields, reply, refused)

    def _settle(self, table: str, inserts: list[Stored], fields: dict, reply: dict,
                refused: dict[int, Exception]) -> None:
        """Commit the slots of the request's registered inserts in one call,
        then hand each insert its part of the reply, or its error."""
        taken = [i for i, s in enumerate(inserts) if i not in refused and not s.done.done()]
        twice = np.frombuffer(reply.get("duplicate_offsets", b""), np.uint64)
        if taken:
            names = _COMMITTED if STEP_FIELDS[0] in fields else _COMMITTED[:4]
            if len(taken) == len(inserts):
                cols = [fields[name] for name in names]
            else:  # refused or cancelled inserts' slots are their callers' to free
                mask = np.repeat(np.isin(np.arange(len(inserts)), taken),
                                 [len(s.keys) for s in inserts])
                cols = [fields[name][mask] for name in names]
            held = twice
            if len(twice):  # keys the table held already: their slots are freed
                dup = np.isin(cols[0], twice)
                held = cols[0][dup]
                cols = [c[~dup] for c in cols]
            offsets, keys, gens, prios, *steps = cols
            try:
                self._commit(table, offsets, keys, gens, prios, tuple(steps) or None, held)
            except Exception as exc:
                for i in taken:
                    _fail(inserts[i], exc)
        last = max((i for i in taken if not inserts[i].done.done()), default=-1)
        for i, s in enumerate(inserts):
            if s.done.done():  # its caller was cancelled meanwhile, or its commit failed
                continue
            if i in refused:
                s.done.set_exception(refused[i])
                continue
            s.done.set_result(Registered(reply["evicted"] if i == last else 0))


def _enough(items: int, nbytes: int) -> bool:
    """Whether inserts of `items` and `nbytes` in all, waiting for a key's
    next request, send it at once."""
    return items >= COALESCE_ITEMS or nbytes >= COALESCE_BYTES


def _settle_once(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """One array of the inserts' arrays (a lone insert's as it is: no copy)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _fail(s: Stored, exc: BaseException) -> None:
    """Fail one insert's registration with exc (cancel it if exc is a cancellation)."""
    if s.done.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        s.done.cancel()
    else:
        s.done.set_exception(exc)
