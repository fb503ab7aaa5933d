"""The keys a writer gives its items.

A key is `writer_id << key_bits | seq` for seq below 2**key_bits: the control
plane hands each writer an id (register_writer), so keys are unique across
it without a request per item. A writer that used up its id's keys takes the
next id (one request per 2**key_bits items). Keys are given in insertion
order and never reused.
"""

from __future__ import annotations

import numpy as np

from ...protocol import parse_reply


class KeyRange:
    """The writer id and the keys it has given so far. Its `writer_id` also
    names the writer in its parts' log lines."""

    def __init__(self, client):
        self._client = client
        self.take(client.call("register_writer"))

    def take(self, reply: dict) -> None:
        """Keys from a register_writer reply: `writer_id << key_bits | seq`
        for seq below 2**key_bits."""
        got = parse_reply("register_writer", reply, "control plane")
        self.writer_id = got.writer_id
        self.base = self.writer_id << got.key_bits  # the key of seq 0
        self.count = 1 << got.key_bits
        self.seq = 0  # keys given so far

    def make_room(self, n: int) -> None:
        """Make room for n more keys: a writer id's keys used up, take the
        next id (one request per 2**24 items)."""
        if self.seq + n <= self.count:
            return
        if n > self.count:
            raise ValueError(f"insert at most {self.count} items in one call, got {n}")
        self.take(self._client.call("register_writer", previous=self.writer_id))

    def peek(self, n: int) -> np.ndarray:
        """The next n keys (uint64), not given yet (make room first)."""
        return key_span(self.base + self.seq, n)

    def give(self, n: int) -> int:
        """Give the next n keys (taking the next writer id first if this
        one's are used up); returns the first, the rest follow it
        (key_span). A key given is never given again.

        >>> keys = key_span(given.give(4), 4)
        """
        if self.seq + n > self.count:
            self.make_room(n)
        first = self.base + self.seq
        self.seq += n
        return first


def key_span(first: int, n: int) -> np.ndarray:
    """The n keys from `first` on (uint64)."""
    return np.uint64(first) + np.arange(n, dtype=np.uint64)
