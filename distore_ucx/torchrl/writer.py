"""Inserting into a TorchRL buffer: `extend`, `add` and `flush`.

`extend` stores a TensorDict with one `writer.insert` (one copy per field,
never a Python loop over items), checked against the table's fields, and
waits until the items are stored unless the buffer was made with
`flush=False`; it returns the items' keys and sets them as the data's
"index", as TorchRL does.

`Writing` is a part of DistoreReplayBuffer (buffer.py), which sets the state
it reads: `_client`, `table`, `ndim`, `_fields`, `_item_batch`, `_meta`,
`priority_key`, `_writer`, `_writer_options`, `flush_each_extend`,
`_write_count`; it creates the table through `TableBinding._create`
(table.py) and takes priorities from `Priorities` (priorities.py).
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDictBase

from ..errors import SpecMismatch
from .conversion import INDEX_KEY, _check_batch, _field_name, _key_tuple, _leaves, _numpy_dtype
from .slices import steps_of, traj_key_of


class Writing:
    """extend, add and flush of a DistoreReplayBuffer."""

    def extend(self, data: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """Insert the items of `data` with one batched insert. When it returns
        (unless the buffer was made with `flush=False`), the items are
        sampleable and the items they evicted are gone from every later
        sample of this buffer. On a slice sampler's buffer every frame is a
        step of its trajectory.

        Args:
            data: A TensorDict whose first `ndim` batch dimensions index its
                items; the first one fixes the table's fields.
            update_priority: False: give the items the default priority
                even when `data` has `priority_key` (reduced over an item's
                other dimensions, + eps), which is used otherwise.

        Returns:
            The items' keys (int64, shaped as those dimensions, as TorchRL's
            indices), also set as `data["index"]`.

        Raises:
            TypeError: `data` is not a TensorDict.
            SpecMismatch: `data` has fewer than `ndim` batch dimensions, or a
                key is missing or extra, or has another shape or dtype than
                the table's (or the items another batch size than the first
                data's); the message names it.
            ConfigError: The table does not exist and the buffer has no
                `capacity`, or a key cannot be stored (its name, a value
                that is not a tensor, a dtype numpy lacks).
            DistoreError: The insert failed, as `Writer.insert` and
                `Writer.flush` raise.
        """
        self._ensure_open()
        if self._slices is not None:
            return self._extend_steps(data, update_priority)
        _check_batch(data, self.ndim)
        lead = tuple(data.batch_size[:self.ndim])
        items = data.flatten(0, self.ndim - 1) if self.ndim > 1 else data
        n = items.batch_size[0]
        if n == 0:
            return torch.zeros(lead, dtype=torch.long)
        if self._fields is None:
            self._create(items, items=True)
        item_batch = tuple(items.batch_size[1:])
        if self._item_batch is None:
            self._item_batch = item_batch
        elif item_batch != self._item_batch:
            raise SpecMismatch(
                f"table {self.table!r}: this buffer's items have batch size "
                f"{list(self._item_batch)}, the data's {list(item_batch)} (batch size "
                f"{list(data.batch_size)}, ndim={self.ndim}): reshape it like the first data"
            )
        return self._store(data, items, lead, update_priority,
                           lambda writer, arrays, prio: writer.insert(self.table, arrays,
                                                                      priority=prio))

    def _extend_steps(self, data: TensorDictBase, update_priority: bool | None) -> torch.Tensor:
        """extend() of a slice sampler's buffer: every frame (all batch
        dimensions flattened) is a step of its trajectory, appended with one
        `writer.append` (slices.py says how trajectories and ends are found)."""
        _check_batch(data, 1)
        lead = tuple(data.batch_size)
        frames = data.reshape(-1)
        n = frames.batch_size[0]
        if n == 0:
            return torch.zeros(lead, dtype=torch.long)
        if self._fields is None:
            self._create(frames, items=True)
        self._item_batch = ()
        env, done = steps_of(self._slices, frames, traj_key_of(self._slices, frames))
        return self._store(data, frames, lead, update_priority,
                           lambda writer, arrays, prio: writer.append(
                               self.table, arrays, env=env, done=done, priority=prio))

    def _store(self, data: TensorDictBase, items: TensorDictBase, lead: tuple,
               update_priority: bool | None, put) -> torch.Tensor:
        """The rest of extend: `items` ([n] items or steps of `data`) as arrays
        with their priorities, stored by `put(writer, arrays, priority)`;
        waits when the buffer flushes each extend; their keys, shaped `lead`,
        also set as data["index"]."""
        n = items.batch_size[0]
        arrays = self._arrays(items)
        prio = None
        if update_priority is not False:
            p = items.get(self.priority_key, None)
            if p is not None:
                prio = self._priorities(p, n)
        if prio is None:
            prio = float(self._fill_priority())
        if self._writer is None:
            self._writer = self._client.writer(**self._writer_options)
        keys = put(self._writer, arrays, prio)
        if self.flush_each_extend:
            self._writer.flush()
        self._write_count += n
        index = torch.from_numpy(keys.view(np.int64)).reshape(lead)
        if not data.is_locked:
            self._set_index(data, index)
        return index

    def add(self, data: TensorDictBase) -> torch.Tensor:
        """Insert one element along the first of the `ndim` item dimensions,
        as TorchRL's `add` writes one at its storage's cursor.

        Args:
            data: With ndim=1, one item (batch size [] or the items' own
                batch dimensions); with ndim=2, one row: a TensorDict of
                batch size [n, ...] is n items (a ParallelEnv's step).

        Returns:
            The item's key, or the row's n keys; also set as `data["index"]`.

        Raises:
            SpecMismatch: `data` has too few batch dimensions, or does not
                fit the table (as `extend`).
        """
        _check_batch(data, 0)
        if data.batch_dims < self.ndim - 1:
            raise SpecMismatch(
                f"add() takes one element along the first of this buffer's {self.ndim} item "
                f"dimensions (ndim={self.ndim}): a TensorDict of at least {self.ndim - 1} batch "
                f"dimension(s), got batch size {list(data.batch_size)}; extend() it instead, "
                "or reshape it")
        index = self.extend(data.unsqueeze(0))[0]
        if not data.is_locked:
            self._set_index(data, index)
        return index

    def flush(self) -> None:
        """Wait until every item this buffer inserted is stored (sampleable).

        Raises:
            DistoreError: An insert failed, as `Writer.flush` raises.
        """
        self._ensure_open()
        if self._writer is not None:
            self._writer.flush()

    def _set_index(self, data: TensorDictBase, index: torch.Tensor) -> None:
        """`index` (one key an item) as data["index"], expanded over the items'
        own batch dimensions, as TorchRL sets it."""
        index = index.reshape(tuple(index.shape) + (1,) * (data.batch_dims - index.ndim))
        if data.device is not None:
            index = index.to(data.device)
        data.set(INDEX_KEY, index.expand(data.batch_size))

    def _arrays(self, data: TensorDictBase) -> dict[str, np.ndarray]:
        """{field: numpy array [n, ...]} of `data` (batch size [n, ...]), checked
        against the table."""
        fields = self._fields
        given = {}
        for key, value in _leaves(data):
            if _key_tuple(key) not in self._meta:
                given[_field_name(key)] = (key, value)
        prio = _field_name(self.priority_key)
        if prio in given and prio not in fields:
            del given[prio]  # a priority the table has no field for: used, not stored
        missing = [fields[f][0] for f in fields if f not in given]
        extra = [given[f][0] for f in given if f not in fields]
        if missing or extra:
            raise SpecMismatch(
                f"table {self.table!r}: the TensorDict's keys do not match the table's; "
                f"missing: {missing}, not in the table: {extra} (leave extra keys out with "
                "exclude_keys=, or store them in another table)"
            )
        out = {}
        n = data.batch_size[0]
        for name, (key, shape, dtype) in fields.items():
            value = given[name][1]
            if tuple(value.shape) != (n, *shape):
                raise SpecMismatch(
                    f"table {self.table!r}, key {key!r}: shape {list(value.shape)}, but the "
                    f"table stores items of shape {list(shape)} (expected {[n, *shape]} for "
                    f"{n} items)"
                )
            got = _numpy_dtype(value.dtype, key)
            if got != dtype:
                raise SpecMismatch(
                    f"table {self.table!r}, key {key!r}: dtype {value.dtype}, but the table "
                    f"stores {dtype}: convert it first (e.g. .to(torch.{dtype.name}))"
                )
            # One device-to-host copy per field when it lives on a GPU; none on the CPU.
            out[name] = value.detach().cpu().numpy()
        return out
