"""A learner's priority updates, not waited for (client/learner/priorities.py),
against a stand-in connection that answers when the test says."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx import errors
from distore_ucx.client.learner.priorities import PriorityUpdates, checked_priorities


class FakeRpc:
    """Requests in order; replies given by the test (`answer`), or lost."""

    name = "control plane at test"

    def __init__(self):
        self.sent: list[dict] = []  # every request sent, in order
        self.replies: list[dict] = []  # ready to be received, in order
        self.pending = 0
        self.connected = True
        self.closed = False
        self.auto = False  # True: each reply comes when it is waited for

    @property
    def in_flight(self) -> int:
        return self.pending

    def send(self, op: str, **fields) -> int:
        assert op == "update_priorities"
        self.connected = True  # a send reconnects
        self.sent.append(fields)
        self.pending += 1
        return len(self.sent)

    def answer(self, missing: int = 0, error: dict | None = None) -> None:
        """The control plane answers the oldest request not answered yet."""
        fields = self.sent[len(self.sent) - self.pending + len(self.replies)]
        n = len(fields["keys"])
        self.replies.append(error or {"ok": True, "updated": n - missing, "missing": missing})

    def lose(self) -> None:
        """The connection breaks: what was in flight is gone."""
        self.connected, self.pending, self.replies = False, 0, []

    def wait_readable(self, timeout: float) -> bool:
        return bool(self.replies)

    def receive(self, timeout: float | None = None) -> dict:
        if not self.connected:
            raise errors.ConnectionFailed(f"lost the connection to the {self.name}")
        if not self.replies and self.auto and self.pending:
            self.answer()
        if not self.replies:
            # What a reply that never came does to an RpcClient.
            self.lose()
            raise errors.Timeout("no reply within the timeout; the connection was closed")
        self.pending -= 1
        reply = self.replies.pop(0)
        if not reply.get("ok"):
            raise errors.TableNotFound(reply["error"])
        return reply

    def close(self) -> None:
        self.closed = True


def u64(*keys):
    return np.array(keys, np.uint64)


def f64(*prios):
    return np.array(prios, np.float64)


@pytest.fixture
def rpc():
    return FakeRpc()


@pytest.fixture
def updates(rpc):
    return PriorityUpdates(lambda: rpc, "t", timeout=1.0)


def test_an_update_goes_at_once_and_those_made_meanwhile_go_as_one(rpc, updates):
    updates.update(u64(1, 2), f64(1.0, 2.0))
    assert len(rpc.sent) == 1  # nothing in flight: sent, not waited for
    updates.update(u64(3), f64(3.0))
    updates.update(u64(1), f64(9.0))  # a key again: the later priority stays last
    assert len(rpc.sent) == 1  # held while the first is in flight
    rpc.answer()
    updates.update(u64(4), f64(4.0))  # the first's reply came: the rest go, as one
    assert len(rpc.sent) == 2
    assert rpc.sent[1]["keys"].tolist() == [3, 1, 4]
    assert rpc.sent[1]["priorities"].tolist() == [3.0, 9.0, 4.0]
    rpc.answer(missing=1)
    assert updates.flush() == {"updated": 4, "missing": 1}
    assert updates.missing_total == 1 and updates.requests == 2
    assert updates.flush() == {"updated": 0, "missing": 0}  # counts since the last flush


def test_settle_returns_once_every_update_is_applied(rpc, updates):
    # What a sample request waits for first (SampleStream's before_request).
    updates.update(u64(1), f64(1.0))
    updates.update(u64(2), f64(2.0))  # held
    rpc.auto = True
    updates.settle()
    assert rpc.pending == 0 and [f["keys"].tolist() for f in rpc.sent] == [[1], [2]]
    updates.settle()  # nothing left: no request
    assert len(rpc.sent) == 2


def test_an_update_never_answered_is_raised_not_waited_for_forever(rpc, updates):
    updates.update(u64(1), f64(1.0))
    updates.settle()  # no reply within the timeout: kept for the next call
    with pytest.raises(errors.Timeout):
        updates.flush()


def test_a_refused_update_is_raised_by_the_next_call_and_not_again(rpc, updates):
    updates.update(u64(1), f64(1.0))
    rpc.answer(error={"ok": False, "error": "no table 't'"})
    updates.settle()  # the prefetch thread: kept, not raised there
    with pytest.raises(errors.TableNotFound, match="no table"):
        updates.update(u64(2), f64(2.0))
    updates.update(u64(2), f64(2.0))  # raised once
    rpc.answer(error={"ok": False, "error": "no table 't'"})
    with pytest.raises(errors.TableNotFound):
        updates.flush()
    assert updates.flush() == {"updated": 0, "missing": 0}


def test_an_update_in_flight_on_a_lost_connection_is_sent_again(rpc, updates):
    updates.update(u64(1, 2), f64(1.0, 2.0))
    rpc.lose()
    updates.update(u64(3), f64(3.0))  # held behind the lost one
    real_send = rpc.send

    def send_and_answer(op, **fields):  # the new connection answers at once
        real_send(op, **fields)
        rpc.answer()

    rpc.send = send_and_answer
    assert updates.flush() == {"updated": 3, "missing": 0}
    assert [f["keys"].tolist() for f in rpc.sent] == [[1, 2], [1, 2], [3]]


def test_close_applies_what_is_held_and_closes_the_connection(rpc, updates):
    updates.update(u64(1), f64(1.0))
    rpc.answer()
    updates.close()
    assert rpc.closed and updates.flush() == {"updated": 1, "missing": 0}


def test_priorities_are_checked_before_anything_is_sent():
    with pytest.raises(ValueError, match="2 keys but 1 priorities"):
        checked_priorities(u64(1, 2), [1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        checked_priorities(u64(1), [np.nan])
    keys, prios = checked_priorities([[1, 2]], [[0.5, 1]])
    assert keys.dtype == np.uint64 and prios.tolist() == [0.5, 1.0]


def test_an_update_held_keeps_its_keys_when_the_callers_arrays_change(rpc, updates):
    # A batch's keys are a view into the learner's ring: the next samples
    # rewrite them while the update waits behind the one in flight.
    updates.update(u64(1), f64(1.0))
    keys, prios = u64(5, 6), f64(0.5, 0.6)
    updates.update(keys, prios)  # held
    keys[:], prios[:] = 7, 9.0  # the ring slot reused
    rpc.answer()
    updates.update(u64(8), f64(0.8))
    assert rpc.sent[1]["keys"].tolist() == [5, 6, 8]
    assert rpc.sent[1]["priorities"].tolist() == [0.5, 0.6, 0.8]

