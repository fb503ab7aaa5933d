"""The prefetch thread: order, depth, errors, shutdown."""

from __future__ import annotations

import gc
import threading

import pytest

from distore_ucx.client.learner.prefetch import Prefetcher, PrefetcherClosed, Stopped


class Counter:
    """A producer that counts, records how far ahead of the consumer it got,
    and can be told to fail at one item or to block until released."""

    def __init__(self, fail_at=None, block_at=None):
        self.n = 0
        self.taken = 0
        self.max_ahead = 0
        self.fail_at = fail_at
        self.block_at = block_at
        self.blocked = threading.Event()
        self.lock = threading.Lock()

    def produce(self, stopping):
        with self.lock:
            i = self.n
            self.n += 1
            self.max_ahead = max(self.max_ahead, self.n - self.taken)
        if i == self.fail_at:
            raise ValueError(f"item {i} is bad")
        if i == self.block_at:
            self.blocked.set()
            while not stopping():  # a producer waiting on data, polling its stop flag
                threading.Event().wait(0.01)
            raise Stopped()
        return i


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("test-prefetch")]


def test_items_come_in_order_and_never_more_than_depth_ahead():
    c = Counter()
    with Prefetcher(c.produce, depth=2, name="test-prefetch") as p:
        got = []
        for _ in range(50):
            got.append(p.next(timeout=10))
            with c.lock:
                c.taken += 1
        assert got == list(range(50))
        # The consumer holds one item; at most `depth` more are in flight.
        assert c.max_ahead <= 2 + 1
    assert not prefetch_threads()


def test_error_in_thread_is_raised_after_the_items_before_it():
    c = Counter(fail_at=3)
    p = Prefetcher(c.produce, depth=2, name="test-prefetch")
    assert [p.next(timeout=10) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="item 3 is bad"):
        p.next(timeout=10)
    with pytest.raises(ValueError):  # stays failed
        p.next(timeout=10)
    p.close()
    assert not prefetch_threads()


def test_close_stops_a_producer_that_is_waiting():
    c = Counter(block_at=0)
    p = Prefetcher(c.produce, depth=2, name="test-prefetch")
    assert c.blocked.wait(10)
    with pytest.raises(TimeoutError):
        p.next(timeout=0.05)
    p.close()
    assert not p.alive
    with pytest.raises(PrefetcherClosed):
        p.next(timeout=1)


def test_close_stops_a_thread_waiting_for_the_consumer():
    c = Counter()
    p = Prefetcher(c.produce, depth=3, name="test-prefetch")
    assert p.next(timeout=10) == 0
    p.close()  # the thread was waiting for a credit
    assert not p.alive and not prefetch_threads()


def test_garbage_collected_owner_stops_the_thread():
    class Owner:
        def __init__(self):
            self.prefetcher = Prefetcher(self.produce, depth=2, name="test-prefetch")
            self.me = self  # a reference cycle, as a learner has with its client

        def produce(self, stopping):
            return 1

    owner = Owner()
    assert owner.prefetcher.next(timeout=10) == 1
    thread = owner.prefetcher._thread
    del owner
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Prefetcher(lambda stopping: 0, depth=0)
