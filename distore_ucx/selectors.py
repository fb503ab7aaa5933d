"""Selectors: how a table picks the item to sample, or to evict at capacity.

Semantics follow Reverb's selectors of the same names, so a table moves
over without surprises. Any selector can serve as sampler or as remover.

>>> client.create_table("replay", capacity=10**6, spec=spec,
...                     sampler=ds.Prioritized(0.6), remover=ds.Fifo())
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

KINDS = ("uniform", "prioritized", "fifo", "lifo", "min_heap", "max_heap")


@dataclass(frozen=True)
class Selector:
    """A selection policy; make one with `Uniform`, `Prioritized`, `Fifo`,
    `Lifo`, `MinHeap` or `MaxHeap`.

    Attributes:
        kind: "uniform", "prioritized", "fifo", "lifo", "min_heap" or "max_heap".
        alpha: The priority exponent of a prioritized selector.
    """

    kind: str
    alpha: float = 1.0

    def to_wire(self) -> dict:
        """The form create_table sends (and table_info shows): alpha only
        where it means something, for a prioritized selector."""
        if self.kind == "prioritized":
            return {"kind": self.kind, "alpha": self.alpha}
        return {"kind": self.kind}

    @classmethod
    def from_wire(cls, value: Any, role: str) -> Selector:
        """From a wire dict or a plain name ("uniform", "fifo", ...)."""
        if isinstance(value, Selector):
            return value
        if isinstance(value, str):
            value = {"kind": value}
        if not isinstance(value, dict) or value.get("kind") not in KINDS:
            raise ConfigError(f"{role} {value!r} is not one of {', '.join(KINDS)}")
        alpha = value.get("alpha", 1.0)
        if (
            not isinstance(alpha, (int, float))
            or isinstance(alpha, bool)
            or not math.isfinite(alpha)
            or alpha < 0
        ):
            raise ConfigError(f"{role} alpha must be a finite number >= 0, got {alpha!r}")
        return cls(value["kind"], float(alpha))


def Uniform() -> Selector:  # noqa: N802 - Reverb's names
    """Every item equally likely (probability 1/size), with replacement."""
    return Selector("uniform")


def Prioritized(alpha: float = 1.0) -> Selector:  # noqa: N802
    """Item i with probability p_i^alpha / sum_j p_j^alpha (sum tree, O(log n)).

    If every priority is 0, items are drawn uniformly.

    Args:
        alpha: The priority exponent: 0 draws uniformly, 1 in proportion to
            the priorities.

    Raises:
        ConfigError: `alpha` is not a finite number >= 0.
    """
    return Selector.from_wire({"kind": "prioritized", "alpha": alpha}, "Prioritized")


def Fifo() -> Selector:  # noqa: N802
    """The oldest item (probability 1)."""
    return Selector("fifo")


def Lifo() -> Selector:  # noqa: N802
    """The newest item (probability 1)."""
    return Selector("lifo")


def MinHeap() -> Selector:  # noqa: N802
    """The item of lowest priority, oldest first among equals (probability 1)."""
    return Selector("min_heap")


def MaxHeap() -> Selector:  # noqa: N802
    """The item of highest priority, oldest first among equals (probability 1)."""
    return Selector("max_heap")
