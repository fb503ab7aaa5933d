"""distore-ucx: a distributed replay store with a one-sided UCX sample path.

>>> import numpy as np
>>> import distore_ucx as ds
>>> with ds.LocalCluster(nodes=2, arena_bytes=64 << 20) as cluster, \\
...         ds.connect(cluster.address) as client:
...     client.create_table("replay", capacity=1_000,
...                         spec={"obs": ((4, 84, 84), "uint8"), "reward": ((), "float32")})
...     writer = client.writer()
...     obs, r = np.zeros((32, 4, 84, 84), np.uint8), np.zeros(32, np.float32)
...     keys = writer.insert("replay", {"obs": obs, "reward": r}, priority=1.0)
...     writer.flush()
...     batch = client.learner("replay", batch_size=32).sample()

README.md has the same, runnable as written.
"""

from __future__ import annotations

from typing import Any

from . import logs, metrics
from .errors import (
    AuthenticationFailed,
    CapacityWarning,
    CheckpointError,
    Closed,
    ConfigError,
    ConnectionFailed,
    DistoreError,
    InvalidRequest,
    LimitExceeded,
    NoData,
    NodeGone,
    OutOfBoundsError,
    RateLimiterTimeout,
    RemoteError,
    SpecMismatch,
    StagingFull,
    StorageFull,
    TableExists,
    TableNotFound,
    Timeout,
    UcxError,
    WrongPeer,
)
from .rate_limiters import MinSize, Queue, RateLimiter, SampleToInsertRatio
from .selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Selector, Uniform
from .spec import TableSpec
from .table_definition import TableDefinition

# The client side loads UCX; it is imported on first use, so that
# `distore config check` and the control plane's helpers never load it.
_LAZY = {"connect": "client", "Client": "client", "Writer": "client", "Learner": "client",
         "Batch": "client", "LocalCluster": "cluster"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"

__all__ = [
    "connect",
    "Client",
    "Writer",
    "Learner",
    "Batch",
    "LocalCluster",
    "TableSpec",
    "TableDefinition",
    "Selector",
    "Uniform",
    "Prioritized",
    "Fifo",
    "Lifo",
    "MinHeap",
    "MaxHeap",
    "RateLimiter",
    "MinSize",
    "SampleToInsertRatio",
    "Queue",
    "RateLimiterTimeout",
    "DistoreError",
    "LimitExceeded",
    "InvalidRequest",
    "NodeGone",
    "ConfigError",
    "ConnectionFailed",
    "NoData",
    "OutOfBoundsError",
    "RemoteError",
    "SpecMismatch",
    "StagingFull",
    "StorageFull",
    "TableExists",
    "TableNotFound",
    "Timeout",
    "UcxError",
    "WrongPeer",
    "AuthenticationFailed",
    "CheckpointError",
    "Closed",
    "CapacityWarning",
    "metrics",
]

logs.install()  # a useful line format where the application configured none
