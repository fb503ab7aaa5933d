"""One exception hierarchy for distore-ucx.

Every error a user can hit derives from :class:`DistoreError` and says what
happened, to what (table, node, key) and what to do. Native (UCX) failures
are mapped here, from one table keyed by status, never by message text.
"""

from __future__ import annotations


class DistoreError(Exception):
    """Base class of every distore-ucx error."""


class ConfigError(DistoreError, ValueError):
    """A configuration value or argument is invalid."""


class ConnectionFailed(DistoreError, ConnectionError):
    """A peer (control plane, storage node) could not be reached or went away."""


class AuthenticationFailed(ConnectionFailed):
    """The peer refused our token, or wants one and we have none."""


class Timeout(DistoreError, TimeoutError):
    """A request did not complete in time."""


class RemoteError(DistoreError):
    """The peer answered a request with an error; `kind` names the peer's class."""

    def __init__(self, message: str, kind: str = "RemoteError"):
        super().__init__(message)
        self.kind = kind


class TableNotFound(DistoreError, KeyError):
    """The named table does not exist on the control plane."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TableExists(DistoreError):
    """A table of that name exists already with a different definition."""


class SpecMismatch(DistoreError, ValueError):
    """Data given to insert does not match the table's spec."""


class StorageFull(DistoreError):
    """No storage node has room for the insert; the message says which tables
    hold the space: add nodes, give them larger arenas, or shrink those tables."""


class Closed(DistoreError):
    """A client, writer or learner was used after close(): make a new one."""


class CapacityWarning(UserWarning):
    """A table's capacity cannot fit in the storage nodes registered now."""


class LimitExceeded(DistoreError):
    """A request went over a per-connection limit of the server (outstanding
    leases, sample size, writer ids); the message names the setting."""


class RateLimiterTimeout(Timeout):
    """A rate limiter kept a call blocked past its timeout; the message has the counts."""


class NoData(RateLimiterTimeout):
    """The table had too few items to sample before the timeout."""


class CheckpointError(DistoreError):
    """A checkpoint could not be written, or a file to restore from is unreadable,
    corrupt or of another format version; the message names the file."""


class UcxError(DistoreError):
    """A UCX operation failed. `status` is the ucs_status_t, `peer` the node."""

    def __init__(self, message: str, status: int = 0, status_name: str = "", peer: str = ""):
        super().__init__(message)
        self.status = status
        self.status_name = status_name
        self.peer = peer


class UnreachableError(UcxError, ConnectionFailed):
    """UCX could not reach the peer, or the connection to it broke."""


class TransferTimeout(UcxError, Timeout):
    """A one-sided read did not complete in time."""


class OutOfBoundsError(UcxError, IndexError):
    """An address range lies outside a registered region."""


class InvalidArgument(UcxError, ValueError):
    """A native call got a malformed argument (bad remote key, array shapes)."""


class Unsupported(UcxError):
    """The loaded UCX cannot do what was asked (e.g. no remote access)."""


# ucs_status_t value -> exception class. The values are UCX's stable ABI.
_STATUS_CLASSES: dict[int, type[UcxError]] = {
    -3: UnreachableError,  # UCS_ERR_IO_ERROR
    -5: InvalidArgument,  # UCS_ERR_INVALID_PARAM
    -6: UnreachableError,  # UCS_ERR_UNREACHABLE
    -7: InvalidArgument,  # UCS_ERR_INVALID_ADDR
    -8: Unsupported,  # UCS_ERR_NOT_IMPLEMENTED
    -20: UnreachableError,  # UCS_ERR_ENDPOINT_TIMEOUT (legacy value)
    -22: Unsupported,  # UCS_ERR_UNSUPPORTED
    -25: UnreachableError,  # UCS_ERR_CONNECTION_RESET
    -26: UnreachableError,  # UCS_ERR_NOT_CONNECTED
    -80: TransferTimeout,  # UCS_ERR_ENDPOINT_TIMEOUT
    -16: TransferTimeout,  # UCS_ERR_CANCELED: a read we cancelled at its deadline
    -1000: OutOfBoundsError,  # distore: range outside a registered region
    -1001: InvalidArgument,  # distore: malformed batch arrays
}


def from_native(status: int, status_name: str, message: str, peer: str) -> UcxError:
    """Build the exception for a native failure (called by the extension)."""
    cls = _STATUS_CLASSES.get(status, UcxError)
    return cls(f"{message} [{status_name}]", status=status, status_name=status_name, peer=peer)


def raise_for_statuses(statuses, peers: list[str]) -> None:
    """Raise the exception of the first failed status in a per-item array.

    `peers[i]` names the node that item i was read from.
    """
    import numpy as np

    bad = np.flatnonzero(statuses)
    if bad.size == 0:
        return
    i = int(bad[0])
    status = int(statuses[i])
    from . import _native

    name = _native.status_name(status)
    raise from_native(
        status,
        name,
        f"{bad.size} of {len(statuses)} reads failed; first: item {i} from {peers[i]}",
        peers[i],
    )
