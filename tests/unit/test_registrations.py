"""A storage node's registrations (storage/registrations.py): one
items_added in flight per table, the inserts stored meanwhile sent together
in the next, the slots of those registered committed in one call, each
one's result or error handed back to it alone."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from helpers import turns_until

from distore_ucx.errors import ConnectionFailed, NodeGone
from distore_ucx.storage.registrations import Registered, Registrations, Stored


class FakeControl:
    """A control plane connection whose replies the test releases."""

    name = "the control plane"

    def __init__(self):
        self.calls: list[dict] = []
        self.replies: list[asyncio.Future] = []

    async def call(self, op, reply_timeout=None, **fields):
        assert op == "items_added"
        self.calls.append(fields)
        reply = asyncio.get_running_loop().create_future()
        self.replies.append(reply)
        return await reply


class Commits:
    """The node's commit (NodeState.commit_registered), recorded."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[dict] = []
        self.fail = fail

    def __call__(self, table, offsets, keys, generations, priorities, steps, twice):
        self.calls.append({"table": table, "offsets": offsets.tolist(), "keys": keys.tolist(),
                           "generations": generations.tolist(),
                           "priorities": priorities.tolist(),
                           "steps": None if steps is None else [a.tolist() for a in steps],
                           "twice": twice.tolist()})
        if self.fail is not None:
            raise self.fail


def stored(first: int, n: int, steps: bool = False) -> Stored:
    keys = np.arange(first, first + n, dtype=np.uint64)
    return Stored(keys, keys * 64, np.ones(n, np.uint64), np.ones(n),
                  (keys, keys.astype(np.uint32), np.zeros(n, np.uint8)) if steps else None,
                  time.monotonic() + 5.0)



def test_inserts_stored_while_one_is_registered_go_together_in_the_next():
    async def run():
        control, commits = FakeControl(), Commits()
        regs = Registrations(lambda: 4096, commits)
        first = asyncio.ensure_future(regs.register(control, 1, "t", 0, stored(0, 2)))
        await turns_until(lambda: len(control.calls) == 1, "the items_added request")
        assert "batches" not in control.calls[0]  # one insert: a plain request
        later = [asyncio.ensure_future(regs.register(control, 1, "t", 0, stored(10 * i, 3)))
                 for i in (1, 2, 3)]
        other_table = asyncio.ensure_future(regs.register(control, 1, "u", 0, stored(99, 1)))
        # "u" has none in flight: its request goes at once
        await turns_until(lambda: len(control.calls) == 2, "the items_added request")
        assert control.calls[1]["table"] == "u"
        control.replies[0].set_result({"evicted": 0})
        control.replies[1].set_result({"evicted": 0})
        assert (await first).evicted == 0
        assert commits.calls[0]["offsets"] == [0, 64] and commits.calls[0]["steps"] is None
        await turns_until(lambda: len(control.calls) == 3, "the items_added request")
        together = control.calls[2]
        assert together["batches"] == [3, 3, 3] and len(together["timeouts"]) == 3
        assert together["keys"].tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32]
        assert together["used_bytes"] == 4096 and together["epoch"] == 0
        # The second insert is refused alone; a key of the third was held already.
        control.replies[2].set_result({
            "evicted": 5, "duplicate_offsets": np.array([31 * 64], np.uint64).tobytes(),
            "errors": [[1, "node_gone", "storage node 1 was unresponsive"]]})
        a, b, c = await asyncio.gather(*later, return_exceptions=True)
        assert isinstance(b, NodeGone) and "unresponsive" in str(b)
        assert isinstance(a, Registered) and isinstance(c, Registered)
        assert a.evicted + c.evicted == 5  # counted once, on the last registered
        # The first and third inserts' slots in one commit, but the slot of
        # the key held already, which is freed; the refused one's are its
        # caller's to free.
        both = [c for c in commits.calls if c["offsets"][:1] == [10 * 64]][0]
        assert both["offsets"] == [x * 64 for x in (10, 11, 12, 30, 32)]
        assert both["keys"] == [10, 11, 12, 30, 32] and both["twice"] == [31 * 64]
        assert len(commits.calls) == 3
        assert (await other_table).evicted == 0
        assert (regs.requests, regs.inserts) == (3, 5)

    asyncio.run(run())


def test_a_request_that_fails_whole_fails_each_insert_and_the_next_go_on():
    async def run():
        control, commits = FakeControl(), Commits()
        regs = Registrations(lambda: 0, commits)
        first = asyncio.ensure_future(regs.register(control, 1, "s", None, stored(0, 1, True)))
        await turns_until(lambda: len(control.calls) == 1, "the items_added request")
        assert control.calls[0]["episodes"].tolist() == [0] and "epoch" not in control.calls[0]
        queued = [asyncio.ensure_future(regs.register(control, 1, "s", None, stored(i, 1, True)))
                  for i in (1, 2)]
        cancelled = asyncio.ensure_future(regs.register(control, 1, "s", None, stored(3, 1, True)))
        await asyncio.sleep(0)
        cancelled.cancel()  # its caller gave up before it was sent: it is left out
        control.replies[0].set_exception(ConnectionFailed("the control plane went away"))
        with pytest.raises(ConnectionFailed):
            await first
        await turns_until(lambda: len(control.calls) == 2, "the items_added request")
        assert control.calls[1]["positions"].tolist() == [1, 2]
        control.replies[1].set_exception(ConnectionFailed("again"))
        for q in queued:
            with pytest.raises(ConnectionFailed, match="again"):
                await q
        # Nothing in flight now: the next goes at once, alone.
        after = asyncio.ensure_future(regs.register(control, 1, "s", None, stored(4, 1, True)))
        await turns_until(lambda: len(control.calls) == 3, "the items_added request")
        assert "batches" not in control.calls[2]
        control.replies[2].set_result({"evicted": 0})
        assert (await after).evicted == 0
        # Only the last one was registered: its steps are committed with it.
        assert commits.calls == [{"table": "s", "offsets": [256], "keys": [4],
                                  "generations": [1], "priorities": [1.0],
                                  "steps": [[4], [4], [0]], "twice": []}]

    asyncio.run(run())


def test_an_insert_cancelled_before_its_reply_is_neither_committed_nor_failed_by_others():
    async def run():
        control, commits = FakeControl(), Commits()
        regs = Registrations(lambda: 0, commits)
        first = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(0, 1)))
        await turns_until(lambda: len(control.calls) == 1, "the items_added request")
        later = [asyncio.ensure_future(regs.register(control, 1, "t", None, stored(i, 2)))
                 for i in (10, 20)]
        control.replies[0].set_result({"evicted": 0})
        await first
        await turns_until(lambda: len(control.calls) == 2, "the items_added request")
        later[0].cancel()  # sent, then its caller gave up: its slots are its own to free
        await asyncio.sleep(0)
        control.replies[1].set_result({"evicted": 2})
        assert (await later[1]).evicted == 2  # the last one registered counts the evictions
        assert commits.calls[1]["offsets"] == [20 * 64, 21 * 64]

    asyncio.run(run())


def test_a_commit_that_fails_fails_the_inserts_it_held_and_the_next_go_on():
    async def run():
        control = FakeControl()
        commits = Commits(fail=ConnectionFailed("storage node a is shutting down"))
        regs = Registrations(lambda: 0, commits)
        first = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(0, 3)))
        await turns_until(lambda: len(control.calls) == 1, "the items_added request")
        control.replies[0].set_result({"evicted": 0})
        with pytest.raises(ConnectionFailed, match="shutting down"):
            await first
        commits.fail = None
        after = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(5, 1)))
        await turns_until(lambda: len(control.calls) == 2, "the items_added request")
        control.replies[1].set_result({"evicted": 0})
        assert (await after).evicted == 0
        assert [c["keys"] for c in commits.calls] == [[0, 1, 2], [5]]

    asyncio.run(run())


def test_few_small_inserts_wait_up_to_the_delay_for_more_and_enough_send_at_once():
    """With a delay, the next request after a reply waits while fewer than
    COALESCE_ITEMS items and COALESCE_BYTES bytes wait: until the delay has
    passed since the last request was sent, or until enough have come."""
    from distore_ucx.storage.registrations import COALESCE_BYTES, COALESCE_ITEMS

    async def run():
        loop = asyncio.get_running_loop()
        control, commits = FakeControl(), Commits()
        delay = 0.2
        regs = Registrations(lambda: 0, commits, delay=delay)
        first = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(0, 1)))
        await turns_until(lambda: len(control.calls) == 1, "the first request")  # at once
        sent = loop.time()
        few = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(10, 3)))
        await asyncio.sleep(0)
        control.replies[0].set_result({"evicted": 0})
        await first  # answered: its caller goes on, the next request waits
        await asyncio.sleep(delay / 4)
        assert len(control.calls) == 1
        while len(control.calls) == 1:
            await asyncio.sleep(0.005)
        assert loop.time() - sent >= delay * 0.9  # not before the delay had passed
        assert control.calls[1]["keys"].tolist() == [10, 11, 12]
        control.replies[1].set_result({"evicted": 0})
        await few
        # The next waits again; enough items coming meanwhile send it at once.
        more = [asyncio.ensure_future(regs.register(control, 1, "t", None, stored(100, 2)))]
        await turns_until(lambda: len(control.calls) == 3, "a request with none in flight")
        control.replies[2].set_result({"evicted": 0})
        await more[0]
        more = [asyncio.ensure_future(regs.register(control, 1, "t", None, stored(200, 1)))]
        await turns_until(lambda: len(control.calls) == 4, "a request with none in flight")
        more.append(asyncio.ensure_future(regs.register(control, 1, "t", None, stored(300, 1))))
        await asyncio.sleep(0)
        control.replies[3].set_result({"evicted": 0})
        await more[0]
        t0 = loop.time()
        more.append(asyncio.ensure_future(
            regs.register(control, 1, "t", None, stored(400, COALESCE_ITEMS))))
        await turns_until(lambda: len(control.calls) == 5, "the request enough items send")
        assert loop.time() - t0 < delay / 2
        assert control.calls[4]["batches"] == [1, COALESCE_ITEMS]
        control.replies[4].set_result({"evicted": 0})
        await asyncio.gather(*more)
        # A big insert (a writer's batch of large items) never waits either.
        big = stored(500, 1)
        big.nbytes = COALESCE_BYTES
        first = asyncio.ensure_future(regs.register(control, 1, "t", None, stored(600, 1)))
        await turns_until(lambda: len(control.calls) == 6, "a request with none in flight")
        later = asyncio.ensure_future(regs.register(control, 1, "t", None, big))
        await asyncio.sleep(0)
        t0 = loop.time()
        control.replies[5].set_result({"evicted": 0})
        await turns_until(lambda: len(control.calls) == 7, "the big insert's request")
        assert loop.time() - t0 < delay / 2
        control.replies[6].set_result({"evicted": 0})
        await asyncio.gather(first, later)
        assert regs.requests == 7

    asyncio.run(run())


def test_a_node_reads_its_registration_delay_from_the_environment(monkeypatch):
    from distore_ucx.config import register_delay
    from distore_ucx.errors import ConfigError

    monkeypatch.delenv("DISTORE_REGISTER_DELAY", raising=False)
    assert register_delay() == pytest.approx(0.010)
    for value, seconds in (("0", 0.0), ("2.5", 0.0025), ("20ms", 0.020), (" 5 ms ", 0.005)):
        monkeypatch.setenv("DISTORE_REGISTER_DELAY", value)
        assert register_delay() == pytest.approx(seconds)
    for bad in ("soon", "-1", "5s", "2000"):
        monkeypatch.setenv("DISTORE_REGISTER_DELAY", bad)
        with pytest.raises(ConfigError, match="DISTORE_REGISTER_DELAY"):
            register_delay()
