"""One exception hierarchy for distore-ucx.

Every error a user can hit derives from :class:`DistoreError` and says what
happened, to what (table, node, key) and what to do. Native (UCX) failures
are mapped here, from one table keyed by status, never by message text.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to install an optional part (a pyproject extra), as every error
    and log line says it: from an index, or from a source checkout, which is
    how the README installs the package."""
    return f"pip install 'distore-ucx[{extra}]' (from a source checkout: pip install '.[{extra}]')"


class DistoreError(Exception):
    """Base class of every distore-ucx error."""


class ConfigError(DistoreError, ValueError):
    """A configuration value or argument is invalid."""


class ConnectionFailed(DistoreError, ConnectionError):
    """A peer (control plane, storage node) could not be reached or went away."""


class AuthenticationFailed(ConnectionFailed):
    """The peer refused our token, or wants one and we have none."""


class WrongPeer(ConnectionFailed):
    """The address answers, but as another kind of server than expected (an
    HTTP server such as a /metrics port, a storage node where the control
    plane was meant): the address is wrong, waiting will not help."""


class Timeout(DistoreError, TimeoutError):
    """A request did not complete in time."""


class RemoteError(DistoreError):
    """The peer failed on a request in a way it has no error code for (a bug
    there: its log has the traceback); `kind` is the code it sent."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


class InvalidRequest(DistoreError, ValueError):
    """A peer refused a request as malformed or not meant for it (an unknown
    operation, a field out of bounds, a message from the wrong connection):
    a bug or a version mismatch between the two sides, not configuration."""


class NodeGone(ConnectionFailed):
    """A storage node left the store (dropped or shut down) while a request
    that concerned it waited; the request had no effect: send it again."""


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


class StagingFull(DistoreError):
    """A storage node's staging area (where sampled cold items of its disk
    tier are read to) had no room for a sample's cold items: the message says
    how full it is and what to do (raise the node's --disk-staging, sample
    smaller batches, or keep fewer batches of cold items unreleased)."""


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


class TableCoreError(DistoreError, ValueError):
    """The native table core refused a call (an item id outside the table, an
    unknown selector, a capacity of 0): a bug in the caller, not a UCX failure."""


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


# Status name -> exception class. Keyed by the names the extension gives
# (`_native.status_name`), so that no status number is copied here.
_STATUS_CLASSES: dict[str, type[UcxError]] = {
    "UCS_ERR_IO_ERROR": UnreachableError,
    "UCS_ERR_INVALID_PARAM": InvalidArgument,
    "UCS_ERR_UNREACHABLE": UnreachableError,
    "UCS_ERR_INVALID_ADDR": InvalidArgument,
    "UCS_ERR_NOT_IMPLEMENTED": Unsupported,
    "UCS_ERR_UNSUPPORTED": Unsupported,
    "UCS_ERR_CONNECTION_RESET": UnreachableError,
    "UCS_ERR_NOT_CONNECTED": UnreachableError,
    "UCS_ERR_ENDPOINT_TIMEOUT": TransferTimeout,
    "UCS_ERR_CANCELED": TransferTimeout,  # a read we cancelled at its deadline
    "DISTORE_OUT_OF_BOUNDS": OutOfBoundsError,  # range outside a registered region
    "DISTORE_BAD_ARGUMENT": InvalidArgument,  # malformed batch arrays
}


def from_native(status: int, status_name: str, message: str, peer: str) -> UcxError:
    """Build the exception for a native failure (called by the extension)."""
    cls = _STATUS_CLASSES.get(status_name, UcxError)
    return cls(f"{message} [{status_name}]", status=status, status_name=status_name, peer=peer)
