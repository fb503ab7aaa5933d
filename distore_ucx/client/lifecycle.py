"""Closed objects: a client, writer or learner used after close() says so.

Its own module so that client.py, the writer (writer/) and the learner
(learner/) all import it and none of them imports another to get it.
"""

from __future__ import annotations

import weakref
from typing import Any

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


__all__ = ["ensure_open", "mark_closed"]
