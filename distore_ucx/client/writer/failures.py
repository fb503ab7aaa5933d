"""What a writer's failed insert says: the keys stored and not, and why it waited.

Nothing is dropped silently: when a batch fails, the writer settles every
other batch (client/writer/in_flight.py) and `insert`/`flush` raises the
batch's error with `stored_keys`, `unstored_keys` and `not_stored` (the
count) set, its message saying so; a rate-limiter timeout that came from
inserting and sampling on one thread says that too.
"""

from __future__ import annotations

import numpy as np

from ...errors import RateLimiterTimeout


class Failed(Exception):
    """Internal: a batch failed and the writer has settled; carries the counts
    until the public call adds the keys it had not staged yet and re-raises
    the original error."""

    def __init__(self, exc: Exception, stored: list, unstored: list, hint: str):
        super().__init__(str(exc))
        self.exc, self.stored, self.unstored, self.hint = exc, stored, unstored, hint

    def raise_with(self, more: np.ndarray | None):
        """Raise the original error, its message and attributes completed."""
        exc = self.exc
        unstored = self.unstored + ([more] if more is not None and len(more) else [])
        empty = np.empty(0, np.uint64)
        exc.stored_keys = np.concatenate(self.stored) if self.stored else empty
        exc.unstored_keys = np.concatenate(unstored) if unstored else empty
        exc.not_stored = len(exc.unstored_keys)
        text = exc.args[0] if exc.args else str(exc)
        exc.args = (
            (f"{text} [{len(exc.stored_keys)} other items in flight were stored (.stored_keys) "
             f"and the writer holds nothing now; .unstored_keys: {exc.not_stored} items not "
             f"stored]{self.hint}"),
        )
        raise exc


def waiting_for_samples(client, table: str, n: int) -> dict | None:
    """The table's info when its rate limiter admits no more inserts (`n`
    more items) until it is sampled; None when it does not, or when the
    control plane cannot say."""
    try:
        info = client.table_info(table)
        state = info.get("rate_limiter_state")
        if not state or (info["size"] + n <= state["min_size_to_sample"]
                         or state["diff"] + n * state["samples_per_insert"]
                         <= state["max_diff"]):
            return None  # it is not waiting for samples
    except Exception:  # a courtesy to the user: nothing depends on it
        return None
    return info


def deadlock_hint(client, exc: Exception, table: str, n: int) -> str:
    """When the table admits no more inserts until it is sampled, say that
    a process that both inserts and samples on one thread waits forever."""
    if not isinstance(exc, RateLimiterTimeout):
        return ""
    info = waiting_for_samples(client, table, n)
    if info is None:
        return ""
    return (
        f" Table {table!r} takes no more inserts until it is sampled (samples so far: "
        f"{info['samples']}). If the process that samples it is this one (inserting and "
        "sampling from one thread), it deadlocks: sample from another thread or process, "
        "flush in smaller steps between samples, or loosen the rate limiter."
    )
