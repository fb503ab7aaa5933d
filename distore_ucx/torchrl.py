"""TorchRL replay buffers backed by a distore table.

    pip install 'distore-ucx[torchrl]'

`DistoreReplayBuffer` and `DistorePrioritizedReplayBuffer` speak TorchRL's
replay-buffer language (`extend`, `add`, `sample`, iteration,
`update_priority`, `update_tensordict_priority`, `__len__`, `write_count`,
`batch_size`, `priority_key="td_error"`), so a TorchRL training loop, its
losses (DQNLoss reads `priority_weight` and writes `td_error`) and its
collectors (`Collector(env, policy, ..., replay_buffer=rb)`, also over a
`ParallelEnv`) use them unchanged, while the items live in a distore store
that many actor processes and hosts share. TorchRL's own replay-buffer tests,
adapted to build these buffers, pass (tests/integration/test_torchrl_upstream.py
lists those left out and why):

- `extend(td)` stores a TensorDict with one `writer.insert` (one copy per
  field into the writer's staging memory, never a Python loop over items)
  and waits until the items are stored, so that the next `sample()` sees the
  buffer as `extend` left it (never an item it evicted), as TorchRL's does.
  As TorchRL's storages, the first `ndim` (1) batch dimensions index items:
  a collector's `[n_envs, T]` batch is n_envs items of T steps each with
  `ndim=1`, and n_envs * T transitions with `ndim=2`. Nested keys become
  field names joined with "/" (("next", "obs") is the field "next/obs").
  The priority key (`td_error`) is stored with the rest, as TorchRL does.
- `sample()` asks the control plane when it is called (nothing is sampled
  ahead, so a priority update shows in the very next sample) and returns a
  TensorDict of tensors it owns, on the buffer's device, with `index` (the
  items' distore keys, int64) and, on a prioritized buffer,
  `priority_weight` (and `_weight`, TorchRL's older name): TorchRL's
  importance weights (p_i / p_min)^-beta, p_min the smallest priority in the
  whole table. `sample_ahead=True` and `clone=False` trade these for speed.
- `update_priority(index, priority)` and `update_tensordict_priority(td)`
  send new priorities in one batched request (`|priority| + eps`; a td
  without the priority key gets the default priority, as TorchRL's).
- Errors are distore's (`ds.DistoreError`) and also what TorchRL's code
  catches: no batch size raises `BatchSizeNotSet` (a RuntimeError) from
  `sample()` and iteration; sampling an empty buffer raises `EmptyTable` (a
  RuntimeError and a `ds.NoData`) at once, unless `sample_timeout=` asks to
  wait for actors.

The table is created from the first TensorDict's keys, per-item shapes and
dtypes when it does not exist (pass `capacity=`; or give `spec=`); an
existing table is used as it is, and data that does not match it is refused
with a SpecMismatch that names the key, options that differ from it (capacity,
sampler, alpha...) with a TableExists that names them. Importing `distore_ucx`
never imports torch; this module needs torch and tensordict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import (
    ConfigError,
    NoData,
    SpecMismatch,
    TableExists,
    TableNotFound,
)

try:
    import torch
    from tensordict import TensorDict, TensorDictBase
except ImportError as _exc:  # say what to install, not just what is missing
    raise ImportError(
        f"distore_ucx.torchrl needs torch and tensordict ({_exc}): "
        "pip install 'distore-ucx[torchrl]' (from a source checkout: pip install '.[torchrl]')"
    ) from _exc

log = logging.getLogger(__name__)

SEP = "/"  # nested key ("next", "obs") <-> field name "next/obs"
INDEX_KEY = "index"
WEIGHT_KEYS = ("priority_weight", "_weight")  # TorchRL's name now, and its older one

__all__ = ["BatchSizeNotSet", "DistorePrioritizedReplayBuffer", "DistoreReplayBuffer", "EmptyTable",
           "spec_of"]

REDUCTIONS = ("max", "min", "mean", "median", "sum")  # TorchRL's, for priorities


# Errors of these buffers that TorchRL code catches as RuntimeError (they never
# cross the wire, so they live here rather than in errors.py's wire vocabulary).
class EmptyTable(NoData, RuntimeError):
    """sample() found too few items and was not asked to wait: TorchRL's
    message and RuntimeError, and a ds.NoData."""


class BatchSizeNotSet(ConfigError, RuntimeError):
    """sample() or iteration without a batch size: a RuntimeError, as TorchRL
    raises, and a ds.ConfigError."""


def _key_tuple(key: Any) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _field_name(key: Any) -> str:
    """The field name of a (nested) TensorDict key; refuses keys it could not map back."""
    parts = _key_tuple(key)
    bad = [p for p in parts if not isinstance(p, str) or not p or SEP in p]
    if bad:
        raise ConfigError(
            f"TensorDict key {key!r}: a distore table stores nested keys as one field name "
            f"joined with {SEP!r}, so no key part may be empty or contain {SEP!r} "
            f"(got {bad[0]!r}): rename it, or leave it out with exclude_keys="
        )
    name = SEP.join(parts)
    if len(name) > 64:
        raise ConfigError(
            f"TensorDict key {key!r}: the field name {name!r} is {len(name)} characters; "
            "distore allows 64: use a shorter key, or leave it out with exclude_keys="
        )
    return name


def _numpy_dtype(dtype: torch.dtype, key: Any) -> np.dtype:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        raise ConfigError(
            f"TensorDict key {key!r}: dtype {dtype} has no numpy equivalent and cannot be "
            "stored; convert it (e.g. .float()) before extend, or leave it out with exclude_keys="
        ) from None


def spec_of(data: TensorDictBase, exclude: Sequence[Any] = (), ndim: int = 1) -> dict[str, tuple]:
    """The distore table spec ({field: (per-item shape, dtype)}) of a TensorDict
    whose first `ndim` batch dimensions index its items, leaving out the keys
    in `exclude`. An item's shape keeps the batch dimensions after those
    (a [n_envs, T] batch with ndim=1: n_envs items of T steps).

    >>> spec_of(TensorDict({"obs": torch.zeros(8, 4), ("next", "obs"): torch.zeros(8, 4)}, [8]))
    {'obs': ((4,), dtype('float32')), 'next/obs': ((4,), dtype('float32'))}
    """
    _check_batch(data, ndim)
    skip = {_key_tuple(k) for k in exclude}
    spec = {}
    for key, value in _leaves(data):
        if _key_tuple(key) in skip:
            continue
        spec[_field_name(key)] = (tuple(value.shape[ndim:]), _numpy_dtype(value.dtype, key))
    if not spec:
        raise ConfigError("the TensorDict has no tensors left to store (all were excluded)")
    return spec


def _leaves(data: TensorDictBase) -> list[tuple[Any, torch.Tensor]]:
    out = []
    for key in data.keys(include_nested=True, leaves_only=True):
        value = data.get(key)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"TensorDict key {key!r} holds {type(value).__name__}, not a tensor: distore "
                "stores fixed-shape tensors only; leave it out with exclude_keys="
            )
        out.append((key, value))
    return out


def _check_batch(data: Any, ndim: int = 1) -> None:
    if not isinstance(data, TensorDictBase):
        raise TypeError(
            f"a distore replay buffer stores TensorDicts, got {type(data).__name__}: wrap your "
            "tensors in tensordict.TensorDict({...}, batch_size=[n])"
        )
    if data.batch_dims < ndim:
        raise SpecMismatch(
            f"extend() takes a TensorDict whose first {ndim} batch dimension(s) index its items "
            f"(the buffer's ndim={ndim}), got batch size {list(data.batch_size)}: use add() for "
            "a single item"
        )


class DistoreReplayBuffer:
    """A TorchRL-style replay buffer (as `TensorDictReplayBuffer`) whose items
    live in the distore table `table`.

    `client` is a `ds.connect(...)` client or a control-plane address
    ("host:port"; the buffer then connects and closes its client itself).
    When the table does not exist, it is created at the first `extend`
    (or here, when `spec` is given) with `capacity` items and the given
    `sampler`, `remover`, `rate_limiter` and `max_times_sampled` (as in
    `client.create_table`); `spec` may be a TensorDict shaped like the data
    `extend` will get (only its keys, shapes and dtypes are used; one with
    fewer than `ndim` batch dimensions is one item) or a distore spec dict.
    When the table exists, those options (given ones only) must match it,
    else TableExists names the fields that differ; leave them out to use the
    table as it is.

    Items: the first `ndim` batch dimensions of extended data index items,
    as in TorchRL's storages (`LazyTensorStorage(n, ndim=...)`): with the
    default 1, a collector's [n_envs, T] batch is n_envs items of [T] steps
    and samples have batch size [batch_size, T]; `ndim=2` stores its
    n_envs * T transitions one by one. (A buffer that only opens a table
    learns the items' own batch dimensions from `spec=` or its first
    extend; before that, samples have batch size [batch_size].)

    Sampling: `batch_size` is the default of `sample()` (None: pass it
    there); samples land on `device` ("cpu" or "cuda[:N]"). By default a
    sample is asked for when `sample()` is called and reflects every
    `extend` and priority update before it, as TorchRL's: `sample_ahead=True`
    asks for the next batch while this one is read (one round trip hidden
    per sample, but updates and evictions then show one sample late). A
    sample of an empty table raises `EmptyTable` (a RuntimeError, as
    TorchRL's) at once; `sample_timeout` s > 0 waits that long for actors to
    fill it first. Sampled tensors are the caller's (`clone=True`);
    `clone=False` hands out views into the learner's receive ring instead
    (no copy, valid until `prefetch + 1` more samples).

    Inserting: `extend` waits until its items are stored (`flush=True`);
    `flush=False` leaves batching to the writer (faster for actors that
    never sample; call `flush()`). Items get the data's `priority_key`
    entry as priority when present (reduced over an item's trailing
    dimensions by `reduction`, TorchRL's "max", "min", "mean", "median" or
    "sum"), else `default_priority` (None: the largest priority this buffer
    has set so far, 1.0 at first, as TorchRL does). The priority key is
    stored with the item when the table has that field (it is made from the
    first data's keys). `exclude_keys` are never stored; neither are
    `index` and the weight keys. `writer_options` and `learner_options` go
    to `client.writer()` and `client.learner()`.

    >>> with DistoreReplayBuffer(cluster.address, "replay", capacity=10_000,
    ...                          batch_size=64) as rb:
    ...     rb.extend(collector_batch)     # a TensorDict, batch size [n]
    ...     td = rb.sample()               # TensorDict, batch size [64], with "index"
    """

    def __init__(
        self,
        client: Any,
        table: str,
        *,
        batch_size: int | None = None,
        capacity: int | None = None,
        spec: Any = None,
        sampler: Any = None,
        remover: Any = None,
        rate_limiter: Any = None,
        max_times_sampled: int | None = None,
        ndim: int = 1,
        device: str = "cpu",
        sample_timeout: float = 0.0,
        sample_ahead: bool = False,
        clone: bool = True,
        prefetch: int = 2,
        flush: bool = True,
        priority_key: str | tuple[str, ...] = "td_error",
        default_priority: float | None = None,
        eps: float = 1e-8,
        beta: float | None = None,
        reduction: str = "max",
        exclude_keys: Sequence[Any] = (),
        writer_options: Mapping[str, Any] | None = None,
        learner_options: Mapping[str, Any] | None = None,
    ):
        """See the class docstring."""
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if not (np.isfinite(eps) and eps >= 0):
            raise ConfigError(f"eps must be a finite number >= 0, got {eps!r}")
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
            raise ConfigError(f"ndim (batch dimensions that index items) must be an integer "
                              f">= 1, got {ndim!r}")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got "
                              f"{reduction!r}")
        if not (np.isfinite(sample_timeout) and sample_timeout >= 0):
            raise ConfigError(f"sample_timeout must be a number of seconds >= 0, got "
                              f"{sample_timeout!r}")
        if isinstance(client, str):
            import distore_ucx as ds

            client, self._owns_client = ds.connect(client), True
        else:
            self._owns_client = False
        self._client = client
        self.table = table
        self._batch_size = batch_size
        self.capacity = capacity
        self._table_options = {"sampler": sampler, "remover": remover,
                               "rate_limiter": rate_limiter,
                               "max_times_sampled": max_times_sampled}
        self.ndim = ndim
        self.device = torch.device(device)
        self.sample_timeout = float(sample_timeout)
        self.sample_ahead = bool(sample_ahead)
        self.clone = clone
        self.prefetch = prefetch
        self.flush_each_extend = flush
        self.priority_key = priority_key
        self.default_priority = default_priority
        self.eps = float(eps)
        self._beta = beta
        self.reduction = reduction
        self.exclude_keys = tuple(exclude_keys)
        self._writer_options = dict(writer_options or {})
        self._learner_options = dict(learner_options or {})
        self._writer = None
        self._learners: dict[int, Any] = {}  # one per batch size asked for
        self._fields: dict[str, tuple[tuple[str, ...], tuple[int, ...], np.dtype]] | None = None
        self._item_batch: tuple[int, ...] | None = None  # an item's own batch dims, once known
        self._max_priority = 1.0
        self._write_count = 0
        self._closed = False
        self._meta = {_key_tuple(k) for k in (INDEX_KEY, *WEIGHT_KEYS, *exclude_keys)}
        try:
            if spec is not None:
                self._create(spec)
            else:
                self._load()
        except BaseException:
            if self._owns_client:
                client.close()
            raise

    # -- TorchRL's attributes ----------------------------------------------
    @property
    def batch_size(self) -> int | None:
        """The default number of items `sample()` returns."""
        return self._batch_size

    @property
    def write_count(self) -> int:
        """Items this buffer has inserted (TorchRL collectors read it)."""
        return self._write_count

    @property
    def beta(self) -> float | None:
        """Importance-sampling exponent of the weights (None: no weights);
        settable, e.g. to anneal it towards 1."""
        return self._beta

    @beta.setter
    def beta(self, value: float | None) -> None:
        if value is not None and not (np.isfinite(value) and value >= 0):
            raise ConfigError(f"beta must be a finite number >= 0, got {value!r}")
        self._beta = value
        for learner in self._learners.values():
            learner.beta = value

    def __len__(self) -> int:
        """Items in the table now (one control-plane request)."""
        try:
            return int(self._client.table_info(self.table)["size"])
        except TableNotFound:
            return 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(table={self.table!r}, batch_size={self._batch_size}, "
                f"device={self.device}, fields={list(self._fields or ())})")

    # -- inserting -----------------------------------------------------------
    def extend(self, data: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """Insert the items of `data` (its first `ndim` batch dimensions index
        them) with one batched insert; returns their keys (int64, shaped as
        those dimensions, as TorchRL's indices) and sets them as
        `data["index"]`, as TorchRL does. Priorities come from
        `data[priority_key]` (reduced over an item's other dimensions, + eps)
        unless `update_priority=False` or it is absent (then the default
        priority). When it returns, the items are sampleable and the items
        they evicted are gone from every later sample of this buffer.
        """
        self._ensure_open()
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
        keys = self._writer.insert(self.table, arrays, priority=prio)
        if self.flush_each_extend:
            self._writer.flush()
        self._write_count += n
        index = torch.from_numpy(keys.view(np.int64)).reshape(lead)
        if not data.is_locked:
            self._set_index(data, index)
        return index

    def add(self, data: TensorDictBase) -> torch.Tensor:
        """Insert one item (a TensorDict shaped as one item: batch size [] or
        the items' own batch dimensions); returns its key."""
        _check_batch(data, 0)
        item = data
        for _ in range(self.ndim):
            item = item.unsqueeze(0)
        index = self.extend(item).reshape(-1)[0]
        if not data.is_locked:
            self._set_index(data, index)
        return index

    def flush(self) -> None:
        """Wait until every item this buffer inserted is stored (sampleable)."""
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

    # -- sampling --------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False,
               include_info: bool | None = None):
        """A TensorDict of `batch_size` (default: the buffer's) sampled items on
        the buffer's device, with `index` and, when `beta` is set, the
        importance weights; `(td, info)` with `return_info=True`.
        (`include_info`, TorchRL's older flag, changes nothing: the info is
        always in the TensorDict.)

        Raises BatchSizeNotSet without a batch size and EmptyTable when the
        table has too few items (both RuntimeErrors, as TorchRL raises)."""
        self._ensure_open()
        n = batch_size if batch_size is not None else self._batch_size
        if n is None:
            raise BatchSizeNotSet(
                "batch_size not specified: pass it to sample() or to the buffer's constructor "
                "(batch_size=)"
            )
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
        shape = [n, *item_batch]
        td = TensorDict(batch_size=shape, device=self.device)
        for name, value in batch.data.items():  # once per field, never per item
            if isinstance(value, np.ndarray):
                # from_numpy, not DLPack: the tensor keeps the view (and so the
                # ring) alive the ordinary way, also at interpreter exit.
                value = torch.from_numpy(value)
            td.set(fields[name][0], value.clone() if self.clone else value)
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
        replacement). Raises BatchSizeNotSet at once without a batch size."""
        if self._batch_size is None:
            raise BatchSizeNotSet(
                "Cannot iterate over the replay buffer. Batch_size was not specified during "
                "construction of the replay buffer: pass batch_size= to it"
            )
        return self._batches()

    def _batches(self) -> Iterator[TensorDictBase]:
        while True:
            yield self.sample()

    def update_priority(self, index: Any, priority: Any) -> dict:
        """Set the priorities of the items with keys `index` (from `sample()` or
        `extend()`), in one batched request: |priority| + eps (a priority
        with more dimensions than `index` is reduced over them by
        `reduction`, as TorchRL does). Keys evicted meanwhile are skipped and
        counted ({"updated", "missing"})."""
        self._ensure_open()
        keys = self._index_keys(index)
        prios = self._priorities(priority, len(keys))
        learner = next(iter(self._learners.values()), None)
        if learner is not None:
            return learner.update_priorities(keys, prios)
        # No learner here (e.g. an actor re-prioritizing): ask the control plane.
        if not np.isfinite(prios).all():
            raise ValueError(f"table {self.table!r}: priorities must be finite, got "
                             f"{prios[~np.isfinite(prios)][:3].tolist()}")
        reply = self._client.call("update_priorities", table=self.table, keys=keys,
                                  priorities=prios)
        return {"updated": reply["updated"], "missing": reply["missing"]}

    def update_tensordict_priority(self, data: TensorDictBase) -> dict:
        """`update_priority(data["index"], data[priority_key])`: what TorchRL
        loops call after the loss wrote its `td_error` into the sample. A
        TensorDict without the priority key sets the default priority (the
        largest so far), as TorchRL's buffers do."""
        self._ensure_open()
        index = data.get(INDEX_KEY, None)
        if index is None:
            raise KeyError("update_tensordict_priority: the TensorDict has no 'index': pass "
                           "one that sample() returned")
        priority = data.get(self.priority_key, None)
        if priority is None:
            priority = torch.tensor(float(self._fill_priority()))
        return self.update_priority(index, priority)

    def _fill_priority(self) -> float:
        return self._max_priority if self.default_priority is None else self.default_priority

    def _index_keys(self, index: Any) -> np.ndarray:
        """Item keys (uint64) from an "index" (a tensor, array or list):
        expanded over the items' own batch dimensions (as sample() sets it),
        one key an item is taken."""
        if isinstance(index, torch.Tensor):
            index = index.detach().to("cpu", torch.int64)
            item_batch = self._item_batch or ()
            k = len(item_batch)
            if k and index.ndim > k and tuple(index.shape[-k:]) == item_batch:
                index = index[(..., *(0,) * k)]
        return _as_keys(index)

    def _priorities(self, priority: Any, n: int) -> np.ndarray:
        p = torch.as_tensor(priority).detach()
        if p.ndim == 0:
            p = p.expand(n)
        lead = [int(np.prod(p.shape[:j])) for j in range(1, p.ndim + 1)]
        if n not in lead:
            raise ValueError(f"table {self.table!r}: priorities of shape {list(p.shape)} for "
                             f"{n} items (the first dimension(s) must count the items)")
        p = p.reshape(n, -1)
        if p.shape[1] != 1:
            p = _reduce(p.to(torch.float64), self.reduction)
        out = p.reshape(n).to("cpu", torch.float64).numpy().copy()
        np.abs(out, out=out)
        out += self.eps
        finite = out[np.isfinite(out)]
        if finite.size:
            self._max_priority = max(self._max_priority, float(finite.max()))
        return out

    # -- the table -------------------------------------------------------------
    def _create(self, spec: Any, items: bool = False) -> None:
        """Create the table from `spec` (a TensorDict shaped like extend's data,
        already [items, ...] when `items`, or a distore spec) unless it
        exists; an existing table must have the same fields (and the options
        given)."""
        from .spec import TableSpec

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
        from .table_definition import TableDefinition

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


    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the writer, close the learners (and the client, when
        the buffer connected it itself)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for obj in [*self._learners.values(), self._writer]:
            if obj is None:
                continue
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001  close the rest, then report the first
                errors.append(exc)
        self._learners.clear()
        self._writer = None
        if self._owns_client:
            self._client.close()
        if errors:
            raise errors[0]

    def _ensure_open(self) -> None:
        if self._closed:
            from .errors import Closed

            raise Closed(f"this replay buffer of table {self.table!r} is closed: make a new one")

    def __enter__(self) -> DistoreReplayBuffer:  # noqa: PYI034  (typing.Self: 3.11+)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DistorePrioritizedReplayBuffer(DistoreReplayBuffer):
    """A prioritized buffer, as TorchRL's `TensorDictPrioritizedReplayBuffer`:
    the table samples with `ds.Prioritized(alpha)` (an existing table must
    have that alpha, else TableExists names it) and samples carry TorchRL's
    importance weights (p_i / p_min)^-beta under `priority_weight` (what
    TorchRL's losses read) and `_weight`.

    >>> rb = DistorePrioritizedReplayBuffer(client, "per", alpha=0.6, beta=0.4,
    ...                                     capacity=100_000, batch_size=64)
    >>> td = rb.sample()
    >>> loss = loss_module(td)            # writes td["td_error"]
    >>> rb.update_tensordict_priority(td)
    """

    def __init__(self, client: Any, table: str, *, alpha: float, beta: float,
                 eps: float = 1e-8, priority_key: str | tuple[str, ...] = "td_error",
                 **kwargs: Any):
        """See the class docstring; other options as DistoreReplayBuffer's."""
        import distore_ucx as ds

        if kwargs.get("sampler") is None:
            kwargs["sampler"] = ds.Prioritized(alpha=alpha)
        self.alpha = alpha
        super().__init__(client, table, beta=beta, eps=eps, priority_key=priority_key, **kwargs)


def _as_keys(index: Any) -> np.ndarray:
    """Item keys (uint64) from sample()'s int64 "index" (a tensor, array or list)."""
    if isinstance(index, torch.Tensor):
        index = index.detach().to("cpu", torch.int64).numpy()
    a = np.asarray(index)
    if a.dtype.kind not in "iu":
        raise TypeError(f"index must hold integer keys (from sample()'s 'index'), got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.int64, copy=False).reshape(-1)).view(np.uint64)


def _expand(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A per-item tensor [n] expanded over the items' own batch dimensions
    (TorchRL sets index and weights so); `x` itself when there are none."""
    if len(shape) == 1:
        return x
    return x.reshape(x.shape[0], *(1,) * (len(shape) - 1)).expand(shape)


def _reduce(p: torch.Tensor, reduction: str) -> torch.Tensor:
    """[n, k] -> [n] by one of REDUCTIONS (TorchRL's priority reductions)."""
    if reduction == "mean":
        return p.mean(1)
    if reduction == "sum":
        return p.sum(1)
    out = {"max": p.max, "min": p.min, "median": p.median}[reduction](1)
    return out.values


def _fields_of(spec) -> dict:
    return {f.name: (f.shape, f.dtype.str) for f in spec.fields}


def _describe(spec) -> str:
    return "{" + ", ".join(f"{f.name}: {list(f.shape)} {f.dtype}" for f in spec.fields) + "}"
