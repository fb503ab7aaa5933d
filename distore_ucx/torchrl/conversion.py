"""TensorDicts as a table's items: keys as field names, specs, tensors as arrays.

A nested key ("next", "obs") is the field "next/obs"; the first `ndim` batch
dimensions of a TensorDict index its items and the rest are an item's own
shape; "index" (the items' distore keys) and the importance weights are
set on samples, expanded over the items' own batch dimensions, as TorchRL
sets them. Functions only, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ..errors import ConfigError, SpecMismatch

SEP = "/"  # nested key ("next", "obs") <-> field name "next/obs"
INDEX_KEY = "index"
WEIGHT_KEYS = ("priority_weight", "_weight")  # TorchRL's name now, and its older one


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

    Args:
        data: The TensorDict.
        exclude: Keys to leave out.
        ndim: Batch dimensions that index items.

    Returns:
        ``{field: (per-item shape, numpy dtype)}``; a nested key's field name is
        its parts joined with "/".

    Raises:
        TypeError: `data` is not a TensorDict.
        SpecMismatch: `data` has fewer than `ndim` batch dimensions.
        ConfigError: A key cannot be stored (its name, a value that is not
            a tensor, a dtype numpy lacks), or every key is excluded.

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
