"""The node's pull thread and the reader worker's event fd (storage/puller.py):
while pulls that progress the reader worker are under way, its events get
no tick of their own; the fd is watched again once they are done."""

from __future__ import annotations

import asyncio
import os

import pytest

from distore_ucx.storage.puller import Puller
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
