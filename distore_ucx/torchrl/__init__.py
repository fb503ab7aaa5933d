"""TorchRL replay buffers backed by a distore table.

    pip install '.[torchrl]'        # from a source checkout (or 'distore-ucx[torchrl]')

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
  without the priority key gets the default priority, as TorchRL's),
  not waited for: the buffer's next samples follow them, and
  `flush_priorities()` waits until they are applied and returns
  {"updated", "missing"} (keys evicted meanwhile).
- Errors are distore's (`ds.DistoreError`) and also what TorchRL's code
  catches: no batch size raises `BatchSizeNotSet` (a RuntimeError) from
  `sample()` and iteration; sampling an empty buffer raises `EmptyTable` (a
  RuntimeError and a `ds.NoData`) at once, unless `sample_timeout=` asks to
  wait for actors.

A slice sampler (`sampler=SliceSampler(...)` or `PrioritizedSliceSampler`,
TorchRL's or this package's) makes the table a table of slices: frames are
steps of their trajectories and samples are TorchRL's flat slice batches
(`slices`: what is kept, what differs from TorchRL's samplers).

Other processes (`handle`): a buffer pickles to a handle (control-plane
address, table, its client's token file and timeout, the constructor's
keyword arguments, its counters) that connects where it is unpickled, at
its first use, with a client and writer of its own, which its `close()`
closes. TorchRL's multi-process collectors (`MultiSyncCollector` /
`MultiAsyncCollector(..., replay_buffer=rb)`, with a `ParallelEnv` in each
worker, with `trajs_per_batch`) hand it to every worker, which extends it
itself: no lock (the store orders inserts), each frame stored once, each
trajectory whole (the collector's traj ids). Spawn, forkserver and fork all
work (after a fork, the child's copies of open buffers are handles: the
parent's connections are never shared). Collectors call `rb.share()`: a
shared buffer's `write_count` counts every process's inserts, so their
`init_random_frames` counts the workers' frames; `rb._storage` tells them
the storage is initialized (they never write a fake batch into the table,
nor empty it). `state_dict()` holds the table's name, the options,
`write_count`, the largest priority and `beta`, never the items: those are
the store's, and keeping them is the store's checkpoint
(`client.checkpoint()`). `load_state_dict()` restores the counters into a
buffer of the same table; `dumps(path)` / `loads(path)` write and read them
as JSON in the folder `path`.

The table is created from the first TensorDict's keys, per-item shapes and
dtypes when it does not exist (pass `capacity=`; or give `spec=`); an
existing table is used as it is, and data that does not match it is refused
with a SpecMismatch that names the key, options that differ from it (capacity,
sampler, alpha...) with a TableExists that names them. Importing `distore_ucx`
never imports torch; this package needs torch and tensordict.

The package's modules, one concept each: `buffer` (the two buffer classes:
their options, TorchRL's attributes, lifetime), `writer` (`extend`, `add`,
`flush`: TensorDicts into the table), `sampler` (`sample` and iteration over
the learners behind them), `priorities` (priorities read from data and
updated), `slices` (slice samplers: trajectories in, flat slices out),
`handle` (pickling, `share()`, `state_dict()`: the buffer outside its
process),
`table` (creating or opening the buffer's table and checking it
against the data and the options), `conversion` (TensorDict keys, specs and
tensors as a table's fields, specs and arrays), `errors` (the errors TorchRL
code catches). Import their names from here.
"""

from __future__ import annotations

from ..errors import install_hint

try:
    import torch  # noqa: F401  (checked here, before the modules that need it)
    from tensordict import TensorDict, TensorDictBase  # noqa: F401
except ImportError as _exc:  # say what to install, not just what is missing
    raise ImportError(
        f"distore_ucx.torchrl needs torch and tensordict ({_exc}): "
        + install_hint("torchrl")
    ) from _exc

from .buffer import DistorePrioritizedReplayBuffer, DistoreReplayBuffer
from .conversion import INDEX_KEY, SEP, WEIGHT_KEYS, spec_of  # noqa: F401  (names the module had)
from .errors import BatchSizeNotSet, EmptyTable
from .priorities import REDUCTIONS  # noqa: F401  (a name the module had)
from .slices import PrioritizedSliceSampler, SliceSampler

__all__ = ["BatchSizeNotSet", "DistorePrioritizedReplayBuffer", "DistoreReplayBuffer", "EmptyTable",
           "PrioritizedSliceSampler", "SliceSampler", "spec_of"]
