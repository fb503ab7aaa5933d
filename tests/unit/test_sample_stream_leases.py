"""A learner never reads a batch whose lease may have expired.

A sample reply's lease lasts the control plane's lease_timeout from its
grant, `held` s after the request arrived; the stream counts from when it
sent the request and drops (unread, lease released) any batch of a reply
past three quarters of that. In one process: a fake pipelined connection
and a fake clock."""

from __future__ import annotations

import types

import numpy as np
import pytest

from distore_ucx import protocol
from distore_ucx.client.learner import sample_stream
from distore_ucx.client.learner.sample_stream import SampleStream
from distore_ucx.protocol import ITEM_LOCATION


def sample_reply(lease: int, n: int = 4, timeout: float = 1.0, held: float = 0.0) -> dict:
    loc = np.zeros(n, ITEM_LOCATION)
    loc["node"], loc["offset"], loc["key"] = 1, np.arange(n) * 64, np.arange(n) + 1
    head, meta = protocol.encode(protocol.reply(
        1, lease=lease, refused=0, table_size=100, items=loc, probabilities=np.full(n, 0.01),
        min_probability=0.01, staged=0, lease_timeout=timeout, held=held))
    return protocol.decode(meta, protocol.read_header(head)[1])


class PipelinedRpc:
    """A control-plane connection answering requests in order with the
    replies queued in `replies`."""

    name = "control plane at 10.0.0.1:7700"
    session = 1
    connected = True

    def __init__(self, replies: list[dict]):
        self.replies = list(replies)
        self.in_flight = 0
        self.sent: list[dict] = []

    def send(self, op: str, **fields) -> int:
        assert op == "sample"
        self.sent.append(fields)
        self.in_flight += 1
        return len(self.sent)

    def receive(self, timeout: float) -> dict:
        assert self.in_flight
        self.in_flight -= 1
        return self.replies.pop(0)

    def call(self, op: str, reply_timeout: float | None = None, **fields) -> dict:
        self.send(op, **fields)
        return self.receive(reply_timeout or 0.0)


@pytest.fixture
def clock(monkeypatch):
    """The stream's clock, set by hand."""
    now = types.SimpleNamespace(t=100.0)
    monkeypatch.setattr(sample_stream, "time", types.SimpleNamespace(monotonic=lambda: now.t))
    return now


def test_a_reply_used_in_time_is_read(clock):
    rpc = PipelinedRpc([sample_reply(11), sample_reply(12)])
    stream = SampleStream(rpc, "t", batch_size=4, ahead=1, pipelined=True)  # asks now
    clock.t += 0.7  # under 3/4 of the 1 s lease since the request went out
    reply, _ = stream.next(1.0)
    assert reply["lease"] == 11 and stream.expired == 0


def test_a_reply_asked_ahead_and_kept_past_its_lease_is_dropped_and_asked_again(clock):
    rpc = PipelinedRpc([sample_reply(11), sample_reply(12), sample_reply(13)])
    stream = SampleStream(rpc, "t", batch_size=4, ahead=1, pipelined=True)
    clock.t += 0.8  # the learner paused: the reply waiting for it is too old
    reply, _ = stream.next(1.0)
    # Counted from when the request was sent, not from when it was received.
    assert reply["lease"] == 12 and stream.expired == 1
    assert any(11 in f["release"] for f in rpc.sent)  # released, not leaked


def test_time_held_waiting_for_data_is_not_counted_against_the_lease(clock):
    # The control plane held the request 5 s (an empty table) before it
    # granted the lease: the lease runs from then.
    rpc = PipelinedRpc([sample_reply(11, held=5.0), sample_reply(12)])
    stream = SampleStream(rpc, "t", batch_size=4, ahead=1, pipelined=True)
    clock.t += 5.5
    reply, _ = stream.next(1.0)
    assert reply["lease"] == 11 and stream.expired == 0


def test_batches_sampled_ahead_past_the_deadline_go_unread_with_their_reply(clock):
    rpc = PipelinedRpc([sample_reply(11, n=12), sample_reply(12, n=12)])
    stream = SampleStream(rpc, "t", batch_size=4, ahead=3, pipelined=False)
    first, _ = stream.next(1.0)  # the first of 3 batches of reply 11
    assert first["lease"] is None and len(stream.ahead) == 2
    clock.t += 0.9
    reply, _ = stream.next(1.0)  # the other two are too old: reply 12's first batch
    assert stream.expired == 2 and rpc.sent[-1]["release"] == [11]
    assert np.frombuffer(reply["items"], ITEM_LOCATION)["key"].tolist() == [1, 2, 3, 4]


def test_the_earliest_deadline_of_a_batch_read_ahead_is_collected(clock):
    rpc = PipelinedRpc([sample_reply(11), sample_reply(12, timeout=10.0)])
    stream = SampleStream(rpc, "t", batch_size=4, ahead=1, pipelined=False)
    stream.collect_leases()
    stream.next(1.0)
    stream.resample(2, 1.0)  # rows read again from a second reply
    stream.release_later([11, 12])
    session, leases, deadline = stream.collected()
    assert (session, leases) == (1, [11, 12])
    assert deadline == pytest.approx(100.0 + 0.75)  # the first reply's, the earlier
