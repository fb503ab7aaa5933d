"""Typed records on the wire: a frozen dataclass whose fields are declared
with `wire`, built from a message's map by `parse`, which checks every
field as a request's are checked (protocol/fields.py). The replies
(protocol/replies.py) are declared this way.

>>> @record("a pair")
... class Pair(Record):
...     a: int = wire("int", lo=0)
...     b: str | None = wire("str", optional=True)
>>> Pair.parse({"a": 1})
Pair(a=1, b=None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from .error_codes import ProtocolError
from .fields import ARRAY_DTYPES, F, check

__all__ = ["Record", "record", "wire"]

R = TypeVar("R", bound="Record")


def wire(spec: F | str, *, optional: bool = False, nullable: bool = False,
         of: type[Record] | None = None, **bounds: Any) -> Any:
    """Declare a record's field: `spec` is a shared field (its bounds; the
    name is the attribute's) or a kind with its `bounds`. An `optional`
    field may be left out (it reads None); a `nullable` one may be None;
    `of` is the record type of a list's items or of a dict."""
    if isinstance(spec, F) and bounds:
        raise TypeError(f"{spec.name}: a shared field brings its own bounds; declare a new "
                        "one in protocol/fields.py rather than bound it again here")
    f = spec if isinstance(spec, F) else F("", spec, **bounds)
    f = dataclasses.replace(f, required=not optional, nullable=nullable, of=of)
    if optional:
        return dataclasses.field(default=None, metadata={"wire": f})
    return dataclasses.field(metadata={"wire": f})


def record(what: str) -> Callable[[type[R]], type[R]]:
    """Make a Record subclass a frozen dataclass of its `wire` fields, named
    `what` in errors."""

    def make(cls: type[R]) -> type[R]:
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        cls.FIELDS = tuple(dataclasses.replace(f.metadata["wire"], name=f.name)
                           for f in dataclasses.fields(cls))
        cls.WHAT = what
        return cls

    return make


class Record:
    """A message's fields as a typed object: a reply, or a record a reply
    carries (a node, a table)."""

    FIELDS: ClassVar[tuple[F, ...]] = ()
    WHAT: ClassVar[str] = "record"

    @classmethod
    def parse(cls: type[R], msg: Mapping[str, Any], what: str | None = None) -> R:
        """This type from its map; ProtocolError, naming the field, if the map
        does not hold what the declaration says."""
        what = what or cls.WHAT
        if not isinstance(msg, Mapping):
            raise ProtocolError(f"{what}: expected a map, got {type(msg).__name__}")
        out: dict[str, Any] = {}
        n_items = None
        for f in cls.FIELDS:
            if f.name not in msg:
                if f.required:
                    raise ProtocolError(f"{what}: missing field {f.name!r}")
                continue
            v = msg[f.name]
            if v is None and f.nullable:
                out[f.name] = None
                continue
            v = check(what, f, v)
            if f.of is not None:
                v = [f.of.parse(x) for x in v] if f.kind == "list" else f.of.parse(v)
            elif f.kind in ARRAY_DTYPES:
                if n_items is None:
                    n_items = len(v)
                elif len(v) != n_items:
                    raise ProtocolError(
                        f"{what}: array {f.name!r} has {len(v)} items, expected {n_items}")
            out[f.name] = v
        return cls(**out)
