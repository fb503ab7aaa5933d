"""Client side: `connect`, writers (actors) and learners."""

from .client import Client, connect
from .learner import Batch, Learner
from .writer import Writer

__all__ = ["Client", "connect", "Writer", "Learner", "Batch"]
