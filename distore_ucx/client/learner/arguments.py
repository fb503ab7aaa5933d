"""A learner's arguments, checked once as it is made (Learner.__init__),
from the one table_info reply it asks for, before anything is allocated:
a mistake is named with what to use instead, not found later as a failed
mmap or a rate limiter's timeout."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np

from ...errors import ConfigError
from ...protocol import MAX_SAMPLE
from ...spec import TableSpec
from .sample_stream import resolve_sample_ahead


class Checked(NamedTuple):
    """A learner's table as its checks read it: the table_info reply, the
    spec, rows per batch (a table of slices: batch_size slices of
    slice_len steps, as many rows) and the prefetch depth (`ring - 1`
    where the older `ring=` was given)."""

    info: dict
    spec: TableSpec
    rows: int
    prefetch: int


def check_learner(client, table: str, batch_size: Any, device: str, prefetch: int,
                  ring: int | None, beta: float | None) -> Checked:
    """Check a learner's arguments against its table, from one table_info
    round trip, before anything is allocated; ConfigError names the first
    mistake (batch size, rate limiter, ring size, beta, prefetch)."""
    refuse_batch_size(batch_size)
    info = client.table_info(table)
    spec = client.spec(table)  # remembered from that reply
    rows = batch_size * max(1, info.get("slice_len") or 0)
    refuse_batch_size(rows)
    refuse_unadmittable(info, table, batch_size)  # counts slices
    refuse_unmappable_ring(spec, table, rows, device, ring if ring is not None else prefetch + 1)
    if beta is not None and not (np.isfinite(beta) and beta >= 0):
        raise ConfigError(f"beta must be a finite number >= 0, got {beta!r}")
    if ring is not None:
        prefetch = ring - 1
    if prefetch < 0:
        raise ConfigError(f"prefetch (ring - 1) must not be negative, got {prefetch}")
    return Checked(info, spec, rows, prefetch)


def check_sampling_ahead(info: dict, sample_ahead: int | None, pipeline: bool, rows: int,
                         slot_size: int) -> tuple[bool, int]:
    """Whether sampling uses the table's items up (`consuming`), and the
    batches one sample request asks for (Learner's `sample_ahead`, checked
    against `pipeline`)."""
    # Only tables where sampling is free are sampled ahead: with
    # max_times_sampled or a Queue a batch fetched but never used would be
    # lost, and a ratio limiter would count it before it was asked for.
    consuming = info["max_times_sampled"] > 0 or info["rate_limiter"]["kind"] != "min_size"
    if not pipeline and sample_ahead not in (None, 1):
        raise ConfigError(f"sample_ahead={sample_ahead} samples ahead, which pipeline=False "
                          "rules out: leave one of them out")
    return consuming, resolve_sample_ahead(sample_ahead, rows, consuming or not pipeline,
                                           slot_size)


def refuse_batch_size(batch_size: Any) -> None:
    """A batch one sample request cannot carry (protocol.MAX_SAMPLE items) is
    refused before any memory is allocated for it."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise ConfigError(f"batch_size must be an integer, got {batch_size!r}")
    if not 1 <= batch_size <= MAX_SAMPLE:
        raise ConfigError(
            f"batch_size={batch_size} is outside [1, {MAX_SAMPLE}]: one sample request "
            f"carries at most {MAX_SAMPLE} items (the protocol's limit). Use a smaller "
            "batch_size, and sample several batches for more"
        )


def refuse_unmappable_ring(spec: TableSpec, table: str, batch_size: int, device: str,
                           slots: Any) -> None:
    """A host ring (`slots` buffers of batch_size slots) larger than this
    machine's memory cannot be mapped: say so with the sizes, instead of
    failing inside UCX's mmap."""
    if str(device) != "cpu":
        return  # device memory: the GPU's allocator says what does not fit
    if not isinstance(slots, int) or slots < 1:
        return  # the Learner names that mistake
    need = batch_size * spec.slot_size * slots
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > memory:
        gib = 1 << 30
        raise ConfigError(
            f"learner of table {table!r}: its ring needs {need / gib:.1f} GiB "
            f"({slots} buffers of batch_size={batch_size} x {spec.slot_size}-byte slots), more "
            f"than this machine's {memory / gib:.1f} GiB of memory: use a smaller batch_size "
            f"(at most {memory // (spec.slot_size * slots)}) or a smaller prefetch"
        )


def refuse_unadmittable(info: dict, table: str, batch_size: int) -> None:
    """A batch the table's rate limiter could never admit at once (a Queue(10)
    asked for 64 items) is refused here, not after waiting out a timeout."""
    limiter = info.get("rate_limiter") or {}
    lo, hi = limiter.get("min_diff"), limiter.get("max_diff")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return
    if batch_size > hi - lo:
        kind = limiter.get("kind")
        what = f"Queue({int(hi)})" if kind == "queue" else f"its {kind} rate limiter"
        raise ConfigError(
            f"table {table!r}: {what} can never hand out {batch_size} items at once "
            f"(at most {int(hi - lo)}): use batch_size <= {int(hi - lo)}, or recreate the "
            "table with a larger limit"
        )
