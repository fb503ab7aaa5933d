"""Keeps up to `depth` items in flight on a background thread, in order.

The producer runs on one thread only, so whatever it drives (a learner's
control connection and UCX gather, which are not re-entrant) is never used
from two threads. "In flight" counts items being produced and items
produced but not yet taken; the item the consumer holds is not counted
and is not touched until the consumer takes the next one: a ring of
`depth + 1` buffers is enough.

Shutdown: `close()` (or the owner being garbage collected) stops the
thread after the item it is producing; the producer is asked to give up
early through the `stopping` callable it receives. The thread holds its
producer weakly, so an abandoned owner can be collected. An exception in
the producer reaches the consumer on the next `next()`, after the items
produced before it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 60.0


class Stopped(Exception):
    """Raised by a producer that gave up because the prefetcher is closing."""


class PrefetcherClosed(RuntimeError):
    """next() on a prefetcher that was closed."""


class _State:
    """What the thread and the consumer share (never the producer's owner)."""

    def __init__(self, depth: int):
        self.cond = threading.Condition()
        self.items: deque = deque()
        self.credits = depth
        self.error: BaseException | None = None
        self.jobs: deque[_Job] = deque()  # calls to run on the thread (Prefetcher.call)
        self.stop = False
        self.finished = False

    def stopping(self) -> bool:
        return self.stop

    def request_stop(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


def _work(produce_ref: Callable[[], Any], state: _State) -> None:
    try:
        while True:
            with state.cond:
                while state.credits == 0 and not state.stop and not state.jobs:
                    state.cond.wait()
                if state.stop:
                    return
                job = state.jobs.popleft() if state.jobs else None
                if job is None:
                    state.credits -= 1
            if job is not None:
                job.run()
                continue
            produce = produce_ref()
            if produce is None:  # the owner was collected
                return
            try:
                item = produce(state.stopping)
            except Stopped:
                return
            except BaseException as exc:  # handed to the consumer
                with state.cond:
                    state.error = exc
                return
            finally:
                del produce  # hold the owner only while producing
            with state.cond:
                state.items.append(item)
                state.cond.notify_all()
    finally:
        with state.cond:
            state.finished = True
            for job in state.jobs:  # nobody will run them now
                job.fail(PrefetcherClosed("the prefetcher was closed"))
            state.jobs.clear()
            state.cond.notify_all()


class _Job:
    """A call run on the prefetch thread for the consumer (Prefetcher.call)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller
            self.error = exc
        self.fn = None
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


class Prefetcher:
    """Calls `produce(stopping)` on a background thread, `depth` items ahead.

    >>> p = Prefetcher(lambda stopping: compute(), depth=2)
    >>> first = p.next(timeout=10)
    >>> p.close()
    """

    def __init__(self, produce: Callable[[Callable[[], bool]], Any], depth: int,
                 name: str = "distore-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.depth = depth
        self._state = state = _State(depth)
        self._holding = False  # the consumer holds an item (its buffer is not free)
        try:
            ref = weakref.WeakMethod(produce)
        except TypeError:  # a plain function: nothing to collect
            ref = lambda: produce  # noqa: E731
        self._thread = threading.Thread(target=_work, args=(ref, state), name=name, daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, state, self._thread)
        self._thread.start()

    def next(self, timeout: float | None = None) -> Any:
        """The next item, in production order; raises the producer's exception
        once the items before it were taken, TimeoutError if none comes within
        `timeout` s. Taking an item frees the previous one's buffer."""
        state = self._state
        deadline = None if timeout is None else time.monotonic() + timeout
        with state.cond:
            if self._holding:
                self._holding = False
                state.credits += 1
                state.cond.notify_all()
            while not state.items:
                if state.error is not None:
                    raise state.error
                if state.finished or state.stop:
                    raise PrefetcherClosed("the prefetcher was closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no item within {timeout} s")
                state.cond.wait(remaining)
            self._holding = True
            return state.items.popleft()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn()` on the producer's thread, before the next item it
        starts producing (after the one it is producing now), and return its
        result or raise its exception: for work on what the producer owns
        (a learner repairing a batch it handed over)."""
        state = self._state
        job = _Job(fn)
        with state.cond:
            if state.error is not None:  # what ended the thread, not that it ended
                raise state.error
            if state.finished or state.stop:
                raise PrefetcherClosed("the prefetcher was closed")
            state.jobs.append(job)
            state.cond.notify_all()
        if not job.done.wait(timeout):
            raise TimeoutError(f"the prefetch thread did not run the call within {timeout} s")
        if isinstance(job.error, PrefetcherClosed) and state.error is not None:
            raise state.error  # the producer failed while the call waited: say why
        if job.error is not None:
            raise job.error
        return job.result

    @property
    def alive(self) -> bool:
        """Whether the background thread still runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (after the item it is producing) and drop queued items."""
        self._finalizer()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(state: _State, thread: threading.Thread) -> None:
    state.request_stop()
    if thread is not threading.current_thread():  # collected on its own thread: cannot join
        thread.join(JOIN_TIMEOUT)
        if thread.is_alive():
            log.warning("prefetch thread still busy after %.0f s; leaving it to finish",
                        JOIN_TIMEOUT)
    with state.cond:
        state.items.clear()
