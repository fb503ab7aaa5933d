"""Table specs: what one item holds and how it is laid out in a slot.

A slot is a 16-byte header (key, generation; both uint64) followed by the
item's fields packed in spec order, each aligned to 8 bytes; slots are
padded to 64 bytes. Learners read a batch into a structure of arrays (a
BatchLayout): the headers into an (n, 2) array checked on the side, each
field into its own C-contiguous [n, *shape] array, so a field of a batch is
one dense array, never a strided view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ConfigError, SpecMismatch

SLOT_HEADER = 16
SLOT_ALIGN = 64
FIELD_ALIGN = 8
UNNAMED = ""  # the field name of a spec that is a single array


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Field:
    """One array of an item.

    Attributes:
        name: The field's name ("" for the one array of an unnamed spec).
        shape: Its shape in one item.
        dtype: Its numpy dtype.
        offset: Where it starts inside the item's packed bytes.
        nbytes: Bytes of the field in one item (worked out once: writers
            read it on every insert, where np.prod cost ~2.5 us a call).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)


@dataclass(frozen=True)
class BatchLayout:
    """Where a batch of `rows` items lands in a learner's buffer: the slot
    headers as one (rows, 2) uint64 array at `header`, and field k as one
    C-contiguous [rows, *shape] array at `offsets[k]` (item r of field k at
    offsets[k] + r * nbytes). Every array starts on a 64-byte boundary;
    `nbytes` is the buffer size the layout needs.

    >>> TableSpec.parse(((4,), "uint8")).layout(2)
    BatchLayout(rows=2, header=0, offsets=(64,), nbytes=128)
    """

    rows: int
    header: int
    offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TableSpec:
    """The layout of a table's items: its fields, each packed at an 8-byte
    aligned offset, in a slot of a 16-byte header and the fields, padded to
    64 bytes. Make one with `parse`.

    Attributes:
        fields: The item's `Field` objects, in spec order.
        item_bytes: Bytes of one item's packed fields (without the header).
        slot_size: Bytes one item takes in an arena, header and padding
            included. Both worked out once (writers read them on every insert).

    >>> s = TableSpec.parse({"obs": ((4, 84, 84), "uint8"), "reward": ((), "float32")})
    >>> s.item_bytes, s.slot_size
    (28228, 28288)
    """

    fields: tuple[Field, ...]
    item_bytes: int = field(init=False, repr=False, compare=False)
    slot_size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        last = self.fields[-1]
        object.__setattr__(self, "item_bytes", last.offset + last.nbytes)
        object.__setattr__(self, "slot_size", _align(SLOT_HEADER + self.item_bytes, SLOT_ALIGN))

    @classmethod
    def parse(cls, spec: Any) -> TableSpec:
        """A spec from the user's form.

        Args:
            spec: {name: (shape, dtype), ...}, or a single (shape, dtype) for
                an item that is one unnamed array. A shape is a tuple or an
                int; a dtype anything `numpy.dtype` takes.

        Returns:
            The `TableSpec`.

        Raises:
            ConfigError: `spec` is neither form, has no field, a name longer
                than 64 characters, or a shape or dtype that cannot be stored.
        """
        if isinstance(spec, Mapping):
            items = list(spec.items())
            if not items:
                raise ConfigError("a table spec needs at least one field")
        elif isinstance(spec, (tuple, list)) and len(spec) == 2:
            items = [(UNNAMED, spec)]
        else:
            raise ConfigError(
                "spec must be {name: (shape, dtype), ...} or a single (shape, dtype), "
                f"got {spec!r}"
            )
        fields = []
        offset = 0
        for name, entry in items:
            if not isinstance(name, str) or len(name) > 64:
                raise ConfigError(f"field name {name!r} must be a string of at most 64 characters")
            try:
                shape, dtype = entry
                shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
                dtype = np.dtype(dtype)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"field {name!r}: expected (shape, dtype), got {entry!r} ({exc})") from None
            if any(d < 0 for d in shape) or dtype.hasobject or dtype.itemsize == 0:
                raise ConfigError(f"field {name!r}: shape {shape} / dtype {dtype} not storable")
            offset = _align(offset, FIELD_ALIGN)
            fields.append(Field(name, shape, dtype, offset))
            offset += fields[-1].nbytes
        if offset == 0:
            raise ConfigError("a table's items must hold at least one byte")
        return cls(tuple(fields))

    @classmethod
    def from_wire(cls, wire: list) -> TableSpec:
        """From the control plane's form: [[name, [dims], dtype_str], ...]."""
        try:
            if len(wire) == 1 and wire[0][0] == UNNAMED:
                return cls.parse((tuple(wire[0][1]), wire[0][2]))
            return cls.parse({name: (tuple(shape), dt) for name, shape, dt in wire})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed table spec {wire!r}: {exc}") from None

    def to_wire(self) -> list:
        """The form sent over the control channel."""
        return [[f.name, list(f.shape), f.dtype.str] for f in self.fields]

    @property
    def unnamed(self) -> bool:
        """True for a spec that is one array with no name."""
        return len(self.fields) == 1 and self.fields[0].name == UNNAMED

    def pack(self, data: Any) -> np.ndarray:
        """Pack one item or a batch into an (n, item_bytes) uint8 array.

        A field given with the spec's shape is one item; with an extra leading
        dimension it is a batch. Every field must agree on the batch size.

        Args:
            data: {name: array} (or one array for an unnamed spec).

        Returns:
            The packed items, one row each.

        Raises:
            SpecMismatch: A field is missing or unknown, has another shape, a
                dtype that does not convert without changing its values'
                kind, or the fields disagree on the batch size.
        """
        n, arrays = self.arrays(data)
        out = np.empty((n, self.item_bytes), dtype=np.uint8)
        self.pack_into(out, arrays, 0, n)
        return out

    def arrays(self, data: Any) -> tuple[int, list[np.ndarray]]:
        """Check one item or a batch against the spec: (n, one array per field,
        each with a leading batch dimension and the field's dtype). Nothing is
        copied unless a dtype must be converted; `pack_into` then copies."""
        if self.unnamed:
            data = {UNNAMED: data}
        elif not isinstance(data, Mapping):
            raise SpecMismatch(
                f"this table's items are {{{', '.join(f.name for f in self.fields)}}}: "
                f"pass a dict, got {type(data).__name__}"
            )
        missing = [f.name for f in self.fields if f.name not in data]
        extra = [k for k in data if k not in {f.name for f in self.fields}]
        if missing or extra:
            raise SpecMismatch(f"fields missing: {missing}, unknown fields: {extra}")
        arrays = []
        n = None
        for f in self.fields:
            raw = data[f.name]
            a = np.asarray(raw)
            if a.shape == f.shape:
                k, a = None, a.reshape((1,) + f.shape)
            elif a.shape[1:] == f.shape and a.ndim == len(f.shape) + 1:
                k = a.shape[0]
            else:
                raise SpecMismatch(
                    f"field {f.name or '<array>'!r}: shape {a.shape} is neither {f.shape} "
                    f"(one item) nor (n, *{f.shape}) (a batch)"
                )
            if a.dtype != f.dtype:
                a = _cast(f, a, from_python=not isinstance(raw, np.ndarray))
            count = 1 if k is None else k
            if n is None:
                n = count
            elif n != count:
                raise SpecMismatch(f"fields disagree on the batch size ({n} vs {count})")
            arrays.append(a)
        return n, [np.ascontiguousarray(a) for a in arrays]

    def pack_into(self, out: np.ndarray, arrays: list[np.ndarray], lo: int, hi: int,
                  copy_rows=None) -> None:
        """Copy items lo..hi of `arrays` (from `arrays()`) into the rows of
        `out`, an (hi - lo, item_bytes) uint8 array: one copy per field.
        `copy_rows(dst, src)`, if given, copies a field's (k, nbytes) uint8
        rows instead of numpy's assignment (a writer's staging copy)."""
        k = hi - lo
        if len(self.fields) > 1 and sum(f.nbytes for f in self.fields) < self.item_bytes:
            out[:] = 0  # alignment padding between fields
        for f, a in zip(self.fields, arrays):
            src = a[lo:hi].reshape(k, -1).view(np.uint8)
            if copy_rows is None:
                out[:, f.offset : f.offset + f.nbytes] = src
            else:
                copy_rows(out[:, f.offset : f.offset + f.nbytes], src)

    def count(self, data: Any) -> int:
        """How many items `data` holds (1 for one item, n for a batch), judged
        by its first field's shape, without packing or checking it."""
        f = self.fields[0]
        if self.unnamed:
            value = data
        elif isinstance(data, Mapping) and f.name in data:
            value = data[f.name]
        else:
            return 1
        shape = np.shape(value)
        return 1 if shape == f.shape or len(shape) != len(f.shape) + 1 else shape[0]

    def layout(self, rows: int) -> BatchLayout:
        """The structure-of-arrays layout of a batch of `rows` items (see BatchLayout)."""
        at = _align(rows * SLOT_HEADER, SLOT_ALIGN)
        offsets = []
        for f in self.fields:
            offsets.append(at)
            at += _align(rows * f.nbytes, SLOT_ALIGN)
        return BatchLayout(rows, 0, tuple(offsets), at)

    def views(self, buffer: np.ndarray, layout: BatchLayout):
        """Per-field C-contiguous [rows, *shape] views of a batch laid out by
        `layout` in `buffer` (a uint8 array of at least layout.nbytes).

        Returns a dict (or the array itself for an unnamed spec). The views
        share `buffer`'s memory.
        """
        out = {}
        for f, offset in zip(self.fields, layout.offsets):
            out[f.name] = np.ndarray(shape=(layout.rows,) + f.shape, dtype=f.dtype,
                                     buffer=buffer, offset=offset)
        return out[UNNAMED] if self.unnamed else out

    def header_view(self, buffer: np.ndarray, layout: BatchLayout) -> np.ndarray:
        """The (rows, 2) uint64 [key, generation] headers of a batch laid out by `layout`."""
        return np.ndarray((layout.rows, 2), np.uint64, buffer=buffer, offset=layout.header)


def _cast_advice(a: np.ndarray, dtype: np.dtype) -> str:
    """How to convert `a` to `dtype` without losing values silently: a cast
    wraps integers that do not fit, so say whether these do."""
    if a.dtype.kind in "iub" and dtype.kind in "iu" and a.size:
        info = np.iinfo(dtype)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            return (f"its values from {lo} to {hi} do not fit in {dtype} "
                    f"({info.min}..{info.max}), and a cast would wrap them: store them in a "
                    "wider field, or scale or clip them first")
        return f"its values fit: convert it first (x.astype(np.{dtype.name}))"
    if a.dtype.kind in "fc" and dtype.kind in "iu":
        return (f"convert it first, rounding as you mean it (np.rint(x).astype("
                f"np.{dtype.name})): values outside {dtype}'s range would wrap")
    return f"convert it first (x.astype(np.{dtype.name}))"


def _cast(f: Field, a: np.ndarray, from_python: bool) -> np.ndarray:
    """`a` as field `f`'s dtype, or SpecMismatch saying why it cannot be.

    Python lists and scalars become int64 or float64 arrays: they are stored
    whenever every value fits the field's dtype (a list of pixel values for a
    uint8 field). A numpy array must already have a dtype that converts
    without changing kind (float64 to float32 does; int64 to uint8 does not).
    """
    name = f.name or "<array>"
    if from_python and a.dtype.kind in "iub" and f.dtype.kind in "iu":
        info = np.iinfo(f.dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise SpecMismatch(
                f"field {name!r}: values from {a.min()} to {a.max()} do not fit in {f.dtype} "
                f"({info.min}..{info.max})"
            )
        return a.astype(f.dtype)
    if from_python and a.dtype.kind in "iub" and f.dtype.kind in "fc":
        return a.astype(f.dtype)
    if not np.can_cast(a.dtype, f.dtype, casting="same_kind"):
        raise SpecMismatch(
            f"field {name!r}: an array of dtype {a.dtype} cannot be stored as {f.dtype} "
            f"without changing its values' kind: {_cast_advice(a, f.dtype)}"
        )
    return a.astype(f.dtype)
