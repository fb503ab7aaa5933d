"""Admission: holding inserts and samples until a table's rate limiter lets
them through, as Reverb's RateLimiter blocks its callers.

rate_limiters.py decides whether a call may proceed now; this module holds
a call that may not (without holding the event loop) until a change to the
table's counts lets it through or its timeout passes, and then raises
RateLimiterTimeout with the counts (NoData when a sample finds too few
items). Whatever changes a table's counts (an insert, a sample, a release,
an eviction, a priority update) calls `touch`, which wakes the calls held on
that table to check again.

Each held call is counted in the table's stats (holds, waiting, timeouts),
read at scrape time (metrics/families.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..errors import ConfigError, NoData, RateLimiterTimeout
from .tables import Table


class Admission:
    """Calls held by tables' rate limiters, and the events that wake them.

    All on the control plane's event loop: no locks.
    """

    def __init__(self):
        self._changed: dict[str, asyncio.Event] = {}  # set when a table's counts change

    def touch(self, table: Table) -> None:
        """Wake every call waiting on this table's rate limiter."""
        event = self._changed.pop(table.name, None)
        if event is not None:
            event.set()

    async def insert(self, table: Table, n: int, timeout: float) -> None:
        """Return once a batch of n inserts may proceed; ConfigError if its
        rate limiter can never admit that many at once, RateLimiterTimeout
        after `timeout` seconds."""
        if not table.rate_limiter.admits_insert_batch(n):
            raise ConfigError(
                f"table {table.name!r}: its {table.rate_limiter.kind} rate limiter can never "
                f"admit a batch of {n} inserts at once; send smaller batches "
                "(client.writer(max_items=...))"
            )
        await self._wait(table, lambda: table.can_insert(n), "insert", n, timeout)

    async def sample(self, table: Table, n: int, timeout: float) -> None:
        """Return once n items may be sampled; NoData (too few items) or
        RateLimiterTimeout after `timeout` seconds."""
        await self._wait(table, lambda: table.can_sample(n), "sample", n, timeout)

    async def _wait(self, table: Table, ready: Callable[[], bool], what: str, n: int,
                    timeout: float) -> None:
        """Wait until ready() holds, or raise RateLimiterTimeout (NoData when too few items)."""
        deadline = time.monotonic() + timeout
        if ready():
            return
        stats = table.stats  # metrics: one hold per held call
        stats.holds[what] += 1
        stats.waiting[what] += 1
        try:
            await self._hold(table, ready, what, n, timeout, deadline)
        except RateLimiterTimeout:  # NoData too
            stats.timeouts[what] += 1
            raise
        finally:
            stats.waiting[what] -= 1

    async def _hold(self, table: Table, ready: Callable[[], bool], what: str, n: int,
                    timeout: float, deadline: float) -> None:
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(table, what, n, timeout)
            event = self._changed.setdefault(table.name, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass


def _timed_out(table: Table, what: str, n: int, timeout: float) -> RateLimiterTimeout:
    """The error of a call held past its timeout, with the table's counts."""
    state = table.limiter_state()
    counts = (
        f"size {table.size}, inserts {table.inserts}, samples {table.samples}, "
        f"diff {state['diff']:g} (allowed {state['min_diff']:g}..{state['max_diff']:g})"
    )
    if what == "sample" and table.size < max(1, state["min_size_to_sample"]):
        return NoData(
            f"table {table.name!r} has no items to sample yet ({counts}; needs "
            f"{state['min_size_to_sample']}); insert and flush first, or wait longer"
        )
    return RateLimiterTimeout(
        f"table {table.name!r}: the {state['kind']} rate limiter held "
        f"{'an' if what == 'insert' else 'a'} {what} of {n} "
        f"items for {timeout:g} s ({counts}). "
        + ("Sample more, or insert more slowly."
           if what == "insert" else "Insert more, or sample more slowly.")
    )
