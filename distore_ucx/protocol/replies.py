"""Replies: a success reply's map (`reply`)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "reply",
]


def reply(mid: int, **fields: Any) -> dict[str, Any]:
    """A success reply to request `mid`."""
    msg: dict[str, Any] = {"id": mid, "ok": True}
    for k, v in fields.items():
        msg[k] = v.tobytes() if isinstance(v, np.ndarray) else v
    return msg
