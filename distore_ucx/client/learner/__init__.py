"""The learner: `Learner` (learner.py) and its parts, one concept each: its
arguments' checks (arguments.py), the sample stream (sample_stream.py), the
storage nodes it reads (peers.py), the gather (gather.py), the destination
ring (ring.py) on a device (device.py) and what each of its slots holds
(reader.py), read-ahead (prefetch.py) and its header recheck (recheck.py),
importance weights (weights.py) and the `Batch` it returns (batch.py; a
batch of slices: slices.py)."""

from .batch import Batch
from .learner import Learner

__all__ = ["Batch", "Learner"]
