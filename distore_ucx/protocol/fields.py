"""How a message's fields are declared and checked: kinds, bounds, limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .error_codes import ProtocolError

__all__ = [
    "ARRAY_DTYPES",
    "ITEM_LOCATION",
    "MAX_ITEMS",
    "MAX_NAME",
    "MAX_SAMPLE",
    "F",
    "check",
]

MAX_NAME = 128
MAX_ITEMS = 1 << 24  # per message
MAX_SAMPLE = 1 << 16  # items in one sample request


# Where a sampled item is, as the sample reply's "items" field carries it:
# one 32-byte record per item, little-endian.
ITEM_LOCATION = np.dtype(
    [("node", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("generation", "<u8"), ("key", "<u8")]
)


@dataclass(frozen=True)
class F:
    """One field of a message: name, kind and bounds.

    kind: "int", "float", "str", "bytes", "bool", "list", "dict", or an
    array kind "u64[]", "u32[]", "f64[]" (raw bytes of that dtype).
    """

    name: str
    kind: str
    required: bool = True
    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None


ARRAY_DTYPES = {"u64[]": np.uint64, "u32[]": np.uint32, "f64[]": np.float64}

_NAME = dict(max_len=MAX_NAME)


def check(op: str, f: F, v: Any) -> Any:
    """`v` as field `f` of message `op` holds it (arrays as numpy); ProtocolError if invalid."""
    where = f"{op}.{f.name}"
    if f.kind in ARRAY_DTYPES:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes of {f.kind}")
        dt = np.dtype(ARRAY_DTYPES[f.kind])
        if len(v) % dt.itemsize:
            raise ProtocolError(f"{where}: {len(v)} bytes is not a whole number of {f.kind}")
        if len(v) // dt.itemsize > MAX_ITEMS:
            raise ProtocolError(f"{where}: more than {MAX_ITEMS} items")
        arr = np.frombuffer(v, dtype=dt.newbyteorder("<"))
        if f.kind == "f64[]" and not np.isfinite(arr).all():
            raise ProtocolError(f"{where}: values must be finite")
        return arr
    types = {
        "int": int,
        "float": (int, float),
        "str": str,
        "bytes": (bytes, memoryview),
        "bool": bool,
        "list": list,
        "dict": dict,
    }[f.kind]
    if not isinstance(v, types) or (f.kind in ("int", "float") and isinstance(v, bool)):
        raise ProtocolError(f"{where}: expected {f.kind}, got {type(v).__name__}")
    if f.lo is not None and v < f.lo or f.hi is not None and v > f.hi:
        raise ProtocolError(f"{where}: {v} outside [{f.lo}, {f.hi}]")
    if f.max_len is not None and len(v) > f.max_len:
        raise ProtocolError(f"{where}: longer than {f.max_len}")
    if f.kind == "str" and f.max_len == MAX_NAME and not _valid_name(v):
        raise ProtocolError(f"{where}: {v!r} is not a valid name (1-128 printable characters)")
    return v


def _valid_name(s: str) -> bool:
    return 0 < len(s) <= MAX_NAME and s.isprintable()
