"""The table behind a TorchRL buffer: created from the first data, or opened.

A buffer creates its table from a TensorDict's keys, per-item shapes and
dtypes (or a distore spec) when it does not exist; an existing table must
have the data's fields (else SpecMismatch names them) and the options the
buffer was given (else TableExists names those that differ). Opening it
records the fields, as the TensorDict keys they came from.

`TableBinding` is a part of DistoreReplayBuffer (buffer.py), which sets the
state it reads: `_client`, `table`, `capacity`, `_table_options`, `ndim`,
`_meta`; it sets `_fields` and `_item_batch`.
"""

from __future__ import annotations

import logging
from typing import Any

from tensordict import TensorDictBase

from ..errors import ConfigError, SpecMismatch, TableExists, TableNotFound
from .conversion import SEP, spec_of

log = logging.getLogger(__package__)  # the logger of distore_ucx.torchrl, as before the split


class TableBinding:
    """Creating, opening and checking the table of a DistoreReplayBuffer."""

    def _create(self, spec: Any, items: bool = False) -> None:
        """Create the table from `spec` (a TensorDict shaped like extend's data,
        already [items, ...] when `items`, or a distore spec) unless it
        exists; an existing table must have the same fields (and the options
        given)."""
        from ..spec import TableSpec

        if isinstance(spec, TensorDictBase):
            if not items and spec.batch_dims < self.ndim:  # one item
                for _ in range(self.ndim):
                    spec = spec.unsqueeze(0)
            if not items and self.ndim > 1:
                spec = spec.flatten(0, self.ndim - 1)
            self._item_batch = tuple(spec.batch_size[1:])
            spec = spec_of(spec, exclude=tuple(self._meta))
        want = TableSpec.parse(spec)
        opts = {k: v for k, v in self._table_options.items() if v is not None}
        try:
            have = self._client.spec(self.table)
        except TableNotFound:
            if self.capacity is None:
                raise ConfigError(
                    f"table {self.table!r} does not exist: pass capacity= (items) to the "
                    "buffer to create it, or create it with client.create_table"
                ) from None
            self._client.create_table(self.table, capacity=self.capacity, spec=spec, **opts)
            log.info("created table %r (capacity %d) for a TorchRL buffer: %s", self.table,
                     self.capacity, _describe(want))
        else:
            if _fields_of(want) != _fields_of(have):
                raise SpecMismatch(
                    f"table {self.table!r} exists with fields {_describe(have)}, but the "
                    f"data has {_describe(want)}: use another table name, or convert the data"
                )
        self._load()

    def _load(self) -> None:
        """Read the table's spec, if the table exists, and check that the
        options this buffer was given match it."""
        try:
            info = self._client.table_info(self.table)
            spec = self._client.spec(self.table)
        except TableNotFound:
            return
        if spec.unnamed:
            raise ConfigError(
                f"table {self.table!r} holds one unnamed array per item; a TorchRL buffer "
                "needs named fields ({'obs': ..., ...}): use another table"
            )
        if self._fields is None:
            self._check_options(info)
        self._fields = {f.name: (tuple(f.name.split(SEP)) if SEP in f.name else f.name,
                                 f.shape, f.dtype) for f in spec.fields}

    def _check_options(self, info: dict) -> None:
        """Refuse a table whose definition differs from the options given here
        (capacity, sampler and its alpha, ...), naming the fields: they
        would otherwise be ignored without a word."""
        from ..table_definition import TableDefinition

        asked = {"capacity": self.capacity, **self._table_options}
        asked = {k: v for k, v in asked.items() if v is not None}
        if not asked:
            return
        have = TableDefinition.from_wire(info)
        want = TableDefinition.from_wire({**have.to_wire(), **asked})
        differ = have.differences(want)
        if differ:
            raise TableExists(
                f"table {self.table!r} exists with another definition ({'; '.join(differ)}): "
                "give this buffer the table's options, or leave them out to use the table "
                "as it is, or use another table name"
            )


def _fields_of(spec) -> dict:
    return {f.name: (f.shape, f.dtype.str) for f in spec.fields}


def _describe(spec) -> str:
    return "{" + ", ".join(f"{f.name}: {list(f.shape)} {f.dtype}" for f in spec.fields) + "}"
