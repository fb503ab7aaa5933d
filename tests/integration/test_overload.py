"""Overload: writers far faster than the store.

Queues stay bounded (a writer keeps at most `max_in_flight` batches
unacknowledged; a node answers one insert per connection at a time), every
process's memory stays flat, and writers that a rate limiter holds block,
then fail with a clear error and the count of items not stored, while the
node gives back the slots it held for them.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import psutil
import pytest

import distore_ucx as ds

ITEM = 16 << 10
SPEC = {"obs": ((ITEM,), "uint8")}
MiB = 1 << 20


class RssWatch:
    """Samples the resident memory of some processes every `period` s on a thread."""

    def __init__(self, pids: list[int], period: float = 0.1):
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self._period):
            self.samples.append((time.monotonic() - t0,
                                 {pid: p.memory_info().rss for pid, p in self.procs.items()}))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def growth_after(self, warm_s: float) -> dict[int, int]:
        """Per process: the most its RSS rose above its level at `warm_s`."""
        base = next(s for t, s in self.samples if t >= warm_s)
        later = [s for t, s in self.samples if t >= warm_s]
        return {pid: max(s[pid] for s in later) - base[pid] for pid in self.procs}


@pytest.fixture
def tcp_cluster(monkeypatch):
    # Inserts travel over the control channel whatever UCX_TLS says: one
    # transport is enough here.
    monkeypatch.setenv("UCX_TLS", "tcp")
    with ds.LocalCluster(nodes=2, arena_bytes=96 << 20, env={"UCX_TLS": "tcp"},
                         log_level="WARNING") as cluster:
        yield cluster


def _writers(address: str, n: int, body, stop: threading.Event):
    results: list = []

    def run() -> None:
        with ds.connect(address) as client:
            try:
                results.append(body(client, stop))
            except Exception as exc:  # reported to the test, never swallowed
                results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_memory_stays_flat_while_writers_outrun_the_store(tcp_cluster):
    client = ds.connect(tcp_cluster.address)
    client.create_table("t", capacity=2000, spec=SPEC)  # 32 MiB: evicting all the time
    batch = {"obs": np.zeros((64, ITEM), np.uint8)}
    most_in_flight = []

    def flat_out(c, stop) -> int:
        w = c.writer(max_items=64, max_in_flight=2)
        deepest = 0
        while not stop.is_set():
            w.insert("t", batch)
            deepest = max(deepest, len(w._flight.queue))
        w.close()
        most_in_flight.append(deepest)
        return w.inserted

    stop = threading.Event()
    with RssWatch(tcp_cluster.pids() + [os.getpid()]) as watch:
        threads, results = _writers(tcp_cluster.address, 3, flat_out, stop)
        time.sleep(8.0)  # a fixed stretch of overload, measured by the watch
        stop.set()
        for t in threads:
            t.join(60)
    assert all(isinstance(r, int) for r in results), results
    info = client.table_info("t")
    assert sum(results) == info["inserts"] > 3 * info["capacity"]  # acknowledged = counted
    assert info["size"] == info["capacity"]
    assert max(most_in_flight) <= 2
    growth = watch.growth_after(3.0)
    names = {p: "control plane" if p == tcp_cluster.control.pid else
             ("test process" if p == os.getpid() else f"node {p}") for p in growth}
    for pid, grew in growth.items():
        assert grew < 48 * MiB, f"{names[pid]} grew {grew / MiB:.0f} MiB under overload"
    # And the store still serves correct samples afterwards.
    learner = client.learner("t", batch_size=32)
    assert learner.sample().data["obs"].shape == (32, ITEM)
    learner.close()
    client.close()


def test_writers_held_by_a_rate_limiter_block_then_fail_and_free_their_slots(tcp_cluster):
    client = ds.connect(tcp_cluster.address)
    # Nobody samples: after 200 inserts every insert is held.
    client.create_table("t", capacity=10_000, spec=SPEC, rate_limiter=ds.SampleToInsertRatio(
        samples_per_insert=1.0, min_size_to_sample=1, error_buffer=200))
    batch = {"obs": np.ones((50, ITEM), np.uint8)}

    def until_held(c, stop):
        w = c.writer(max_items=50, max_in_flight=2, timeout=1.5)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30:
                w.insert("t", batch)
            return "never held"
        except ds.RateLimiterTimeout as exc:
            return exc, time.monotonic() - t0

    with RssWatch(tcp_cluster.pids()) as watch:
        threads, results = _writers(tcp_cluster.address, 3, until_held, threading.Event())
        for t in threads:
            t.join(60)
    for r in results:
        assert isinstance(r, tuple), r
        exc, waited = r
        assert 1.5 <= waited < 20
        assert "rate limiter held an insert of 50 items" in str(exc)
        assert "items not stored]" in str(exc)
    info = client.table_info("t")
    assert info["size"] <= 250
    # Held batches gave their slots back: the nodes hold exactly the stored
    # items (node memory figures come with heartbeats, twice a second).
    stored = info["size"] * info["slot_size"]
    deadline = time.monotonic() + 5
    while (used := sum(n["used_bytes"] for n in client.status()["nodes"])) != stored:
        assert time.monotonic() < deadline, f"nodes hold {used} bytes for {stored} stored"
        time.sleep(0.05)
    for pid, grew in watch.growth_after(0.5).items():
        assert grew < 48 * MiB, f"process {pid} grew {grew / MiB:.0f} MiB while writers waited"
    client.close()
