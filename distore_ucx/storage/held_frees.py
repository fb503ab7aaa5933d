"""A storage node's registrations in flight, and the frees held behind them.

An insert's registration is in flight from its `items_added` request until
the insert has committed its slots or failed. The control plane may free
items of a registration whose reply came in but whose insert has not
committed its slots yet (the reply and the free arrive together; the insert
resumes after the free is handled): such a free would find nothing LIVE,
and the slots would stay taken for good. So a free that comes while
registrations are in flight waits until those are done; frees are applied in
the order they came. Thread safety: used from the node's event loop only.
"""

from __future__ import annotations

from collections.abc import Callable


class HeldFrees:
    """Registrations in flight by sequence number, and the control plane's
    frees held until the registrations in flight when they came are done.

    `apply(fields)` frees what a `free` push names.

    >>> frees = HeldFrees(apply)
    >>> n = frees.begin()          # an insert sends items_added
    >>> frees.free(fields)         # held: registration n is in flight
    >>> frees.end(n)               # applied now
    """

    def __init__(self, apply: Callable[[dict], None]):
        self._apply = apply
        self._registering: set[int] = set()
        self._registrations = 0
        self._held: list[tuple[int, dict]] = []

    def begin(self) -> int:
        """A registration starts; returns its sequence number for `end`."""
        self._registrations += 1
        self._registering.add(self._registrations)
        return self._registrations

    def end(self, registration: int) -> None:
        """Registration `registration` is done (committed or failed): apply
        the frees whose registrations are all done."""
        self._registering.discard(registration)
        if not self._held:  # the common case: nothing waits (min() is a scan)
            return
        oldest = min(self._registering, default=None)
        while self._held and (oldest is None or self._held[0][0] < oldest):
            self._apply(self._held.pop(0)[1])

    def free(self, fields: dict) -> None:
        """A free from the control plane: applied now, or held until the
        registrations in flight now are done."""
        if self._registering:
            self._held.append((max(self._registering), fields))
        else:
            self._apply(fields)
