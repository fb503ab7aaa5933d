"""The greeting of every connection: a server's hello, and the answer to its
challenge (transport/auth.py runs the handshake)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .error_codes import ProtocolError
from .framing import VERSION

__all__ = [
    "AUTH_CONTEXT",
    "auth_mac",
    "check_hello",
    "hello",
    "hello_role",
]

AUTH_CONTEXT = b"distore-ucx auth v1"


def auth_mac(token: bytes, nonce: bytes) -> bytes:
    """The answer to a server's challenge: HMAC-SHA256(token, context + nonce)."""
    return hmac.new(token, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def hello(nonce: bytes | None, role: str | None = None) -> dict[str, Any]:
    """The first frame a server sends: protocol version, what it is ("control
    plane", "storage node": a client at the wrong one says so) and, when it
    wants a token, the challenge nonce."""
    h: dict[str, Any] = {"v": VERSION, "nonce": nonce}
    if role is not None:
        h["role"] = role
    return {"id": 0, "hello": h}


def hello_role(msg: dict[str, Any]) -> str | None:
    """What a valid hello says its server is (None: it does not say)."""
    role = msg["hello"].get("role")
    return role if isinstance(role, str) else None


def check_hello(msg: dict[str, Any]) -> bytes | None:
    """Validate a server's hello; returns its nonce (None: no token needed)."""
    if not isinstance(msg, dict):
        raise ProtocolError("the connection closed before the server's greeting")
    h = msg.get("hello")
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise ProtocolError(f"unexpected greeting {msg!r}: not a distore-ucx v{VERSION} server")
    nonce = h.get("nonce")
    if nonce is not None and (not isinstance(nonce, bytes) or not 16 <= len(nonce) <= 64):
        raise ProtocolError("malformed challenge in the server's greeting")
    return nonce
