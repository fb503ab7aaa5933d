"""TorchRL's slice samplers on a table of slices (docs/semantics.md, "Slices").

A buffer built with a slice sampler (TorchRL's `SliceSampler` or
`PrioritizedSliceSampler`, or the same-named classes here, which carry the
same arguments without TorchRL's compiled segment trees) keeps its frames as
steps of episodes in a table made with `slice_len`: `extend` appends each
frame as a step of its trajectory (the trajectory key, as TorchRL finds it:
`traj_key`, else ("collector", "traj_ids") or "episode" when the data has
them; the end key (("next", "done") by default) ends an episode), so a
trajectory's steps stay consecutive when collectors' workers interleave,
and the store keeps the episodes: sampling never scans the storage.

A sample is TorchRL's: a flat [num_slices * slice_len] TensorDict, each
slice's steps in order, `index` the steps' keys, the truncated key set on
each slice's last (real) step and the done key = stored done | truncated,
the terminated key from the data (or False), `is_init` OR-ed with each
slice's first step when the data has it, and ("collector", "mask") with
`pad_output=True`; on a prioritized buffer `priority_weight` (each slice's
start draw's weight, repeated over its steps). Starts are drawn uniformly
over the valid starts (or by the start step's priority^alpha), where
TorchRL draws a trajectory uniformly and then a start in it. Refused, with
a message: SliceSamplerWithoutReplacement, span other than (False, True),
static `ends` / `trajectories`, `end_keys`, `fragmented=True` (the README's
"TorchRL replay buffers" says the same).

Functions and one options class; no state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from ..errors import ConfigError, SpecMismatch
from .conversion import _key_tuple
from .errors import EndSignalShape

log = logging.getLogger(__name__)

TRAJ_KEYS = (("collector", "traj_ids"), ("episode",))  # what TorchRL probes, in order
MASK_KEY = ("collector", "mask")


@dataclass(frozen=True)
class SliceOptions:
    """A slice sampler's arguments, as a distore buffer uses them."""

    num_slices: int | None
    slice_len: int | None
    end_key: tuple[str, ...]
    traj_key: tuple[str, ...] | None
    truncated_key: tuple[str, ...] | None
    init_key: tuple[str, ...] | None
    strict_length: bool
    pad_output: bool
    span_right: bool
    alpha: float | None  # None: uniform starts
    beta: float | None

    @classmethod
    def from_sampler(cls, sampler: Any) -> SliceOptions | None:
        """The options of a TorchRL slice sampler (or of one of this module's
        stand-ins); None for anything else. Refuses, naming the argument,
        what a table of slices cannot do."""
        if not (hasattr(sampler, "strict_length") and hasattr(sampler, "num_slices")
                and hasattr(sampler, "slice_len")):
            return None
        kind = type(sampler).__name__
        if "WithoutReplacement" in kind:
            raise ConfigError(
                f"{kind}: a distore table samples slices with replacement only (it has no "
                "epochs); use SliceSampler or PrioritizedSliceSampler")
        if "static-stop-and-length" in (getattr(sampler, "_cache", None) or {}):
            raise ConfigError(f"{kind}(ends=... or trajectories=...): the store keeps the "
                              "episodes from the data; pass traj_key or end_key instead")
        if getattr(sampler, "fragmented", False):
            raise ConfigError(f"{kind}(fragmented=True): the store keeps each trajectory's "
                              "steps consecutive already; leave fragmented out")
        if getattr(sampler, "end_keys", None):
            raise ConfigError(f"{kind}(end_keys=...): give one end_key (the store ends an "
                              "episode on it)")
        if (sampler.num_slices is None) == (sampler.slice_len is None):
            raise ConfigError(f"{kind}: give num_slices or slice_len, not both")
        span = (tuple(sampler.span) if isinstance(sampler.span, (tuple, list))
                else (sampler.span,) * 2)
        left, right = span
        if left or (right and right is not True):
            raise ConfigError(
                f"{kind}(span={sampler.span!r}): a table of slices can cut slices at an "
                "episode's end (span=(False, True)) but not start them before it, nor at a "
                "fixed distance from it; leave span out or use span=(False, True)")
        alpha = getattr(sampler, "_alpha", getattr(sampler, "alpha", None))
        beta = getattr(sampler, "_beta", getattr(sampler, "beta", None))
        prioritized = "Prioritized" in kind
        end_key = sampler.end_key if sampler.end_key is not None else ("next", "done")
        return cls(
            num_slices=sampler.num_slices, slice_len=sampler.slice_len,
            end_key=_key_tuple(end_key),
            traj_key=None if sampler.traj_key is None else _key_tuple(sampler.traj_key),
            truncated_key=(None if sampler.truncated_key is None
                           else _key_tuple(sampler.truncated_key)),
            init_key=(None if getattr(sampler, "init_key", None) is None
                      else _key_tuple(sampler.init_key)),
            strict_length=bool(sampler.strict_length), pad_output=bool(sampler.pad_output),
            span_right=right is True,
            alpha=float(alpha) if prioritized else None,
            beta=float(beta) if prioritized and beta is not None else None)

    @property
    def slice_pad(self) -> str:
        """The table's slice_pad: which short slices it samples."""
        if self.span_right:
            return "end"
        return "none" if self.strict_length else "short_episodes"

    def table_slice_len(self, batch_size: int | None) -> int:
        """The table's slice_len: `slice_len`, or batch_size // num_slices."""
        if self.slice_len is not None:
            return int(self.slice_len)
        if batch_size is None or batch_size % self.num_slices:
            raise ConfigError(
                f"a slice sampler with num_slices={self.num_slices} makes slices of "
                f"batch_size // num_slices steps: give the buffer a batch_size divisible by "
                f"{self.num_slices} (got {batch_size}), or give the sampler slice_len=")
        return batch_size // self.num_slices

    def slices_in(self, batch_size: int, slice_len: int) -> int:
        """How many slices a sample of `batch_size` frames holds (TorchRL's errors)."""
        if self.num_slices is not None:
            if batch_size % self.num_slices or batch_size // self.num_slices != slice_len:
                raise RuntimeError(
                    f"The batch-size must be divisible by the number of slices, got "
                    f"batch_size={batch_size} and num_slices={self.num_slices}; this buffer's "
                    f"table holds slices of {slice_len} steps, so sample batch_size="
                    f"{self.num_slices * slice_len}")
            return self.num_slices
        if batch_size % slice_len:
            raise RuntimeError(
                f"The batch-size must be divisible by the slice length, got "
                f"batch_size={batch_size} and slice_len={slice_len}.")
        return batch_size // slice_len


class SliceSampler:
    """TorchRL's `SliceSampler` arguments for a distore buffer (TorchRL's own
    object is accepted too). The store samples with replacement.

    >>> sampler = SliceSampler(slice_len=32, traj_key=("collector", "traj_ids"))
    >>> rb = DistoreReplayBuffer(client, "seq", capacity=100_000, batch_size=256,
    ...                          sampler=sampler)

    Args:
        num_slices: Slices a sample (its slice length is then the buffer's
            `batch_size` // `num_slices`); give it or `slice_len`.
        slice_len: Steps a slice.
        end_key: The key that ends a trajectory (default ("next", "done")).
        traj_key: The key that says which trajectory a frame continues
            (default: ("collector", "traj_ids") or "episode" when the data
            has them).
        truncated_key: The key set on each slice's last step.
        init_key: The key OR-ed with each slice's first step, when the data
            has it.
        strict_length: False keeps trajectories shorter than a slice whole.
        pad_output: Pad those to the slice length, with ("collector", "mask").
        span: False, or (False, True): slices may be cut by a trajectory's end.
        **ignored: TorchRL's performance options (compile, cache_values,
            use_gpu, step_key), which change nothing here.

    Raises:
        TypeError: Another keyword argument.
        ValueError: `pad_output` with `strict_length`.
    """

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 end_key: Any = None, traj_key: Any = None,
                 truncated_key: Any = ("next", "truncated"), init_key: Any = "is_init",
                 strict_length: bool = True, pad_output: bool = False,
                 span: bool | tuple = False, **ignored: Any):
        """See the class docstring."""
        unknown = set(ignored) - {"compile", "cache_values", "use_gpu", "step_key"}
        if unknown:
            raise TypeError(f"SliceSampler got unexpected arguments {sorted(unknown)}")
        if pad_output and strict_length:
            raise ValueError("pad_output=True is incompatible with strict_length=True: "
                             "padding only happens when short trajectories are kept, which "
                             "requires strict_length=False.")
        self.num_slices, self.slice_len = num_slices, slice_len
        self.end_key, self.traj_key, self.end_keys = end_key, traj_key, None
        self.truncated_key, self.init_key = truncated_key, init_key
        self.strict_length, self.pad_output, self.span = strict_length, pad_output, span
        self.fragmented = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_slices={self.num_slices}, "
                f"slice_len={self.slice_len}, strict_length={self.strict_length})")


class PrioritizedSliceSampler(SliceSampler):
    """TorchRL's `PrioritizedSliceSampler` arguments for a distore buffer: a
    slice's start is drawn by its start step's priority^alpha; samples
    carry `priority_weight` (the start draw's, over the slice's steps).

    Args:
        max_capacity: The table's capacity unless the buffer has one.
        alpha: The priority exponent of slice starts.
        beta: The importance-sampling exponent of the weights.
        eps: Added to every priority set.
        reduction: How a priority is reduced over an item's dimensions.
        **kwargs: `SliceSampler`'s arguments.
    """

    def __init__(self, *, max_capacity: int | None = None, alpha: float, beta: float,
                 eps: float = 1e-8, reduction: str = "max", **kwargs: Any):
        """See the class docstring."""
        super().__init__(**kwargs)
        self.max_capacity, self.alpha, self.beta = max_capacity, alpha, beta
        self.eps, self.reduction = eps, reduction


def traj_key_of(opts: SliceOptions, data: TensorDictBase) -> tuple[str, ...] | None:
    """The key whose values say which trajectory each frame continues: the
    sampler's traj_key, else the first of TRAJ_KEYS the data has (as
    TorchRL probes), else None (one stream, ended by the end key). A
    traj_key the data lacks falls back to the end key, as TorchRL's
    sampler does (logged at INFO)."""
    keys = {_key_tuple(k) for k in data.keys(include_nested=True, leaves_only=True)}
    if opts.traj_key is not None:
        if opts.traj_key in keys:
            return opts.traj_key
        log.info("the slice sampler's traj_key %r is not in the data: trajectories end at "
                 "the end key %r instead (as TorchRL's SliceSampler falls back)",
                 opts.traj_key, opts.end_key)
        return None
    return next((k for k in TRAJ_KEYS if k in keys), None)


def steps_of(opts: SliceOptions, data: TensorDictBase, traj_key) -> tuple[np.ndarray, np.ndarray]:
    """(env, done) per frame of flat `data`: the trajectory each continues
    (int64; 0 for all without a traj key) and whether it ends it (the end
    key, False where absent)."""
    n = data.batch_size[0]
    if traj_key is not None:
        traj = data.get(traj_key, None)
        if traj is None:
            raise SpecMismatch(f"the slice sampler's traj_key {traj_key!r} is not in the data: "
                               "give the data that key, or the sampler another one")
        env = _per_frame(traj, n, traj_key).to(torch.int64).numpy()
    else:
        env = np.zeros(n, np.int64)
    done = data.get(opts.end_key, None)
    if done is None:
        done = np.zeros(n, bool)
    else:
        done = _per_frame(done, n, opts.end_key, EndSignalShape,
                          "Expected the end-of-trajectory signal to be 1-dimensional: ").numpy()
    return env, done.astype(bool, copy=False)


def _per_frame(value: torch.Tensor, n: int, key, error: type = SpecMismatch,
               prefix: str = "") -> torch.Tensor:
    value = value.detach().cpu()
    if value.numel() != n:
        raise error(f"{prefix}key {key!r} must hold one value per frame ({n}), got shape "
                    f"{list(value.shape)}")
    return value.reshape(n)


def flat_sample(opts: SliceOptions, td: TensorDict, mask: np.ndarray, step_keys: np.ndarray,
                weights: torch.Tensor | None, weight_keys: tuple[str, ...],
                index_key: str) -> TensorDict:
    """A [B, T] sample of slices as TorchRL's slice samplers return it: flat,
    with the truncated, done, terminated, is_init and mask entries, `index`
    per step; padding rows dropped unless `pad_output`."""
    b, t = mask.shape
    device = td.device
    flat = td.reshape(b * t)
    mask_t = torch.from_numpy(mask.reshape(-1))
    lengths = mask.sum(axis=1)
    last = torch.zeros(b, t, dtype=torch.bool)
    last[torch.arange(b), torch.from_numpy(lengths - 1)] = True
    flat.set(index_key, torch.from_numpy(step_keys.reshape(-1).view(np.int64)).to(device))
    if weights is not None:
        w = weights.to(device).repeat_interleave(t)
        for key in weight_keys:
            flat.set(key, w)
    if opts.truncated_key is not None:
        truncated = last.reshape(-1, 1).to(device)
        done_key = (*opts.truncated_key[:-1], "done")
        terminated_key = (*opts.truncated_key[:-1], "terminated")
        stored_done = flat.get(done_key, None)
        done = truncated.clone() if stored_done is None else (
            stored_done.reshape(-1, 1).bool() | truncated)
        terminated = flat.get(terminated_key, None)
        if terminated is None:
            terminated = torch.zeros_like(truncated)
        flat.set(opts.truncated_key, truncated)
        flat.set(done_key, done)
        flat.set(terminated_key, terminated)
    if opts.init_key is not None:
        is_init = flat.get(opts.init_key, None)
        if is_init is not None:
            first = torch.zeros(b, t, dtype=torch.bool)
            first[:, 0] = True
            flat.set(opts.init_key, is_init | first.reshape(is_init.shape).to(device))
    if opts.pad_output:
        flat.set(MASK_KEY, mask_t.to(device))
        return flat
    if mask.all():
        return flat
    return flat[mask_t.to(device)]
