"""TorchRL replay buffers backed by a distore table.

    pip install 'distore-ucx[torchrl]'

`DistoreReplayBuffer` and `DistorePrioritizedReplayBuffer` speak TorchRL's
replay-buffer language (`extend`, `add`, `sample`, `update_priority`,
`update_tensordict_priority`, `__len__`, `write_count`, `batch_size`,
`priority_key="td_error"`), so a TorchRL training loop, its losses (DQNLoss
reads `priority_weight` and writes `td_error`) and its collectors
(`SyncDataCollector(..., replay_buffer=rb)`) use them unchanged, while the
items live in a distore store that many actor processes and hosts share:

- `extend(td)` stores a TensorDict of n items (batch size [n]) with one
  `writer.insert` (one copy per field into the writer's staging memory,
  never a Python loop over items) and, by default, waits until they are
  stored, so that they are sampleable as soon as it returns (as TorchRL's
  extend). Nested keys become field names joined with "/"
  (("next", "obs") is the field "next/obs").
- `sample()` returns a TensorDict on the learner's device (batch size [n])
  with `index` (the items' distore keys, int64) and, on a prioritized
  buffer, `priority_weight` (and `_weight`, the older TorchRL name: the same
  tensor): the learner's importance weights (N * P(i))^-beta / max_j w_j.
  Its tensors are views into the learner's receive ring, like
  `learner.sample()`'s: valid until `prefetch + 1` more samples
  (`clone=True` copies them).
- `update_priority(index, priority)` and `update_tensordict_priority(td)`
  send new priorities in one batched request (`|priority| + eps`).

The table is created from the first TensorDict's keys, per-item shapes and
dtypes when it does not exist (pass `capacity=`; or give `spec=`); an
existing table is used as it is, and data that does not match it is refused
with a SpecMismatch that names the key. Importing `distore_ucx` never
imports torch; this module needs torch and tensordict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import ConfigError, SpecMismatch, TableNotFound

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

__all__ = ["DistorePrioritizedReplayBuffer", "DistoreReplayBuffer", "spec_of"]


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


def spec_of(data: TensorDictBase, exclude: Sequence[Any] = ()) -> dict[str, tuple]:
    """The distore table spec ({field: (per-item shape, dtype)}) of a TensorDict
    with batch size [n], leaving out the keys in `exclude`.

    >>> spec_of(TensorDict({"obs": torch.zeros(8, 4), ("next", "obs"): torch.zeros(8, 4)}, [8]))
    {'obs': ((4,), dtype('float32')), 'next/obs': ((4,), dtype('float32'))}
    """
    _check_batch(data)
    skip = {_key_tuple(k) for k in exclude}
    spec = {}
    for key, value in _leaves(data):
        if _key_tuple(key) in skip:
            continue
        spec[_field_name(key)] = (tuple(value.shape[1:]), _numpy_dtype(value.dtype, key))
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


def _check_batch(data: Any) -> None:
    if not isinstance(data, TensorDictBase):
        raise TypeError(
            f"a distore replay buffer stores TensorDicts, got {type(data).__name__}: wrap your "
            "tensors in tensordict.TensorDict({...}, batch_size=[n])"
        )
    if data.batch_dims != 1:
        raise SpecMismatch(
            f"extend() takes a TensorDict with one batch dimension (its items), got batch "
            f"size {list(data.batch_size)}: flatten it first (data.reshape(-1)), or use add() "
            "for a single item"
        )


class DistoreReplayBuffer:
    """A TorchRL-style replay buffer (as `TensorDictReplayBuffer`) whose items
    live in the distore table `table`.

    `client` is a `ds.connect(...)` client or a control-plane address
    ("host:port"; the buffer then connects and closes its client itself).
    When the table does not exist, it is created at the first `extend`
    (or here, when `spec` is given) with `capacity` items and the given
    `sampler`, `remover`, `rate_limiter` and `max_times_sampled` (as in
    `client.create_table`); `spec` may be a TensorDict (one item or a batch:
    only its keys, shapes and dtypes are used) or a distore spec dict.

    Sampling: `batch_size` is the default of `sample()`; the learner samples
    onto `device` ("cpu" or "cuda[:N]") with `prefetch` batches requested
    ahead; `sample_timeout` s is how long a sample waits for data (then
    `ds.NoData`). A sampled TensorDict's tensors are views into the
    learner's ring, valid until `prefetch + 1` more samples; `clone=True`
    hands out copies instead. The learner asks for the next batch while it
    reads this one, so a priority update shows from the second sample after it
    (one batch per request, `sample_ahead=1`; `learner_options={"sample_ahead":
    k}` asks k at a time: fewer round trips, updates seen up to k batches later).

    Inserting: `extend` waits until its items are stored (`flush=True`);
    `flush=False` leaves batching to the writer (faster for actors that
    never sample; call `flush()`). Items get the data's `priority_key`
    entry as priority when present, else `default_priority` (None: the
    largest priority this buffer has set so far, 1.0 at first, as TorchRL
    does). `exclude_keys` are never stored; neither are `index`, the weight
    keys and `priority_key`. `writer_options` and `learner_options` go to
    `client.writer()` and `client.learner()`.

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
        max_times_sampled: int = 0,
        device: str = "cpu",
        prefetch: int = 2,
        sample_timeout: float = 30.0,
        clone: bool = False,
        flush: bool = True,
        priority_key: str | tuple[str, ...] = "td_error",
        default_priority: float | None = None,
        eps: float = 1e-8,
        beta: float | None = None,
        exclude_keys: Sequence[Any] = (),
        writer_options: Mapping[str, Any] | None = None,
        learner_options: Mapping[str, Any] | None = None,
    ):
        """See the class docstring."""
        if isinstance(client, str):
            import distore_ucx as ds

            client, self._owns_client = ds.connect(client), True
        else:
            self._owns_client = False
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if not (np.isfinite(eps) and eps >= 0):
            raise ConfigError(f"eps must be a finite number >= 0, got {eps!r}")
        self._client = client
        self.table = table
        self._batch_size = batch_size
        self.capacity = capacity
        self._table_options = {"sampler": sampler, "remover": remover,
                               "rate_limiter": rate_limiter,
                               "max_times_sampled": max_times_sampled}
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.sample_timeout = sample_timeout
        self.clone = clone
        self.flush_each_extend = flush
        self.priority_key = priority_key
        self.default_priority = default_priority
        self.eps = float(eps)
        self._beta = beta
        self.exclude_keys = tuple(exclude_keys)
        self._writer_options = dict(writer_options or {})
        self._learner_options = dict(learner_options or {})
        self._writer = None
        self._learners: dict[int, Any] = {}  # one per batch size asked for
        self._fields: dict[str, tuple[tuple[str, ...], tuple[int, ...], np.dtype]] | None = None
        self._max_priority = 1.0
        self._write_count = 0
        self._closed = False
        self._meta = {INDEX_KEY, *WEIGHT_KEYS, _key_tuple(priority_key)}
        self._meta = {_key_tuple(k) for k in self._meta} | {_key_tuple(k) for k in exclude_keys}
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
        """Insert the n items of `data` (batch size [n]) with one batched
        insert; returns their keys (int64, as TorchRL's indices) and sets
        them as `data["index"]`, as TorchRL does. Priorities come from
        `data[priority_key]` (max over trailing dimensions, + eps) unless
        `update_priority=False` or it is absent (then the default priority).
        """
        self._ensure_open()
        _check_batch(data)
        n = data.batch_size[0]
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        if self._fields is None:
            self._create(data)
        arrays = self._arrays(data)
        prio = None
        if update_priority is not False:
            p = data.get(self.priority_key, None)
            if p is not None:
                prio = self._priorities(p, n)
        if prio is None:
            fill = self._max_priority if self.default_priority is None else self.default_priority
            prio = float(fill)
        if self._writer is None:
            self._writer = self._client.writer(**self._writer_options)
        keys = self._writer.insert(self.table, arrays, priority=prio)
        if self.flush_each_extend:
            self._writer.flush()
        self._write_count += n
        index = torch.from_numpy(keys.view(np.int64))
        if not data.is_locked:
            data.set(INDEX_KEY, index.to(data.device) if data.device is not None else index)
        return index

    def add(self, data: TensorDictBase) -> torch.Tensor:
        """Insert one item (a TensorDict with batch size []); returns its key."""
        if isinstance(data, TensorDictBase) and data.batch_dims == 0:
            index = self.extend(data.unsqueeze(0))
            if not data.is_locked:
                data.set(INDEX_KEY, index[0])
            return index[0]
        raise SpecMismatch(
            "add() takes one item (a TensorDict with batch size []); "
            f"got {type(data).__name__} with batch size "
            f"{list(getattr(data, 'batch_size', []))}: use extend() for a batch"
        )

    def flush(self) -> None:
        """Wait until every item this buffer inserted is stored (sampleable)."""
        self._ensure_open()
        if self._writer is not None:
            self._writer.flush()

    def _arrays(self, data: TensorDictBase) -> dict[str, np.ndarray]:
        """{field: numpy array [n, ...]} of `data`, checked against the table."""
        fields = self._fields
        given = {}
        for key, value in _leaves(data):
            if _key_tuple(key) not in self._meta:
                given[_field_name(key)] = (key, value)
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
    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A TensorDict of `batch_size` (default: the buffer's) sampled items on
        the learner's device, with `index` and, when `beta` is set, the
        importance weights; `(td, info)` with `return_info=True`."""
        self._ensure_open()
        n = batch_size if batch_size is not None else self._batch_size
        if n is None:
            raise ConfigError(
                "batch_size not given: pass it to sample() or to the buffer's constructor"
            )
        learner = self._learner(n)
        batch = learner.sample(timeout=self.sample_timeout)
        fields = self._fields
        td = TensorDict(batch_size=[n], device=self.device)
        for name, value in batch.data.items():  # once per field, never per item
            if isinstance(value, np.ndarray):
                # from_numpy, not DLPack: the tensor keeps the view (and so the
                # ring) alive the ordinary way, also at interpreter exit.
                value = torch.from_numpy(value)
            td.set(fields[name][0], value.clone() if self.clone else value)
        index = torch.from_numpy(batch.keys.view(np.int64)).to(self.device)
        info = {INDEX_KEY: index}
        td.set(INDEX_KEY, index)
        if batch.weights is not None:
            w = torch.from_numpy(batch.weights.astype(np.float32)).to(self.device)
            for key in WEIGHT_KEYS:
                info[key] = w
                td.set(key, w)
        return (td, info) if return_info else td

    def __iter__(self) -> Iterator[TensorDictBase]:
        """Samples of `batch_size` forever."""
        while True:
            yield self.sample()

    def update_priority(self, index: Any, priority: Any) -> dict:
        """Set the priorities of the items with keys `index` (from `sample()`'s
        "index"), in one batched request: |priority| + eps (a priority with
        trailing dimensions is reduced by its max, as TorchRL does). Keys
        evicted meanwhile are skipped and counted ({"updated", "missing"})."""
        self._ensure_open()
        keys = _as_keys(index)
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
        loops call after the loss wrote its `td_error` into the sample."""
        self._ensure_open()
        priority = data.get(self.priority_key, None)
        if priority is None:
            raise KeyError(
                f"update_tensordict_priority: the TensorDict has no {self.priority_key!r} "
                f"(the buffer's priority_key); its keys: {list(data.keys())}"
            )
        index = data.get(INDEX_KEY, None)
        if index is None:
            raise KeyError("update_tensordict_priority: the TensorDict has no 'index': pass "
                           "one that sample() returned")
        while index.ndim > 1:
            index = index[..., 0]
        return self.update_priority(index, priority)

    def _priorities(self, priority: Any, n: int) -> np.ndarray:
        p = torch.as_tensor(priority).detach()
        if p.ndim == 0:
            p = p.expand(n)
        if p.shape[0] != n:
            raise ValueError(f"table {self.table!r}: {p.shape[0]} priorities (shape "
                             f"{list(p.shape)}) for {n} items")
        if p.ndim > 1:
            p = p.reshape(n, -1).amax(1)
        out = p.to("cpu", torch.float64).numpy().copy()
        np.abs(out, out=out)
        out += self.eps
        finite = out[np.isfinite(out)]
        if finite.size:
            self._max_priority = max(self._max_priority, float(finite.max()))
        return out

    # -- the table -------------------------------------------------------------
    def _create(self, spec: Any) -> None:
        """Create the table from `spec` (a TensorDict or a distore spec) unless it
        exists; an existing table must have the same fields."""
        from .spec import TableSpec

        if isinstance(spec, TensorDictBase):
            spec = spec_of(spec.unsqueeze(0) if spec.batch_dims == 0 else spec,
                           exclude=tuple(self._meta))
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
            if self.capacity is not None:
                # The same definition is a no-op; another raises TableExists naming
                # what differs (capacity, sampler, ...).
                same = {f.name: (f.shape, f.dtype) for f in have.fields}  # its field order
                self._client.create_table(self.table, capacity=self.capacity, spec=same, **opts)
        self._load()

    def _load(self) -> None:
        """Read the table's spec, if the table exists."""
        try:
            spec = self._client.spec(self.table)
        except TableNotFound:
            return
        if spec.unnamed:
            raise ConfigError(
                f"table {self.table!r} holds one unnamed array per item; a TorchRL buffer "
                "needs named fields ({'obs': ..., ...}): use another table"
            )
        self._fields = {f.name: (tuple(f.name.split(SEP)) if SEP in f.name else f.name,
                                 f.shape, f.dtype) for f in spec.fields}

    def _learner(self, n: int):
        learner = self._learners.get(n)
        if learner is None:
            if self._fields is None:
                self._load()
                if self._fields is None:
                    raise TableNotFound(
                        f"table {self.table!r} does not exist yet: extend() the buffer (with "
                        "capacity= given) before sampling, or create the table"
                    )
            # One batch per control-plane request, as TorchRL's own buffers
            # see a priority update at once (learner_options may say more).
            opts = {"prefetch": self.prefetch, "beta": self._beta, "sample_ahead": 1,
                    **self._learner_options}
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
    the table samples with `ds.Prioritized(alpha)` (when this buffer creates
    it) and samples carry importance weights with exponent `beta` under
    `priority_weight` (what TorchRL's losses read) and `_weight`.

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


def _fields_of(spec) -> dict:
    return {f.name: (f.shape, f.dtype.str) for f in spec.fields}


def _describe(spec) -> str:
    return "{" + ", ".join(f"{f.name}: {list(f.shape)} {f.dtype}" for f in spec.fields) + "}"
