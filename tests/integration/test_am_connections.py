"""A listening AmInbox (native/am_connections.h) takes insert messages only
over the connections its listener accepted, and tells them apart.

One process holds both sides (two UCX runtimes over TCP): a receiver's
inbox on its reader worker, listening on 127.0.0.1, and a writer's
endpoints. Messages sent over an endpoint made from the worker address
(no listener, no peer-failure handling) are refused; the same batch over
Endpoint.to_listener lands whole; closing the writer's endpoint is seen as
a failed connection that expire() closes; a second listen() is refused.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest
from helpers import wait_for

from distore_ucx._native_loader import _native
from distore_ucx.errors import DistoreError
from distore_ucx.protocol import AM_INSERT_ID
from distore_ucx.spec import SLOT_HEADER
from distore_ucx.storage.arena import Arena
from distore_ucx.transport.runtime import UcxRuntime

ITEM = 200_000
N = 4


@pytest.fixture
def sides(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    rx = UcxRuntime(config={"TLS": "tcp"})
    tx = UcxRuntime(config={"TLS": "tcp", "RNDV_SCHEME": "put_zcopy"})
    arena = Arena(rx, 4 * N * (SLOT_HEADER + ITEM), hugepages=False)
    inbox = _native.AmInbox(rx.reader_worker, AM_INSERT_ID)
    # The node's reader ticks: connections are accepted between pulls too.
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.01):
            rx.progress_reader()

    ticks = threading.Thread(target=tick, daemon=True)
    ticks.start()
    region = _native.MemoryRegion.write_protected(tx.region_owner, N * ITEM)
    items = np.frombuffer(os.urandom(N * ITEM), np.uint8).reshape(N, ITEM)
    region.view()[: N * ITEM] = items.ravel()
    yield rx, tx, arena, inbox, region, items
    stop.set()
    ticks.join()
    inbox.close()
    tx.close()
    rx.close()


def pull(arena, inbox, token: int, timeout: float) -> tuple[np.ndarray, np.ndarray]:
    offsets = arena.allocate("t", SLOT_HEADER + ITEM, N)
    statuses = arena.pull_am(inbox, token, offsets, np.arange(1, N + 1, dtype=np.uint64),
                             arena.next_generations(N), np.full(N, ITEM, np.uint64), timeout)
    view = arena.region.view()
    rows = np.stack([view[o + SLOT_HEADER: o + SLOT_HEADER + ITEM] for o in offsets.tolist()])
    arena.free("t", offsets)
    return statuses, rows


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(ep, region, token: int) -> None:
    offsets = np.arange(N, dtype=np.uint64) * np.uint64(ITEM)
    _native.am_send(ep, region, AM_INSERT_ID, token, offsets, np.full(N, ITEM, np.uint64))


def test_a_listening_inbox_takes_messages_only_from_its_connections(sides):
    rx, tx, arena, inbox, region, items = sides
    port = inbox.listen("127.0.0.1", 0)
    assert port > 0
    with pytest.raises(DistoreError, match="listens already"):
        inbox.listen("127.0.0.1", 0)

    # A worker-address endpoint without peer-failure handling: refused.
    plain = _native.Endpoint(tx.worker, bytes(rx.reader_worker.address), False, "rx")
    send(plain, region, 11)
    statuses, _ = pull(arena, inbox, 11, 1.0)
    assert [_native.status_name(s) for s in statuses] == ["UCS_ERR_TIMED_OUT"] * N
    assert inbox.refused == N and inbox.waiting == 0
    plain.close()

    # Nobody listening there: refused at once, not when a batch is posted.
    with pytest.raises(DistoreError, match="cannot connect to the UCX listener"):
        tx.listener_endpoint("127.0.0.1", unused_port(), "nobody", timeout=5.0)

    # Through the listener (the runtime keeps one endpoint per listener): whole.
    ep = tx.listener_endpoint("127.0.0.1", port, "rx")
    assert ep.error_handling and tx.listener_endpoint("127.0.0.1", port, "rx") is ep
    send(ep, region, 12)
    statuses, rows = pull(arena, inbox, 12, 30.0)
    assert not statuses.any() and np.array_equal(rows, items)
    c = inbox.connections
    assert c["open"] == 1 and c["accepted"] == 1 and c["failed"] == 0, c

    # The writer drops its endpoint: a failed connection, closed by expire().
    tx.drop_listener_endpoint("127.0.0.1", port)
    assert not ep.alive

    def closed():
        rx.progress_reader()
        inbox.expire(60.0)
        return inbox.connections["open"] == 0

    wait_for(closed, 10, "the closed connection to be seen", lambda: inbox.connections)
    assert inbox.connections["failed"] == 1


def test_a_receive_from_a_hung_connection_ends_by_force_at_the_timeout(sides):
    # A writer that stops progressing mid-batch (here: an endpoint whose
    # worker nobody progresses) leaves receives under way; at the pull's
    # timeout their connection is force-closed and they end.
    rx, _, arena, inbox, _, items = sides
    port = inbox.listen("127.0.0.1", 0)
    silent = UcxRuntime(config={"TLS": "tcp", "RNDV_SCHEME": "put_zcopy"},
                        progress_thread=False)
    try:
        region = _native.MemoryRegion.write_protected(silent.region_owner, N * ITEM)
        region.view()[: N * ITEM] = items.ravel()
        ep = _native.Endpoint.to_listener(silent.worker, "127.0.0.1", port, "rx")
        send(ep, region, 21)
        # Progress the silent writer just enough to connect and post its RTS.
        def arrived():
            silent.worker.progress()
            rx.progress_reader()
            return inbox.waiting == N
        wait_for(arrived, 10, "the batch's messages", lambda: inbox.waiting)
        statuses, _ = pull(arena, inbox, 21, 1.0)
        assert statuses.all(), statuses  # none could land: the writer never answered
        c = inbox.connections
        assert c["aborted"] == 1 and c["open"] == 0 and c["abandoned_receives"] == 0, c
        # The writer wakes up: it sees its connection gone and closes.
        wait_for(lambda: silent.worker.progress() or not ep.alive, 10, "the writer to see it")
        ep.close(force=True, timeout=1.0)
        for _ in range(100):  # let UCX finish what the close queued before it goes
            silent.worker.progress()
    finally:
        silent.close()


def test_runs_land_whole_and_a_run_that_is_not_the_items_fails_them(sides):
    # Items that follow one another go several to a message (a run), received
    # through a bounce chunk and copied into their slots; a run whose length
    # is not its items' fails them (the next batch lands all the same); a
    # run larger than the node's chunks is refused on arrival.
    rx, tx, arena, inbox, region, items = sides
    port = inbox.listen("127.0.0.1", 0)
    ep = tx.listener_endpoint("127.0.0.1", port, "rx")
    offsets = np.arange(N, dtype=np.uint64) * np.uint64(ITEM)
    lengths = np.full(N, ITEM, np.uint64)

    _native.am_send(ep, region, AM_INSERT_ID, 31, offsets, lengths, 2 * ITEM)
    statuses, rows = pull(arena, inbox, 31, 30.0)
    assert not statuses.any() and np.array_equal(rows, items)
    assert 1 <= inbox.chunks <= 2 and inbox.waiting == 0

    # The node expects shorter items than the runs carry: every item fails.
    _native.am_send(ep, region, AM_INSERT_ID, 32, offsets, lengths, 2 * ITEM)
    slots = arena.allocate("t", SLOT_HEADER + ITEM, N)
    statuses = arena.pull_am(inbox, 32, slots, np.arange(1, N + 1, dtype=np.uint64),
                             arena.next_generations(N), lengths - np.uint64(8), 30.0)
    assert [_native.status_name(s) for s in statuses] == ["UCS_ERR_MESSAGE_TRUNCATED"] * N
    view = arena.region.view().view(np.uint64)
    assert not view[(slots // np.uint64(8)).astype(np.int64) + 1].any()  # no valid header
    arena.free("t", slots)

    # A run over AmInbox.run_bytes: refused when it arrives.
    big_n = _native.AmInbox.run_bytes // ITEM + 1
    big = _native.MemoryRegion.write_protected(tx.region_owner, big_n * ITEM)
    refused = inbox.refused
    _native.am_send(ep, big, AM_INSERT_ID, 33, np.arange(big_n, dtype=np.uint64) * np.uint64(ITEM),
                    np.full(big_n, ITEM, np.uint64), 8 << 20)
    slots = arena.allocate("t", SLOT_HEADER + ITEM, big_n)
    statuses = arena.pull_am(inbox, 33, slots, np.arange(1, big_n + 1, dtype=np.uint64),
                             arena.next_generations(big_n), np.full(big_n, ITEM, np.uint64), 1.0)
    assert [_native.status_name(s) for s in statuses] == ["UCS_ERR_TIMED_OUT"] * big_n
    assert inbox.refused == refused + 1
    arena.free("t", slots)

    # The connection still serves: the next batch lands whole, in runs.
    _native.am_send(ep, region, AM_INSERT_ID, 34, offsets, lengths, 2 * ITEM)
    statuses, rows = pull(arena, inbox, 34, 30.0)
    assert not statuses.any() and np.array_equal(rows, items)


def test_a_batch_of_more_runs_than_bounce_chunks_waits_for_chunks_and_lands_whole(sides):
    # 32 runs of two 4 KiB items in one batch: twice the chunks a pull may
    # have out, so half the runs wait for a chunk to come back.
    rx, tx, arena, inbox, region, _ = sides
    port = inbox.listen("127.0.0.1", 0)
    ep = tx.listener_endpoint("127.0.0.1", port, "rx")
    item, n = 4096, 64
    data = np.frombuffer(os.urandom(n * item), np.uint8).reshape(n, item)
    region.view()[: n * item] = data.ravel()
    _native.am_send(ep, region, AM_INSERT_ID, 41, np.arange(n, dtype=np.uint64) * np.uint64(item),
                    np.full(n, item, np.uint64), 2 * item)
    # All 32 arrived before the pull starts: it takes 16 and holds the rest.
    wait_for(lambda: inbox.waiting == n // 2, 10, "the batch's messages", lambda: inbox.waiting)
    slots = arena.allocate("small", SLOT_HEADER + item, n)
    statuses = arena.pull_am(inbox, 41, slots, np.arange(1, n + 1, dtype=np.uint64),
                             arena.next_generations(n), np.full(n, item, np.uint64), 30.0)
    assert not statuses.any(), statuses
    view = arena.region.view()
    rows = np.stack([view[o + SLOT_HEADER: o + SLOT_HEADER + item] for o in slots.tolist()])
    assert np.array_equal(rows, data)
    assert inbox.chunks == 16 and inbox.waiting == 0  # no more made than may be out
    arena.free("small", slots)
