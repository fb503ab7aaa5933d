"""The error vocabulary: `ProtocolError` for malformed input, and the codes
an error reply carries, each raised as its exception on the other side
(and those of the inserts an items_added of several refused, `batch_errors`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import errors

__all__ = [
    "ERRORS",
    "ProtocolError",
    "batch_errors",
    "error_code",
    "error_reply",
    "remote_error",
]


class ProtocolError(ValueError):
    """A frame or message is malformed; the connection that sent it is closed."""


# The error vocabulary: the code an error reply carries <-> the exception it
# is raised as on the other side. A class not listed travels as its nearest
# listed base class; anything else (a bug in the peer) as "internal", raised
# as RemoteError. Codes are part of the protocol: add, never rename.
ERRORS: dict[str, type[Exception]] = {
    "distore": errors.DistoreError,  # raised as such: no more precise class fits
    "config": errors.ConfigError,
    "invalid_request": errors.InvalidRequest,
    "table_not_found": errors.TableNotFound,
    "table_exists": errors.TableExists,
    "spec_mismatch": errors.SpecMismatch,
    "storage_full": errors.StorageFull,
    "staging_full": errors.StagingFull,
    "limit_exceeded": errors.LimitExceeded,
    "timeout": errors.Timeout,
    "rate_limiter_timeout": errors.RateLimiterTimeout,
    "no_data": errors.NoData,
    "connection_failed": errors.ConnectionFailed,
    "authentication_failed": errors.AuthenticationFailed,
    "node_gone": errors.NodeGone,
    "checkpoint": errors.CheckpointError,
    "closed": errors.Closed,
    "table_core": errors.TableCoreError,
    "ucx": errors.UcxError,
    "unreachable": errors.UnreachableError,
    "transfer_timeout": errors.TransferTimeout,
    "internal": errors.RemoteError,
}
_CODES: dict[type, str] = {cls: code for code, cls in ERRORS.items()}
_CODES[ProtocolError] = "invalid_request"  # a malformed message is an invalid request


def error_code(exc: BaseException) -> str:
    """The code `exc` travels as: its class's, or its nearest listed base's."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return "internal"


def error_reply(mid: int, exc: BaseException) -> dict[str, Any]:
    """An error reply carrying the exception's code and message."""
    return {"id": mid, "ok": False, "error": error_code(exc), "message": str(exc)}


def remote_error(msg: dict[str, Any], peer: str) -> Exception:
    """The exception an error reply stands for, its message naming the peer.

    An unknown code (a newer peer) becomes RemoteError with that `kind`.
    """
    code = msg.get("error")
    text = f"{msg.get('message', 'unknown error')} (from {peer})"
    cls = ERRORS.get(code) if isinstance(code, str) else None
    if cls is None or cls is errors.RemoteError:
        return errors.RemoteError(text, str(code))
    return cls(text)


def batch_errors(reply: Mapping[str, Any], peer: str) -> dict[int, Exception]:
    """The inserts an items_added reply of several refused, by their index
    in the request, each as the exception its error code stands for (as an
    error reply's, naming `peer`); ProtocolError if an entry is malformed.

    >>> batch_errors({"evicted": 0, "errors": [[1, "node_gone", "gone"]]}, "cp")
    {1: NodeGone('gone (from cp)')}
    """
    out: dict[int, Exception] = {}
    for entry in reply.get("errors") or ():
        if (not isinstance(entry, list) or len(entry) != 3 or type(entry[0]) is not int
                or not isinstance(entry[1], str) or not isinstance(entry[2], str)):
            raise ProtocolError(f"reply to items_added: an entry of 'errors' is not "
                                f"[index, code, message] (from {peer})")
        out[entry[0]] = remote_error({"error": entry[1], "message": entry[2]}, peer)
    return out
