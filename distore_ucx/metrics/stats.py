"""What each process counts: plain counters its owner updates as it works.

A control plane's tables, the control plane itself, a storage node, a
learner and a writer each keep one of these and update it once per request
or batch; the collectors read them at scrape time (:mod:`.families`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .histogram import Histogram


@dataclass
class TableStats:
    """A table's counters beyond inserts, samples and deletes (control plane)."""

    holds: Counter = field(default_factory=Counter)  # op -> calls a rate limiter held
    timeouts: Counter = field(default_factory=Counter)  # op -> held calls that timed out
    waiting: Counter = field(default_factory=Counter)  # op -> calls held now
    priority_updates: int = 0  # keys whose priority was set
    priority_missing: int = 0  # keys of updates that were no longer in the table
    decision: Histogram = field(default_factory=Histogram)  # sample decision, per request


@dataclass
class ControlStats:
    """The control plane's own counters."""

    membership: Counter = field(default_factory=Counter)  # joined/rejoined/left/dropped
    checkpoints: int = 0
    checkpoint_failures: int = 0


@dataclass
class NodeStats:
    """A storage node's insert counters (one update per acknowledged batch)."""

    batches: int = 0
    items: int = 0
    bytes: int = 0
    failed_batches: int = 0
    latency: Histogram = field(default_factory=Histogram)  # request to acknowledgement

    def inserted(self, items: int, nbytes: int, seconds: float) -> None:
        """Count one acknowledged batch."""
        self.batches += 1
        self.items += items
        self.bytes += nbytes
        self.latency.observe(seconds)


@dataclass
class LearnerStats:
    """A learner's counters (one update per batch or per gather)."""

    fetched_items: Counter = field(default_factory=Counter)  # path -> items read
    fetched_bytes: Counter = field(default_factory=Counter)  # path -> bytes read
    # UCX reads posted (gets, and parts of same-host CMA items), added to
    # natively by each gather: a run of slots that follow each other in an
    # arena (a slice's steps) is one get.
    ucx_reads: np.ndarray = field(default_factory=lambda: np.zeros(1, np.uint64))
    batches: int = 0
    gather: Histogram = field(default_factory=Histogram)  # one gather (all paths)
    wait_seconds: float = 0.0  # iterating: time the caller waited for a batch
    iter_started: float | None = None  # monotonic time of the first iteration

    def fetched(self, path: str, items: int, nbytes: int) -> None:
        """Count `items` read over `path` ("mapped" or "ucx")."""
        self.fetched_items[path] += items
        self.fetched_bytes[path] += nbytes

    def waited(self, seconds: float) -> None:
        """The caller waited `seconds` for the next prefetched batch."""
        if self.iter_started is None:
            self.iter_started = time.monotonic() - seconds
        self.wait_seconds += seconds

    def wait_ratio(self) -> float:
        """Share of wall time since iterating began spent waiting for data (0..1)."""
        if self.iter_started is None:
            return 0.0
        wall = time.monotonic() - self.iter_started
        return min(1.0, self.wait_seconds / wall) if wall > 0 else 0.0


@dataclass
class WriterStats:
    """A writer's counters (one update per acknowledged batch)."""

    batches: int = 0
    items: int = 0
    bytes: int = 0
    latency: Histogram = field(default_factory=Histogram)  # sent to acknowledged
