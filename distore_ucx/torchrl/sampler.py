"""Sampling a TorchRL buffer: `sample` and iteration.

A sample is asked of the control plane when `sample()` is called (unless
the buffer samples ahead), by a learner of the buffer made for that batch
size, and comes back as a TensorDict on the buffer's device with "index"
and, on a buffer with `beta`, the importance weights.

`Sampling` is a part of DistoreReplayBuffer (buffer.py), which sets the
state it reads: `_client`, `table`, `_batch_size`, `_learners`, `_fields`,
`_item_batch`, `device`, `sample_timeout`, `sample_ahead`, `clone`,
`prefetch`, `_beta`, `_learner_options`; it opens the table through
`TableBinding._load` (table.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from ..errors import NoData
from .conversion import INDEX_KEY, WEIGHT_KEYS, _expand
from .errors import BatchSizeNotSet, EmptyTable
from .slices import flat_sample


class Sampling:
    """sample and iteration of a DistoreReplayBuffer, and its learners."""

    def sample(self, batch_size: int | None = None, return_info: bool = False,
               include_info: bool | None = None):
        """Sample items, asked of the control plane now (unless the buffer
        samples ahead).

        Args:
            batch_size: Items (frames, with a slice sampler) to sample
                (default: the buffer's).
            return_info: Also return the info dict, as TorchRL's.
            include_info: TorchRL's older flag; changes nothing (the info is
                always in the TensorDict).

        Returns:
            A TensorDict of the sampled items on the buffer's device, with
            `index` (their keys, int64) and, when `beta` is set, the
            importance weights (`priority_weight`, `_weight`); `(td, info)`
            with `return_info=True`, info holding `index` and the weights.

        Raises:
            BatchSizeNotSet: No batch size, here or in the buffer.
            EmptyTable: The table has too few items (within
                `sample_timeout`), or does not exist yet.
            RuntimeError: With a slice sampler, `batch_size` is not a
                multiple of the slice length (TorchRL's message).
        """
        self._ensure_open()
        n = batch_size if batch_size is not None else self._batch_size
        if n is None:
            raise BatchSizeNotSet(
                "batch_size not specified: pass it to sample() or to the buffer's constructor "
                "(batch_size=)"
            )
        slices = self._slices
        if slices is not None:  # a slice sampler's buffer: n frames, n // T slices
            t = self._table_options["slice_len"]
            learner = self._learner(slices.slices_in(n, t))
        else:
            learner = self._learner(n)
        try:
            batch = learner.sample(timeout=self.sample_timeout)
        except NoData as exc:
            raise EmptyTable(
                f"Cannot sample from an empty storage: table {self.table!r} had too few items "
                f"for a sample of {n} within {self.sample_timeout:g} s ({exc}); extend() the "
                "buffer first, or pass sample_timeout= (seconds) to wait for actors to fill it"
            ) from None
        fields = self._fields
        item_batch = self._item_batch or ()
        shape = [len(batch.keys), t] if slices is not None else [n, *item_batch]
        td = TensorDict(batch_size=shape, device=self.device)
        for name, value in batch.data.items():  # once per field, never per item
            if isinstance(value, np.ndarray):
                # from_numpy, not DLPack: the tensor keeps the view (and so the
                # ring) alive the ordinary way, also at interpreter exit.
                value = torch.from_numpy(value)
            td.set(fields[name][0], value.clone() if self.clone else value)
        if slices is not None:
            weights = None if batch.weights is None else torch.from_numpy(
                batch.weights.astype(np.float32))
            td = flat_sample(slices, td, batch.mask, batch.step_keys, weights, WEIGHT_KEYS,
                             INDEX_KEY)
            info = {INDEX_KEY: td.get(INDEX_KEY)}
            for key in WEIGHT_KEYS:
                if key in td.keys():
                    info[key] = td.get(key)
            return (td, info) if return_info else td
        index = torch.from_numpy(batch.keys.view(np.int64)).to(self.device)
        info = {INDEX_KEY: index}
        td.set(INDEX_KEY, _expand(index, shape))
        if batch.weights is not None:
            w = torch.from_numpy(batch.weights.astype(np.float32)).to(self.device)
            expanded = _expand(w, shape)
            for key in WEIGHT_KEYS:
                info[key] = w
                td.set(key, expanded)
        return (td, info) if return_info else td

    def __iter__(self) -> Iterator[TensorDictBase]:
        """Samples of `batch_size`, forever (as TorchRL's sampling with
        replacement); raises `BatchSizeNotSet` at once without a batch size."""
        if self._batch_size is None:
            raise BatchSizeNotSet(
                "Cannot iterate over the replay buffer. Batch_size was not specified during "
                "construction of the replay buffer: pass batch_size= to it"
            )
        return self._batches()

    def _batches(self) -> Iterator[TensorDictBase]:
        while True:
            yield self.sample()

    def _learner(self, n: int):
        learner = self._learners.get(n)
        if learner is None:
            if self._fields is None:
                self._load()
                if self._fields is None:
                    raise EmptyTable(
                        f"Cannot sample from an empty storage: table {self.table!r} does not "
                        "exist yet: extend() the buffer (with capacity= given) before "
                        "sampling, or create the table"
                    )
            # pipeline=False: a sample is asked for when sample() is called,
            # so it sees every extend and priority update before it, as
            # TorchRL's buffers do (sample_ahead=True: one batch ahead).
            opts = {"prefetch": self.prefetch, "beta": self._beta, "sample_ahead": 1,
                    "pipeline": self.sample_ahead, **self._learner_options}
            if self.device.type == "cuda":
                opts["framework"] = "torch"
                device = f"cuda:{self.device.index or 0}"
            else:
                opts["framework"] = "numpy"  # made tensors in sample(), without a copy
                device = "cpu"
            learner = self._client.learner(self.table, n, device=device, **opts)
            self._learners[n] = learner
        return learner
