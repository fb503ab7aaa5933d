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

`accepts` is the check for hot paths (a reply per sampled batch or per
insert), where building the typed form costs more than the reader can
spend: it looks at what `parse` looks at, but not into arrays (their
values: the reader takes them as they are) and only in flat records.

>>> Pair.accepts({"a": 1}), Pair.accepts({"a": -1})
(True, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from .error_codes import ProtocolError
from .fields import ARRAY_DTYPES, F, check, refused_array, refused_scalar

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
        cls.accepts = staticmethod(_accepts(cls.FIELDS, cls.__name__))
        return cls

    return make


class Record:
    """A message's fields as a typed object: a reply, or a record a reply
    carries (a node, a table)."""

    FIELDS: ClassVar[tuple[F, ...]] = ()
    WHAT: ClassVar[str] = "record"

    @staticmethod
    def accepts(msg: Mapping[str, Any]) -> bool:
        """Whether `msg` holds this type's fields as declared, checked without
        building it: presence, exact types, bounds, lengths, and that arrays
        are whole and of one length; not the values inside arrays (`parse`
        also refuses non-finite floats there). False also for what only
        `parse` can tell (records inside, a subclass of a field's type):
        `parse` it then, to have the error or the record. `record` makes
        each type's own from its declaration."""
        return False

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


_ABSENT = object()


def _accepts(fields: tuple[F, ...], name: str) -> Callable[[Any], bool]:
    """A type's `accepts`, made from its fields' declarations: one check per
    field, written out as code (as dataclasses writes `__init__`): a loop
    over the declarations costs more than a reader of every sampled batch
    may spend."""
    if any(f.of is not None for f in fields):
        return Record.accepts  # records inside: only `parse` checks those
    scope: dict[str, Any] = {"ABSENT": _ABSENT}  # what the made code reads
    lines = [f"def accepts_{name}(msg):",
             "    if type(msg) is not dict:",
             "        return False",
             "    get = msg.get"]
    if any(f.kind in ARRAY_DTYPES for f in fields):
        lines.append("    n = -1  # items in each array, once one is seen")
    for f in fields:
        lines.append(f"    v = get({f.name!r}, ABSENT)")
        absent = "return False" if f.required else "pass"
        lines += ["    if v is ABSENT:", f"        {absent}"]
        if f.nullable:
            lines += ["    elif v is None:", "        pass"]
        if f.kind in ARRAY_DTYPES:
            size = np.dtype(ARRAY_DTYPES[f.kind]).itemsize
            lines += [f"    elif {refused_array(f)}:",
                      "        return False",
                      "    else:",
                      f"        n = len(v) // {size}"]
            continue
        test = refused_scalar(f, scope)
        lines += [f"    elif {test}:", "        return False"]
    lines.append("    return True")
    exec("\n".join(lines), scope)
    return scope[f"accepts_{name}"]
