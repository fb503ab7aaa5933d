"""Transport: ucxx owns UCX objects; `_native` does the batched data path.

`UcxRuntime` is imported on first use, so that the control channel
(`transport.rpc`, `transport.auth`) can be used without loading UCX.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UcxRuntime"]


def __getattr__(name: str) -> Any:
    if name == "UcxRuntime":
        from .runtime import UcxRuntime

        return UcxRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
