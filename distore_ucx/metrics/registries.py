"""Registries and collectors: what a scrape of each process reads.

A control plane or storage node has a registry of its own, with a
:class:`LoopCollector` that snapshots it on its event loop; the server that
serves it owns it (exposition.serve_process) and the role closes that server
when it stops. The learners and writers of a process share one registry,
:data:`PROCESS`'s, served or pushed by the user (exposition.serve, push).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .families import client_families

# The package's logger, so that its lines name distore_ucx.metrics as they always have.
log = logging.getLogger(__package__)

SNAPSHOT_TIMEOUT = 5.0  # s a scrape waits for a busy event loop


class ProcessRegistry:
    """This process's learners and writers, held weakly, and the registry
    that exports their stats, made on first use.

    It holds no thread, socket or strong reference, so nothing of it waits
    for exit to be closed: a learner or writer leaves it when it is
    collected, and the servers that serve it are closed by whoever started
    them (:class:`~.exposition.MetricsServer` is a context manager).
    """

    def __init__(self) -> None:
        self._clients: weakref.WeakValueDictionary[tuple[str, str], Any] = (
            weakref.WeakValueDictionary())
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._registry = None

    def track(self, kind: str, obj: Any) -> str:
        """Register a learner or writer (held weakly) so that the registry
        exports its stats; returns its label value (unique here)."""
        name = str(next(self._ids))
        with self._lock:
            self._clients[(kind, name)] = obj
        return name

    def tracked(self, kind: str) -> list[tuple[str, Any]]:
        """(label value, object) of every live learner or writer (`kind`)."""
        with self._lock:
            items = list(self._clients.items())
        return [(name, obj) for (k, name), obj in items if k == kind]

    def registry(self):
        """The CollectorRegistry of these learners and writers (with process
        CPU and memory), made on first use."""
        with self._lock:
            if self._registry is None:
                self._registry = new_registry(ClientCollector(self))
            return self._registry


class LoopCollector:
    """A prometheus_client collector that takes `snapshot(obj)` on `loop`
    (where `obj`'s state lives) and turns it into families off the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, obj: Any,
                 snapshot: Callable[[Any], dict], families: Callable[[dict], list]):
        self._loop = loop
        self._obj = obj
        self._snapshot = snapshot
        self._families = families

    def describe(self) -> list:
        """No families up front: prometheus_client then skips its clash check."""
        return []  # names vary with tables; never checked for clashes at register time

    def collect(self):
        """Families of a snapshot taken on the event loop (none if it is stuck)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def take():
            try:
                future.set_result(self._snapshot(self._obj))
            except Exception as exc:  # noqa: BLE001 - reported by the scrape, not lost
                future.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(take)
            snap = future.result(SNAPSHOT_TIMEOUT)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            log.warning("metrics scrape: no snapshot from the event loop (%s)",
                        exc or f"busy for more than {SNAPSHOT_TIMEOUT:g} s")
            return
        yield from self._families(snap)


class ClientCollector:
    """The learners and writers of a process (see track)."""

    def __init__(self, process: ProcessRegistry | None = None):
        self._process = process if process is not None else PROCESS

    def describe(self) -> list:
        """No families up front: prometheus_client then skips its clash check."""
        return []

    def collect(self):
        """Families of every live learner and writer."""
        yield from client_families(self._process.tracked("learner"),
                                   self._process.tracked("writer"))


def new_registry(collector=None):
    """A CollectorRegistry with process CPU/memory metrics and `collector`."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    if collector is not None:
        registry.register(collector)
    return registry


# The one registry of this process's learners and writers.
PROCESS = ProcessRegistry()


def track(kind: str, obj: Any) -> str:
    """Register a learner or writer (held weakly) so that this process's
    registry exports its stats; returns its label value (unique here)."""
    return PROCESS.track(kind, obj)


def registry():
    """This process's registry of learner and writer metrics (with process CPU
    and memory): serve it, push it, or read it with generate_latest.

    Returns:
        A prometheus_client ``CollectorRegistry``.

    >>> from prometheus_client import generate_latest
    >>> text = generate_latest(ds.metrics.registry())
    """
    return PROCESS.registry()


def collector() -> ClientCollector:
    """A collector of this process's learners and writers, to register in a
    registry of your own (e.g. prometheus_client.REGISTRY.register(...))."""
    return ClientCollector()
