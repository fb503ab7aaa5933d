"""Closed objects: a client, writer or learner used after close() says so.

Its own module so that client.py, writer.py and learner.py all import it
and none of them imports another to get it.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..errors import Closed

# Learners closed so far (they keep no flag of their own); see ensure_open.
_CLOSED: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_closed(obj: Any) -> None:
    """Remember that `obj` (a Learner) was closed, so that ensure_open refuses it."""
    _CLOSED.add(obj)


def ensure_open(obj: Any, what: str) -> None:
    """Raise Closed when `obj` (a client, writer or learner) was closed.

    Called first thing by their public methods, so that a closed object
    says so instead of failing somewhere deep inside.
    """
    if getattr(obj, "_closed", False) is True or obj in _CLOSED:
        table = getattr(obj, "table", None)
        which = f"{what} of table {table!r}" if isinstance(table, str) else what
        raise Closed(f"this {which} is closed: {_REOPEN.get(what, 'make a new one')}")


_REOPEN = {
    "client": "connect again with ds.connect(address)",
    "writer": "make a new one with client.writer()",
    "learner": "make a new one with client.learner(table, batch_size)",
}


def check_insert(writer: Any, table: str, data: Any, priority: Any) -> None:
    """What Writer.insert checks before packing: the writer is open, and a
    per-item priority list has one value per item."""
    ensure_open(writer, "writer")
    prio = np.asarray(priority)
    if prio.ndim == 0:
        return
    n = writer._client.spec(table).count(data)
    if prio.shape != (n,) and prio.size != 1:
        raise ValueError(
            f"table {table!r}: {prio.size} priorities (shape {prio.shape}) for {n} items: "
            "give one priority per item, or one scalar for all"
        )


__all__ = ["check_insert", "ensure_open", "mark_closed"]
