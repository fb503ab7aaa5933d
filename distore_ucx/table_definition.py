"""What a table is: name, capacity, spec, sampler, remover, rate limiter,
max_times_sampled and, for a table of episodes' steps, the slice length
and period, parsed and checked in one place.

Every way of making a table goes through :class:`TableDefinition`:
``client.create_table`` builds one and sends ``to_wire()``; the control
plane's create-table handler, a ``[[tables]]`` entry of distore.toml
(``from_config``) and a checkpoint (``from_wire``) make the same object, so
a rule (a Queue needs Fifo selectors, a capacity of at least the queue
size, ...) is written once and holds on every path.

This module imports no UCX: ``distore config check`` uses it.

>>> d = TableDefinition.make("replay", 1000, {"obs": ((4,), "float32")}, sampler="prioritized")
>>> TableDefinition.from_wire(d.to_wire()) == d
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .rate_limiters import MinSize, RateLimiter
from .rate_limiters import from_config as _limiter_from_config
from .selectors import KINDS, Fifo, Selector, Uniform
from .spec import TableSpec

MAX_NAME = 128  # protocol.MAX_NAME; a table name is a name on the wire
# A table of slices' short slices, by SliceIndex pad number: "none", strict
# (every slice has slice_len steps of one episode); "end", a slice may start
# at any (period) step and is cut short by its episode's end; "short_episodes",
# an episode shorter than slice_len, or what is left of one after its oldest
# steps were evicted, is one short slice, whole (TorchRL's strict_length=False).
# Short slices are padded to slice_len by repeating their last step, and
# samples say which rows are padding (a mask).
SLICE_PADS = ("none", "end", "short_episodes")
MAX_CAPACITY = 2**40  # the create_table message's bound


class TableProblems(ConfigError):
    """Every problem of one table definition, not only the first: what
    `TableDefinition.from_config` raises (a `ConfigError`).

    Attributes:
        problems: One message a problem.
    """

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class TableDefinition:
    """A table's definition, checked: build it with :meth:`make`,
    :meth:`from_wire` or :meth:`from_config`, never field by field.

    Attributes:
        name: The table's name.
        capacity: Items it holds (steps, for a table of slices).
        spec: Its `TableSpec`.
        sampler: The `Selector` a sample draws with.
        remover: The `Selector` that picks what leaves at capacity.
        rate_limiter: Its `RateLimiter`.
        max_times_sampled: An item leaves after its k-th sample (0: never).
        slice_len: Steps in a slice; 0 for a table of items.
        slice_period: Slices start at positions that are multiples of it.
        slice_pad: Which short slices it samples: "none", "end" or
            "short_episodes" (`Client.create_table` says which).
    """

    name: str
    capacity: int
    spec: TableSpec
    sampler: Selector
    remover: Selector
    rate_limiter: RateLimiter
    max_times_sampled: int = 0
    # A table of steps of episodes (docs/semantics.md, "Slices"): a sample
    # is slices of `slice_len` consecutive steps of one episode, starting at
    # a step whose position is a multiple of `slice_period`. 0: items.
    slice_len: int = 0
    slice_period: int = 1
    # Which starts near an episode's end give short slices, padded by
    # repeating their last step (SLICE_PADS; "none": strict slices only).
    slice_pad: str = "none"

    @property
    def slices(self) -> bool:
        """Whether it holds steps of episodes, sampled as slices."""
        return self.slice_len > 0

    @classmethod
    def make(cls, name: str, capacity: int, spec: Any, sampler: Any = None, remover: Any = None,
             rate_limiter: Any = None, max_times_sampled: int = 0, slice_len: int = 0,
             slice_period: int = 1, slice_pad: str = "none") -> TableDefinition:
        """Check every part and fill in the defaults (Uniform sampler, Fifo
        remover, MinSize(1)); a Queue gets Fifo selectors and
        max_times_sampled=1. `slice_len` > 0 makes a table of steps sampled
        as slices (a Uniform or Prioritized sampler over slice starts).
        The arguments are `Client.create_table`'s; selectors and rate
        limiters may also come in their wire form (dicts, names).

        Returns:
            The checked `TableDefinition`.

        Raises:
            ConfigError: A part is invalid, or the parts do not fit together
                (a Queue with another sampler, a capacity below the queue
                size or the slice length, ...); the message says what to do.
        """
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
            raise ConfigError(f"table name {name!r} must be 1-{MAX_NAME} printable characters")
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not 1 <= capacity <= MAX_CAPACITY:
            raise ConfigError(f"table {name!r}: capacity must be a positive integer "
                              f"(at most 2**40), got {capacity!r}")
        if isinstance(max_times_sampled, bool) or not isinstance(max_times_sampled, int) \
                or not 0 <= max_times_sampled < 2**31:
            raise ConfigError(f"table {name!r}: max_times_sampled must be an integer >= 0, "
                              f"got {max_times_sampled!r}")
        parsed = spec if isinstance(spec, TableSpec) else TableSpec.parse(spec)
        sampler = None if sampler is None else Selector.from_wire(sampler, "sampler")
        remover = None if remover is None else Selector.from_wire(remover, "remover")
        if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
            rate_limiter = RateLimiter.from_wire(rate_limiter)
        limiter = rate_limiter or MinSize(1)
        if limiter.kind == "queue":
            # A queue hands out each item once, oldest first.
            sampler, remover = sampler or Fifo(), remover or Fifo()
            if sampler.kind != "fifo" or remover.kind != "fifo" or max_times_sampled not in (0, 1):
                raise ConfigError(
                    f"table {name!r}: a Queue rate limiter needs the Fifo sampler and remover "
                    "and max_times_sampled=1 (leave them unset)"
                )
            max_times_sampled = 1
            if capacity < limiter.max_diff:
                raise ConfigError(
                    f"table {name!r}: capacity {capacity} is smaller than the queue size "
                    f"{int(limiter.max_diff)}: items would be evicted before being sampled"
                )
        for what, value, lo in (("slice_len", slice_len, 0), ("slice_period", slice_period, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < 2**20:
                raise ConfigError(f"table {name!r}: {what} must be an integer >= {lo} "
                                  f"(below 2**20), got {value!r}")
        if slice_pad not in SLICE_PADS:
            raise ConfigError(f"table {name!r}: slice_pad must be one of "
                              f"{', '.join(map(repr, SLICE_PADS))}, got {slice_pad!r}")
        if slice_pad != "none" and not slice_len:
            raise ConfigError(f"table {name!r}: slice_pad={slice_pad!r} is for a table of "
                              "slices: give slice_len too, or leave slice_pad out")
        if slice_len:
            kind = (sampler or Uniform()).kind
            if kind not in ("uniform", "prioritized"):
                raise ConfigError(
                    f"table {name!r}: a table of slices draws slice starts uniformly or by "
                    f"priority: use ds.Uniform() or ds.Prioritized(alpha) as its sampler, not "
                    f"{kind!r}")
            if limiter.kind == "queue" or max_times_sampled:
                raise ConfigError(
                    f"table {name!r}: a table of slices takes no Queue rate limiter and no "
                    "max_times_sampled (a step is in many slices): leave them unset")
            if capacity < slice_len:
                raise ConfigError(f"table {name!r}: capacity {capacity} holds no slice of "
                                  f"{slice_len} steps: raise the capacity (it counts steps)")
        return cls(name, capacity, parsed, sampler or Uniform(), remover or Fifo(), limiter,
                   max_times_sampled, slice_len, slice_period, slice_pad)

    # -- the wire and checkpoints ----------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """The create_table fields (also what a checkpoint stores); a table
        of items leaves the slice fields out."""
        d = {
            "name": self.name, "capacity": self.capacity, "spec": self.spec.to_wire(),
            "sampler": self.sampler.to_wire(), "remover": self.remover.to_wire(),
            "rate_limiter": self.rate_limiter.to_wire(),
            "max_times_sampled": self.max_times_sampled,
        }
        if self.slice_len:
            d["slice_len"] = self.slice_len
            d["slice_period"] = self.slice_period
            if self.slice_pad != "none":
                d["slice_pad"] = self.slice_pad
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TableDefinition:
        """From create_table's fields (a request, or a checkpoint); optional
        fields may be missing.

        Args:
            d: The fields, as `to_wire` gives them.

        Returns:
            The checked `TableDefinition`.

        Raises:
            ConfigError: A required field is missing, or the definition is
                invalid (as `make`).
        """
        try:
            return cls.make(d["name"], d["capacity"], TableSpec.from_wire(d["spec"]),
                            d.get("sampler"), d.get("remover"), d.get("rate_limiter"),
                            d.get("max_times_sampled", 0), d.get("slice_len", 0),
                            d.get("slice_period", 1), d.get("slice_pad", "none"))
        except KeyError as exc:
            raise ConfigError(f"a table definition without {exc}: {dict(d)!r}") from None

    # -- distore.toml ----------------------------------------------------
    CONFIG_KEYS = ("name", "capacity", "spec", "sampler", "remover", "rate_limiter",
                   "max_times_sampled", "slice_len", "slice_period", "slice_pad")

    @classmethod
    def from_config(cls, entry: Any) -> TableDefinition:
        """One ``[[tables]]`` entry of distore.toml (or one object of
        ``--tables`` JSON).

        ``sampler`` and ``remover`` are names ("prioritized") or tables
        (``{kind = "prioritized", alpha = 0.6}``); ``rate_limiter`` takes
        the arguments of its constructor: ``{kind = "min_size",
        min_size_to_sample = 100}``, ``{kind = "sample_to_insert_ratio",
        samples_per_insert = 8, min_size_to_sample = 1000, error_buffer =
        800}`` or ``{kind = "queue", size = 1000}``.

        Args:
            entry: The entry, as a mapping (TOML's arrays for shapes).

        Returns:
            The checked `TableDefinition`.

        Raises:
            TableProblems: The entry has problems; it lists every one.
        """
        if not isinstance(entry, Mapping):
            raise TableProblems([f"expected a table (name, capacity, spec, ...), got {entry!r}"])
        problems = []
        unknown = sorted(set(entry) - set(cls.CONFIG_KEYS))
        if unknown:
            problems.append(f"unknown key(s) {', '.join(unknown)} "
                            f"(allowed: {', '.join(sorted(cls.CONFIG_KEYS))})")
        problems += [f"missing {key!r}" for key in ("name", "capacity", "spec") if key not in entry]
        name = entry.get("name")
        if "name" in entry and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME
                                or not name.isprintable()):
            problems.append(f"name {name!r} must be 1-{MAX_NAME} printable characters")
        label = f"table {name!r}: " if isinstance(name, str) else ""
        cap = entry.get("capacity")
        if "capacity" in entry and (isinstance(cap, bool) or not isinstance(cap, int)
                                    or not 1 <= cap <= MAX_CAPACITY):
            problems.append(f"{label}capacity must be a positive integer, got {cap!r}")
        spec = None
        if "spec" in entry:
            try:
                spec = TableSpec.parse(_spec_from_toml(entry["spec"]))
            except ConfigError as exc:
                problems.append(f"{label}spec: {exc}")
        parts: dict[str, Any] = {}
        for role in ("sampler", "remover"):
            if role in entry:
                value = entry[role]
                if not isinstance(value, (str, Mapping)) or (
                        (value if isinstance(value, str) else value.get("kind")) not in KINDS):
                    problems.append(f"{label}{role} {value!r} unknown (have {list(KINDS)})")
                    continue
                try:
                    parts[role] = Selector.from_wire(dict(value) if isinstance(value, Mapping)
                                                     else value, role)
                except ConfigError as exc:
                    problems.append(f"{label}{exc}")
        if "rate_limiter" in entry:
            try:
                parts["rate_limiter"] = _limiter_from_config(entry["rate_limiter"])
            except ConfigError as exc:
                problems.append(f"{label}rate_limiter: {exc}")
        if problems:
            raise TableProblems(problems)
        try:
            return cls.make(name, cap, spec, parts.get("sampler"), parts.get("remover"),
                            parts.get("rate_limiter"), entry.get("max_times_sampled", 0),
                            entry.get("slice_len", 0), entry.get("slice_period", 1),
                            entry.get("slice_pad", "none"))
        except ConfigError as exc:
            raise TableProblems(
                [str(exc) if str(exc).startswith("table ") else f"{label}{exc}"]) from None

    # -- comparing -------------------------------------------------------
    def differences(self, other: TableDefinition) -> list[str]:
        """The fields in which `other` differs.

        Args:
            other: The definition asked for.

        Returns:
            One string a field that differs, ``"field: ours there, theirs asked"``.
        """
        ours, theirs = self.to_wire(), other.to_wire()
        return [f"{k}: {ours.get(k)!r} there, {theirs.get(k)!r} asked"
                for k in dict.fromkeys([*ours, *theirs]) if ours.get(k) != theirs.get(k)]


def _spec_from_toml(spec: Any) -> Any:
    # TOML has arrays, not tuples: [[4, 84, 84], "uint8"] -> ((4, 84, 84), "uint8").
    def entry(e):
        if isinstance(e, list) and len(e) == 2:
            shape = tuple(e[0]) if isinstance(e[0], list) else e[0]
            return (shape, e[1])
        return e

    if isinstance(spec, Mapping):
        return {k: entry(v) for k, v in spec.items()}
    return entry(spec)

__all__ = ["TableDefinition", "TableProblems"]
