"""The errors of TorchRL buffers that TorchRL code catches as RuntimeError.

They never cross the wire, so they live here rather than in distore_ucx.errors'
wire vocabulary; each is also the distore error it is.
"""

from __future__ import annotations

from ..errors import ConfigError, NoData, SpecMismatch


class EmptyTable(NoData, RuntimeError):
    """sample() found too few items and was not asked to wait: TorchRL's
    message and RuntimeError, and a ds.NoData."""


class BatchSizeNotSet(ConfigError, RuntimeError):
    """sample() or iteration without a batch size: a RuntimeError, as TorchRL
    raises, and a ds.ConfigError."""


class EndSignalShape(SpecMismatch, RuntimeError):
    """A slice sampler's end key holds more than one value a frame: TorchRL's
    message and RuntimeError ("Expected the end-of-trajectory signal to be
    1-dimensional"), and a ds.SpecMismatch."""
