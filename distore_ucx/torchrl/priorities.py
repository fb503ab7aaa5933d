"""Priorities of a TorchRL buffer's items: read from data, and updated.

A priority is |p| + eps, reduced over an item's trailing dimensions by one
of TorchRL's reductions; without one an item gets the default priority (the
largest this buffer has set so far, as TorchRL's buffers give). Updates go
in one batched request, through a learner of the buffer when it has one
(not waited for: `flush_priorities` waits), else to the control plane.

`Priorities` is a part of DistoreReplayBuffer (buffer.py), which sets the
state it reads: `_client`, `table`, `_learners`, `_item_batch`,
`priority_key`, `default_priority`, `eps`, `reduction`, `_max_priority`,
`_direct_updates` ([updated, missing] of updates sent without a learner).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ..protocol import check_reply
from .conversion import INDEX_KEY, _as_keys

REDUCTIONS = ("max", "min", "mean", "median", "sum")  # TorchRL's, for priorities


class Priorities:
    """update_priority and update_tensordict_priority, and the priorities of
    inserted items, for DistoreReplayBuffer."""

    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities of items in one batched request, as
        ``abs(priority) + eps``. Through the buffer's learner it is not
        waited for (its next samples follow it; docs/semantics.md, "Priority
        updates"); without one (an actor re-prioritizing) it is one request
        to the control plane. Keys evicted meanwhile are skipped and counted
        by `flush_priorities()`.

        Args:
            index: The items' keys, as `sample()` or `extend()` gave them
                (a tensor, array or list).
            priority: One priority an item, or one for all; one with more
                dimensions than `index` is reduced over them by `reduction`,
                as TorchRL does.

        Returns:
            None, as TorchRL's.

        Raises:
            TypeError: `index` does not hold integer keys.
            ValueError: The priorities do not count the items, or (sent
                without a learner) are not finite; a negative or non-finite
                one through the learner, as `Learner.update_priorities`.
        """
        self._ensure_open()
        keys = self._index_keys(index)
        prios = self._priorities(priority, len(keys))
        learner = next(iter(self._learners.values()), None)
        if learner is not None:
            learner.update_priorities(keys, prios)
            return
        # No learner here (e.g. an actor re-prioritizing): ask the control plane.
        if not np.isfinite(prios).all():
            raise ValueError(f"table {self.table!r}: priorities must be finite, got "
                             f"{prios[~np.isfinite(prios)][:3].tolist()}")
        reply = check_reply("update_priorities", self._client.call(
            "update_priorities", table=self.table, keys=keys, priorities=prios), "control plane")
        self._direct_updates[0] += reply["updated"]
        self._direct_updates[1] += reply["missing"]

    def flush_priorities(self) -> dict:
        """Wait until every priority update of this buffer is applied.

        Returns:
            ``{"updated": n, "missing": m}`` keys since the last flush (missing
            ones are no longer in the table).

        Raises:
            DistoreError: An update the control plane refused.
        """
        self._ensure_open()
        counts = {"updated": self._direct_updates[0], "missing": self._direct_updates[1]}
        self._direct_updates[:] = [0, 0]
        for learner in self._learners.values():
            got = learner.flush_priorities()
            counts = {k: counts[k] + got[k] for k in counts}
        return counts

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """`update_priority(data["index"], data[priority_key])`: what TorchRL
        loops call after the loss wrote its `td_error` into the sample. A
        TensorDict without the priority key sets the default priority (the
        largest so far), as TorchRL's buffers do. Not waited for, as
        `update_priority`.

        Args:
            data: A TensorDict that `sample()` returned.

        Raises:
            KeyError: `data` has no "index".
            ValueError: As `update_priority`.
        """
        self._ensure_open()
        index = data.get(INDEX_KEY, None)
        if index is None:
            raise KeyError("update_tensordict_priority: the TensorDict has no 'index': pass "
                           "one that sample() returned")
        priority = data.get(self.priority_key, None)
        if priority is None:
            priority = torch.tensor(float(self._fill_priority()))
        self.update_priority(index, priority)

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


def _reduce(p: torch.Tensor, reduction: str) -> torch.Tensor:
    """[n, k] -> [n] by one of REDUCTIONS (TorchRL's priority reductions)."""
    if reduction == "mean":
        return p.mean(1)
    if reduction == "sum":
        return p.sum(1)
    out = {"max": p.max, "min": p.min, "median": p.median}[reduction](1)
    return out.values
