"""Closing what is still open when the interpreter exits, in order.

A program that never calls close() would otherwise leave a runtime's
progress thread running into interpreter teardown (ucxx then warns, and
destructors may run on that thread). At exit, first the callbacks of
`close_at_exit` run, newest first (learners' remote keys and rings, the
writers and replay buffers of `ClosedAtExit`), then every UCX runtime not
closed yet is closed, newest first, before modules are torn down.

runtime.py registers `close_all` with `atexit` when it is imported, right
after ucxx, so that it runs before ucxx's own exit handlers (they run in
reverse order of registration).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref

log = logging.getLogger(__name__)

# Runtimes not closed yet, with their creation order (`track`).
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ORDER = itertools.count()
_AT_EXIT: list = []  # callables run before the runtimes close (owners release first)


def track(runtime) -> None:
    """Close `runtime` (a UcxRuntime) at exit unless it was closed or
    collected before."""
    _LIVE[runtime] = next(_ORDER)


def close_at_exit(callback) -> None:
    """Run `callback()` at interpreter exit before the UCX runtimes close, so
    that objects holding UCX resources (learners' remote keys and rings)
    release them first. Last registered runs first."""
    _AT_EXIT.append(callback)


class ClosedAtExit:
    """Objects not closed yet (writers, replay buffers), each closed with its
    `_close_unattended(why)` at interpreter exit, before the UCX runtimes
    close (close_at_exit, registered with the first object added: after its
    client's runtime, and the last registered runs first). Held weakly: an
    object dropped earlier closes itself in its __del__."""

    def __init__(self):
        self._open: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, obj) -> None:
        """Close `obj` at exit unless it was closed or collected before."""
        with self._lock:
            if not self._registered:
                close_at_exit(self._close_all)
                self._registered = True
            self._open.add(obj)

    def _close_all(self) -> None:
        with self._lock:
            objs = list(self._open)
        for obj in objs:
            obj._close_unattended("still open at interpreter exit")


def close_all() -> None:
    """The exit handler: the callbacks, then the runtimes, newest first."""
    for callback in reversed(_AT_EXIT):
        try:
            callback()
        except Exception as exc:  # exiting anyway: say what, close the rest
            log.debug("at exit: %s", exc)
    for runtime in sorted(_LIVE.keys(), key=lambda r: _LIVE.get(r, 0), reverse=True):
        try:
            runtime.close()
        except Exception as exc:
            log.debug("at exit: closing a UCX runtime: %s", exc)
