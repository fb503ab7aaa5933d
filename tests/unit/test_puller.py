"""The node's pull thread and the reader worker's event fd (storage/puller.py):
while pulls that progress the reader worker are under way, its events get
no tick of their own; the fd is watched again once they are done. Helper
threads for same-host copies only where the node has cores to spare."""

from __future__ import annotations

import asyncio
import os

import pytest

from distore_ucx._native_loader import _native
from distore_ucx.storage import puller as puller_module
from distore_ucx.storage.puller import COPY_HELPERS, Puller, copy_helpers
from distore_ucx.transport import UcxRuntime


def watched(loop, fd: int) -> bool:
    """Whether the event loop watches `fd` for reading."""
    try:
        key = loop._selector.get_key(fd)  # the selector loop's own table
    except KeyError:
        return False
    return key.data[0] is not None


@pytest.fixture
def runtime():
    with UcxRuntime(config={"TLS": "tcp"}) as rt:
        yield rt


async def until(predicate, seconds: float = 10.0) -> None:
    """Wait (polling the loop) until predicate() holds, or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_reader_events_during_pulls_wait_for_them_to_end(runtime):
    async def main():
        loop = asyncio.get_running_loop()
        puller = Puller(runtime, "test node")
        puller.start_am_inbox("127.0.0.1", os.urandom(16))
        try:
            fd = puller._reader_fd
            assert puller.insert_port and watched(loop, fd)
            ticks = []
            tick = puller._progress_reader
            puller._progress_reader = lambda arm=False: ticks.append(arm) or tick(arm)

            # A pull that progresses the worker is under way: an event on the
            # fd is left to it (no tick), and the fd is not watched meanwhile.
            puller._progressing += 1
            puller._on_reader_event()
            assert not watched(loop, fd) and puller._unwatched
            await asyncio.sleep(0.05)
            assert ticks == []
            # A second pull ends first: still not watched.
            puller._progressing += 1
            puller._pulled(True)
            assert not watched(loop, fd) and ticks == []
            # The last one ends: one tick arms the worker, the fd is watched again.
            puller._pulled(True)
            await until(lambda: watched(loop, fd))
            assert ticks == [True] and not puller._unwatched

            # With no pull under way, an event gets its tick at once.
            puller._on_reader_event()
            await until(lambda: watched(loop, fd))
            assert ticks == [True, True]
        finally:
            await puller.close()

    asyncio.run(main())


def test_same_host_copies_take_a_helper_thread_only_on_four_cores_or_more(monkeypatch):
    assert copy_helpers(1) == copy_helpers(2) == copy_helpers(3) == 0
    assert copy_helpers(4) == copy_helpers(64) == COPY_HELPERS == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert copy_helpers() == 0  # the cores this process may run on, not the host's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert copy_helpers() == 1


@pytest.mark.parametrize("helpers", [0, 1])
def test_the_copy_pool_is_made_once_and_only_with_helpers(runtime, monkeypatch, helpers):
    asked = []
    monkeypatch.setattr(puller_module, "copy_helpers", lambda: asked.append(1) or helpers)
    puller = Puller(runtime, "test node")
    first = puller._copy_pool()
    assert puller._copy_pool() is first and asked == [1]  # decided once, not per batch
    if helpers:
        assert isinstance(first, _native.CopyPool)
    else:
        assert first is None  # the copying thread works alone
