"""Helpers shared by the test files (importable as `helpers`: pyproject's
pytest `pythonpath` puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def keyed_items(keys_from: int, n: int, width: int, mult: int = 1) -> dict:
    """n items {"obs": width uint8 bytes, "key": uint64} whose bytes follow
    from their key, so that a wrong or torn item is seen (`check_keyed`)."""
    k = np.arange(keys_from, keys_from + n, dtype=np.uint64)
    return {"obs": (k[:, None] * mult + np.arange(width)).astype(np.uint8), "key": k}


def keyed_spec(width: int) -> dict:
    """The table spec of `keyed_items` of that width."""
    return {"obs": ((width,), "uint8"), "key": ((), "uint64")}


def assert_dense(array: Any) -> None:
    """A batch field is one C-contiguous [batch, *shape] array (issue #34):
    numpy's np.ascontiguousarray hands it back without a copy; a torch
    tensor is_contiguous(); a CuPy array is C-contiguous."""
    if hasattr(array, "is_contiguous"):  # torch
        assert array.is_contiguous(), array.stride()
        return
    assert array.flags.c_contiguous, array.strides
    if isinstance(array, np.ndarray):
        same = np.ascontiguousarray(array)
        assert same.ctypes.data == array.ctypes.data and np.shares_memory(same, array)


def check_keyed(batch: Any, width: int, mult: int = 1) -> None:
    """Assert that every item of a sampled batch holds its key's bytes, and
    that every field is dense (`assert_dense`)."""
    for field in batch.data.values():
        assert_dense(field)
    expect = (batch.data["key"][:, None] * mult + np.arange(width)).astype(np.uint8)
    assert np.array_equal(batch.data["obs"], expect)


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             state: Callable[[], Any] | None = None, interval: float = 0.02) -> Any:
    """Poll `condition` until it returns something true (returned), or fail
    after `timeout` s saying what was awaited and, with `state`, what things
    looked like last. Timeouts are generous: the test machine may be 2 busy
    cores."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout} s waiting for {what}"
            + (f"; last seen: {state()}" if state else ""))
        time.sleep(interval)


async def turns_until(condition: Callable[[], Any], what: str, turns: int = 100) -> None:
    """Let the running event loop take up to `turns` turns until `condition`
    holds (for tests of asyncio code with fakes, where nothing waits on time);
    fail naming `what` otherwise."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never happened in {turns} turns of the event loop")


def sm_store():
    """One LocalCluster over shared memory (one node, 64 MiB, loopback only),
    for a module's tests, as a generator fixture body: `yield from sm_store()`.
    A node late with its heartbeat on a busy 2-core machine is slow, not gone."""
    import pytest

    import distore_ucx as ds

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", "sm")
        mp.setenv("UCX_NET_DEVICES", "lo")
        with ds.LocalCluster(nodes=1, arena_bytes=64 << 20, log_level="WARNING",
                             heartbeat_timeout=30.0, env={"UCX_TLS": "sm"}) as cluster:
            yield cluster


def closing_builders(builders):
    """A generator fixture body (`yield from closing_builders(...)`) for the
    upstream TorchRL tests: yields `builders` (their buffer constructors) and
    closes every buffer they opened (`builders.open`) after the test."""
    yield builders
    for rb in builders.open:
        rb.close()
