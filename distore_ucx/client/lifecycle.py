"""Closed objects: a client, writer or learner used after close() says so;
and closing one on a `with` exit, also while a ^C unwinds.

Its own module so that client.py, the writer (writer/) and the learner
(learner/) all import it and none of them imports another to get it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ..errors import Closed, DistoreError

log = logging.getLogger(__name__)

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


def close_on_exit(obj: Any, what: str, exc_type: type | None) -> None:
    """The `with` exit of a client or writer (`what`): close it. While a ^C
    unwinds (`exc_type` KeyboardInterrupt; the store may have stopped with
    it), what closing fails at is logged, not raised over the interrupt: it
    printed a traceback of its own in every worker process of a script."""
    if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        obj.close()
        return
    try:
        obj.close()
    except DistoreError as exc:
        log.info("closing the %s on ^C: %s", what, exc)


__all__ = ["close_on_exit", "ensure_open", "mark_closed"]
