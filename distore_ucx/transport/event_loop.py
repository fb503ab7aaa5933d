"""The event loop a server (control plane, storage node) runs on: uvloop
where it is installed and not switched off, else asyncio's own.

Under fan-in (hundreds of actors each inserting a few items ten times a
second) most of a node's CPU is per request, not per byte: waking, reading
and writing sockets, scheduling callbacks. uvloop does the loop and the
socket transports in C (libuv) behind asyncio's interface, so the servers'
code is the same on both; docs/performance.md gives what it saves.
`DISTORE_UVLOOP=0` (config/environment.py) runs asyncio's loop instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["loop_name", "run"]


def _uvloop() -> ModuleType | None:
    """The uvloop module, or None where it is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run(main: Coroutine[Any, Any, T], use_uvloop: bool = True) -> T:
    """Run a server's main coroutine to completion on a new event loop, as
    asyncio.run does: on uvloop when `use_uvloop` and it is installed (a
    dependency of the package, but not on every platform), else on
    asyncio's own loop."""
    module = _uvloop() if use_uvloop else None
    if module is None:
        return asyncio.run(main)
    return module.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Which event loop `loop` (by default the running one) is, for the
    server's start-up log: "uvloop 0.23.0" or "asyncio"."""
    loop = loop or asyncio.get_running_loop()
    module = type(loop).__module__.split(".")[0]
    if module == "uvloop":
        uvloop = _uvloop()
        return f"uvloop {getattr(uvloop, '__version__', '?')}"
    return "asyncio"
