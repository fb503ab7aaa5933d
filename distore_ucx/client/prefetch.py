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
                while state.credits == 0 and not state.stop:
                    state.cond.wait()
                if state.stop:
                    return
                state.credits -= 1
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
            state.cond.notify_all()


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
