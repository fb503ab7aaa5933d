"""Rate limiters: when inserts and samples may proceed, as in Reverb.

A limiter tracks diff = inserts * samples_per_insert - samples. An insert
may proceed while the table is below `min_size_to_sample` or while the diff
after it stays <= max_diff; a sample may proceed once the table holds at
least `min_size_to_sample` items and the diff after it stays >= min_diff.

This module only decides. A call that may not proceed yet waits on the
control plane (control/admission.py holds it, up to its timeout, until the
table's counts change), and then raises RateLimiterTimeout with the
current counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class RateLimiter:
    """A rate limiter; make one with `MinSize`, `SampleToInsertRatio` or `Queue`.

    It tracks diff = inserts * samples_per_insert - samples: an insert may
    proceed while the table is below `min_size_to_sample` or while the diff
    after it stays <= `max_diff`; a sample once the table holds at least
    `min_size_to_sample` items and while the diff after it stays >=
    `min_diff`.

    Attributes:
        kind: "min_size", "sample_to_insert_ratio" or "queue".
        samples_per_insert: The ratio the diff counts by.
        min_size_to_sample: Items the table needs before samples proceed.
        min_diff: The smallest diff a sample may leave.
        max_diff: The largest diff an insert may leave.

    Raises:
        ConfigError: `samples_per_insert` is not > 0, `min_size_to_sample`
            < 1, or `min_diff` > `max_diff`.
    """

    kind: str
    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float

    def __post_init__(self):
        if not self.samples_per_insert > 0 or not math.isfinite(self.samples_per_insert):
            raise ConfigError(f"samples_per_insert must be > 0, got {self.samples_per_insert}")
        if self.min_size_to_sample < 1:
            raise ConfigError(f"min_size_to_sample must be >= 1, got {self.min_size_to_sample}")
        if self.min_diff > self.max_diff:
            raise ConfigError(f"min_diff {self.min_diff} > max_diff {self.max_diff}")

    # -- decisions -------------------------------------------------------
    def can_insert(self, size: int, inserts: int, samples: int, n: int) -> bool:
        """May n more items be inserted now?"""
        if size + n <= self.min_size_to_sample:
            return True
        return (inserts + n) * self.samples_per_insert - samples <= self.max_diff

    def can_sample(self, size: int, inserts: int, samples: int, n: int) -> bool:
        """May n more samples be taken now?"""
        if size < self.min_size_to_sample:
            return False
        return inserts * self.samples_per_insert - samples - n >= self.min_diff

    def admits_insert_batch(self, n: int) -> bool:
        """Could a batch of n inserts ever be admitted at once?"""
        return (n <= self.min_size_to_sample
                or n * self.samples_per_insert <= self.max_diff - self.min_diff)

    def state(self, size: int, inserts: int, samples: int) -> dict:
        """Counters and thresholds, for table_info and error messages."""
        return {
            "kind": self.kind,
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
            "diff": inserts * self.samples_per_insert - samples,
            "can_insert": self.can_insert(size, inserts, samples, 1),
            "can_sample": self.can_sample(size, inserts, samples, 1),
        }

    def to_wire(self) -> dict:
        """The form create_table sends (infinities as None)."""
        return {
            "kind": self.kind,
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": None if math.isinf(self.min_diff) else self.min_diff,
            "max_diff": None if math.isinf(self.max_diff) else self.max_diff,
        }

    @classmethod
    def from_wire(cls, value: Any) -> RateLimiter:
        """From create_table's form."""
        if isinstance(value, RateLimiter):
            return value
        try:
            lo, hi = value.get("min_diff"), value.get("max_diff")
            return cls(
                str(value["kind"]),
                float(value["samples_per_insert"]),
                int(value["min_size_to_sample"]),
                -math.inf if lo is None else float(lo),
                math.inf if hi is None else float(hi),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed rate limiter {value!r}: {exc}") from None


def MinSize(min_size_to_sample: int = 1) -> RateLimiter:  # noqa: N802 - Reverb's names
    """Samples wait until the table holds `min_size_to_sample` items; inserts never wait.

    Raises:
        ConfigError: `min_size_to_sample` < 1.
    """
    return RateLimiter("min_size", 1.0, int(min_size_to_sample), -math.inf, math.inf)


def SampleToInsertRatio(  # noqa: N802
    samples_per_insert: float, min_size_to_sample: int, error_buffer: float
) -> RateLimiter:
    """Keep samples per insert near `samples_per_insert`, within `error_buffer`.

    Inserts wait when they run too far ahead of samples, samples when they
    run too far ahead of inserts (Reverb's SampleToInsertRatio).

    Args:
        samples_per_insert: The ratio to keep.
        min_size_to_sample: Items the table needs before samples proceed.
        error_buffer: How far the diff (inserts * samples_per_insert -
            samples) may stray from its value at `min_size_to_sample`.

    Raises:
        ConfigError: `error_buffer` is below max(1, `samples_per_insert`)
            (neither inserts nor samples could proceed), or another argument
            is out of range.
    """
    if error_buffer < 0:
        raise ConfigError(f"error_buffer must be >= 0, got {error_buffer}")
    if error_buffer < max(1.0, samples_per_insert):
        raise ConfigError(
            f"error_buffer {error_buffer} must be at least max(1, samples_per_insert="
            f"{samples_per_insert}) or neither inserts nor samples could ever proceed"
        )
    offset = samples_per_insert * min_size_to_sample
    return RateLimiter(
        "sample_to_insert_ratio",
        float(samples_per_insert),
        int(min_size_to_sample),
        offset - error_buffer,
        offset + error_buffer,
    )


def Queue(size: int) -> RateLimiter:  # noqa: N802
    """A queue of at most `size` unsampled items: each item is sampled exactly
    once, in insertion order (the table gets Fifo sampler and remover and
    max_times_sampled=1). Inserts wait while the queue is full, samples while
    it is empty.

    Raises:
        ConfigError: `size` < 1.
    """
    if size < 1:
        raise ConfigError(f"queue size must be >= 1, got {size}")
    return RateLimiter("queue", 1.0, 1, 0.0, float(size))


# kind -> (constructor, its arguments), for rate limiters written in distore.toml
_CONFIG_KINDS = {
    "min_size": (MinSize, ("min_size_to_sample",)),
    "sample_to_insert_ratio": (SampleToInsertRatio,
                               ("samples_per_insert", "min_size_to_sample", "error_buffer")),
    "queue": (Queue, ("size",)),
}


def from_config(value: Any) -> RateLimiter:
    """A rate limiter as a ``[[tables]]`` entry writes it: its kind and its
    constructor's arguments, e.g. ``{kind = "queue", size = 1000}``."""
    if not isinstance(value, dict) or value.get("kind") not in _CONFIG_KINDS:
        raise ConfigError(f"expected {{kind = ..., ...}} with kind one of "
                          f"{', '.join(_CONFIG_KINDS)}, got {value!r}")
    make, names = _CONFIG_KINDS[value["kind"]]
    unknown = sorted(set(value) - {"kind", *names})
    missing = [n for n in names if n not in value and make is not MinSize]
    if unknown or missing:
        raise ConfigError(f"{value['kind']} takes {', '.join(names)}"
                          + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                          + (f"; missing: {', '.join(missing)}" if missing else ""))
    args = {n: value[n] for n in names if n in value}
    for n, v in args.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{value['kind']}: {n} must be a number, got {v!r}")
    return make(**args)
