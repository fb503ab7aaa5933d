"""The TorchRL replay buffers: DistoreReplayBuffer and its prioritized kind.

A buffer holds its options and state and TorchRL's attributes (`batch_size`,
`write_count`, `beta`, `len`), and owns its writer, learners and (when it
connected it) its client; what it does is in the modules of its parts:
`Writing` (writer.py), `Sampling` (sampler.py), `Priorities`
(priorities.py), `TableBinding` (table.py) and `Sharing` (handle.py:
pickling, `share()`, `state_dict()`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, TableNotFound
from ..transport.at_exit import ClosedAtExit
from .conversion import INDEX_KEY, WEIGHT_KEYS, _key_tuple
from .handle import Sharing, records_options
from .priorities import REDUCTIONS, Priorities
from .sampler import Sampling
from .slices import SliceOptions
from .table import TableBinding
from .writer import Writing

log = logging.getLogger(__name__)


class DistoreReplayBuffer(Writing, Sampling, Priorities, TableBinding, Sharing):
    """A TorchRL-style replay buffer (as `TensorDictReplayBuffer`) whose items
    live in the distore table `table`.

    When the table does not exist, it is created at the first `extend` (or
    here, when `spec` is given) with `capacity` items and the table options
    given (as in `Client.create_table`). When it exists, those options
    (given ones only) must match it; leave them out to use the table as it
    is.

    Items: the first `ndim` batch dimensions of extended data index items,
    as in TorchRL's storages (`LazyTensorStorage(n, ndim=...)`): with the
    default 1, a collector's [n_envs, T] batch is n_envs items of [T] steps
    and samples have batch size [batch_size, T]; `ndim=2` stores its
    n_envs * T transitions one by one. (A buffer that only opens a table
    learns the items' own batch dimensions from `spec=` or its first
    extend; before that, samples have batch size [batch_size].)

    Priorities: items get the data's `priority_key` entry as priority when
    present (reduced over an item's trailing dimensions by `reduction`,
    plus `eps`), else `default_priority`. The priority key is stored with
    the item when the table has that field (it is made from the first
    data's keys).

    Other processes: the buffer pickles to a handle (address, table, token
    file, these options) that connects there at its first use, with its
    own client, so multi-process collectors (`MultiSyncCollector(...,
    replay_buffer=rb)`) write into it from each worker; `state_dict()`
    keeps the options and counters, not the items (see handle.py).

    >>> with DistoreReplayBuffer(cluster.address, "replay", capacity=10_000,
    ...                          batch_size=64) as rb:
    ...     rb.extend(collector_batch)     # a TensorDict, batch size [n]
    ...     td = rb.sample()               # TensorDict, batch size [64], with "index"

    Args:
        client: A `Client`, or a control-plane address ("host:port"): the
            buffer then connects, and closes that client itself.
        table: The table's name.
        batch_size: The default of `sample()` (None: pass it there).
        capacity: Items of the table the buffer creates.
        spec: Create the table now from a TensorDict shaped like the data
            `extend` will get (only its keys, shapes and dtypes are used;
            one with fewer than `ndim` batch dimensions is one item) or
            from a distore spec dict.
        sampler: The table's sampler (a `Selector`), or a slice sampler
            (`SliceSampler`, `PrioritizedSliceSampler`, or TorchRL's
            own) for a table of slices.
        remover: The table's remover.
        rate_limiter: The table's rate limiter.
        max_times_sampled: As `Client.create_table`.
        ndim: Batch dimensions of extended data that index items (above).
        device: Where samples land: "cpu" or "cuda[:N]".
        sample_timeout: Seconds a sample waits for actors to fill a table
            with too few items; 0 raises `EmptyTable` at once.
        sample_ahead: Ask for the next batch while this one is read (one
            round trip hidden per sample, but updates and evictions then
            show one sample late). By default a sample is asked for when
            `sample()` is called and reflects every `extend` and priority
            update before it, as TorchRL's.
        clone: Sampled tensors are the caller's. False hands out views into
            the learner's receive ring instead (no copy, valid until
            `prefetch + 1` more samples).
        prefetch: The learners' `prefetch`.
        flush: `extend` waits until its items are stored. False leaves
            batching to the writer (faster for actors that never sample;
            call `flush()`).
        priority_key: The key of the data's priorities.
        default_priority: The priority of items whose data has none (None:
            the largest priority this buffer has set so far, 1.0 at first,
            as TorchRL does).
        eps: Added to every priority set (default: the sampler's own when
            it has one, as TorchRL's prioritized samplers do, else 1e-8).
        beta: The importance-sampling exponent of the samples' weights
            (None: no weights).
        reduction: TorchRL's "max", "min", "mean", "median" or "sum"
            (default: the sampler's own, else "max").
        exclude_keys: Keys never stored (nor are `index` and the weights).
        writer_options: Options of `Client.writer`.
        learner_options: Options of `Client.learner`.

    Raises:
        ConfigError: An option is invalid; `spec` given for a table that does
            not exist, without `capacity`; a slice sampler's argument a
            table of slices cannot take.
        TableExists: The table exists with other options; the message names
            the fields that differ.
        SpecMismatch: `spec` has other fields than the existing table.
        ConnectionFailed: Nothing answers at the address (as `connect`).
    """

    @records_options
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
        eps: float | None = None,
        beta: float | None = None,
        reduction: str | None = None,
        exclude_keys: Sequence[Any] = (),
        writer_options: Mapping[str, Any] | None = None,
        learner_options: Mapping[str, Any] | None = None,
    ):
        """See the class docstring."""
        # Left out: the sampler's own (TorchRL's prioritized samplers take
        # them), else TorchRL's defaults.
        eps = _sampler_option(sampler, "eps", eps, 1e-8)
        reduction = _sampler_option(sampler, "reduction", reduction, "max")
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
        self._table_options = {"sampler": sampler, "remover": remover,
                               "rate_limiter": rate_limiter,
                               "max_times_sampled": max_times_sampled}
        # A slice sampler (slices.py): a table of steps sampled as slices.
        self._slices = SliceOptions.from_sampler(sampler)
        if self._slices is not None:
            beta, capacity = self._slice_table(sampler, batch_size, beta, capacity)
        self.capacity = capacity
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
        self._direct_updates = [0, 0]  # [updated, missing] of updates sent with no learner
        self._fields: dict[str, tuple[tuple[str, ...], tuple[int, ...], np.dtype]] | None = None
        self._item_batch: tuple[int, ...] | None = None  # an item's own batch dims, once known
        self._max_priority = 1.0
        self._write_count = 0
        self._write_base: int | None = None  # set by share(): count every process's inserts
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
        _OPEN.add(self)

    def _slice_table(self, sampler: Any, batch_size: int | None, beta: float | None,
                     capacity: int | None) -> tuple[float | None, int | None]:
        """The table options of a slice sampler's buffer (a table of slices,
        prioritized when the sampler or this buffer is); returns the beta
        and capacity to use (the sampler's when the buffer has none)."""
        import distore_ucx as ds

        s = self._slices
        alpha = s.alpha if s.alpha is not None else getattr(self, "alpha", None)
        self._table_options.update(
            sampler=None if alpha is None else ds.Prioritized(alpha=alpha),
            slice_len=s.table_slice_len(batch_size), slice_pad=s.slice_pad)
        if capacity is None:
            capacity = getattr(sampler, "max_capacity", None)
        return (s.beta if beta is None else beta), capacity

    # -- TorchRL's attributes ----------------------------------------------
    @property
    def batch_size(self) -> int | None:
        """The default number of items `sample()` returns, or None."""
        return self._batch_size

    @property
    def write_count(self) -> int:
        """Items this buffer has inserted; once `shared`, items every process
        sharing it inserted (TorchRL collectors read it)."""
        if self._write_base is not None:
            return self._shared_write_count()
        return self._write_count

    @property
    def beta(self) -> float | None:
        """The importance-sampling exponent of the weights, None for none.
        Settable, e.g. to anneal it towards 1 (`ConfigError` unless finite
        and >= 0)."""
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

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the writer, close the learners (and the client, when
        the buffer connected it itself); a second call does nothing.

        Raises:
            DistoreError: The first part that failed to close (its writer
                could not store what it held, as `Writer.close`); the
                others are closed all the same.
        """
        if self._close_pending() or self._closed:
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
            from ..errors import Closed

            raise Closed(f"this replay buffer of table {self.table!r} is closed: make a new one")

    def __enter__(self) -> DistoreReplayBuffer:  # noqa: PYI034  (typing.Self: 3.11+)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Dropped without close(): close what it owns, as a writer flushes
        # itself. Its own client's UCX runtime, destroyed with its progress
        # thread running, made ucxx warn "The progress thread should be
        # explicitly stopped".
        # (__dict__, not getattr: a buffer from a handle, never used, would
        # connect in __getattr__ just to close.)
        if not self.__dict__.get("_closed", True):
            self._close_unattended("garbage-collected without close()")

    def _close_unattended(self, why: str) -> None:
        """close() for a buffer nobody closed (collected, or open at exit):
        never raises; a failure is logged."""
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001  nobody to raise to: say it
            log.warning("replay buffer of table %r (%s): closing it failed: %s", self.table,
                        why, exc)


# Buffers not closed yet, closed at interpreter exit before the UCX runtimes.
_OPEN = ClosedAtExit()


class DistorePrioritizedReplayBuffer(DistoreReplayBuffer):
    """A prioritized buffer, as TorchRL's `TensorDictPrioritizedReplayBuffer`:
    the table samples with `ds.Prioritized(alpha)` (an existing table must
    have that alpha, else TableExists names it) and samples carry TorchRL's
    importance weights (p_i / p_min)^-beta under `priority_weight` (what
    TorchRL's losses read) and `_weight`.

    Args:
        client: As `DistoreReplayBuffer`.
        table: As `DistoreReplayBuffer`.
        alpha: The priority exponent of the table's `Prioritized` sampler.
        beta: The importance-sampling exponent of the weights.
        eps: Added to every priority set (default: as `DistoreReplayBuffer`).
        priority_key: The key of the data's priorities.
        **kwargs: `DistoreReplayBuffer`'s other options.

    >>> rb = DistorePrioritizedReplayBuffer(client, "per", alpha=0.6, beta=0.4,
    ...                                     capacity=100_000, batch_size=64)
    >>> td = rb.sample()
    >>> loss = loss_module(td)            # writes td["td_error"]
    >>> rb.update_tensordict_priority(td)
    """

    @records_options
    def __init__(self, client: Any, table: str, *, alpha: float, beta: float,
                 eps: float | None = None, priority_key: str | tuple[str, ...] = "td_error",
                 **kwargs: Any):
        """See the class docstring; other options as DistoreReplayBuffer's."""
        import distore_ucx as ds

        if kwargs.get("sampler") is None:
            kwargs["sampler"] = ds.Prioritized(alpha=alpha)
        self.alpha = alpha
        super().__init__(client, table, beta=beta, eps=eps, priority_key=priority_key, **kwargs)


def _sampler_option(sampler: Any, name: str, given: Any, default: Any) -> Any:
    """`given`, else the sampler's `name` (TorchRL's samplers keep eps as
    `_eps`), else `default`."""
    if given is not None:
        return given
    for attr in (name, f"_{name}"):
        value = getattr(sampler, attr, None)
        if value is not None and not callable(value):
            return value
    return default
