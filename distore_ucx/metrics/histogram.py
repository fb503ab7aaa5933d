"""The latency histogram the processes count once per batch."""

from __future__ import annotations

from bisect import bisect_left

# Seconds; from a fast sample decision (tens of us) to a rate-limited insert.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A latency histogram counted once per batch, exported at scrape time.

    ``observe`` is one bisect and two additions (no lock: each histogram is
    fed by one thread). Buckets follow Prometheus: ``le`` is inclusive.

    >>> h = Histogram((0.001, 0.01))
    >>> h.observe(0.002); h.observe(0.5)
    >>> h.cumulative()
    [('0.001', 0), ('0.01', 1), ('+Inf', 2)]
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bucket, +Inf last: Prometheus' form."""
        counts = list(self.counts)  # one consistent copy
        out, total = [], 0
        for bound, c in zip(self.bounds + (float("inf"),), counts):
            total += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """(buckets, sum) for a collector, copied now."""
        return self.cumulative(), self.sum
