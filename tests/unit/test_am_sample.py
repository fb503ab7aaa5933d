"""Samples by active message (native/am_sample_server.cc, am_sample_client.cc),
both ends in one process over UCX tcp: a node's AmSampleServer on one runtime's
worker (progressed by its thread), a learner's AmSampleClient on another runtime's reader worker
(progressed by fetch alone). tests/integration/test_am_sample.py runs them
in separate processes, with items of the sizes measured and a learner killed
mid-batch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import wait_for

from distore_ucx._native_loader import _native
from distore_ucx.errors import InvalidArgument, OutOfBoundsError
from distore_ucx.spec import SLOT_HEADER, TableSpec
from distore_ucx.transport import UcxRuntime

CONFIG = {"TLS": "tcp", "RNDV_SCHEME": "put_zcopy", "ADAPTIVE_PROGRESS": "n"}
# obs goes by rendezvous, the two small fields eagerly; padding between them.
SPEC = TableSpec.parse({"obs": ((20000,), "uint8"), "reward": ((), "float32"),
                        "step": ((), "int64")})
SLOTS = 32


def slot_bytes(spec: TableSpec, s: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 + s)
    return [rng.integers(0, 256, f.nbytes, np.uint8) for f in spec.fields]


def header_of(s) -> tuple:
    s = np.asarray(s, np.uint64)
    return s + np.uint64(1 << 40), s * np.uint64(3) + np.uint64(1)


class Node:
    """An arena of SLOTS patterned slots and a server over it; with
    `chunk_bytes`, a bounce region of `chunks` chunks for runs."""

    def __init__(self, spec: TableSpec = SPEC, chunk_bytes: int | None = None, chunks: int = 8,
                 **server_args):
        self.rt = UcxRuntime(config=CONFIG, env_tls="tcp")
        self.spec = spec
        self.slot = spec.slot_size
        self.arena = _native.MemoryRegion.write_protected(self.rt.region_owner, self.slot * SLOTS,
                                                          False)
        view = self.arena.view()
        for s in range(SLOTS):
            row = view[s * self.slot:(s + 1) * self.slot]
            row[:SLOT_HEADER].view(np.uint64)[:] = header_of(s)
            for f, data in zip(spec.fields, slot_bytes(spec, s)):
                row[SLOT_HEADER + f.offset:SLOT_HEADER + f.offset + f.nbytes] = data
        self.runs = chunk_bytes is not None
        if self.runs:
            server_args.update(bounce=self.rt.map_region(chunks * chunk_bytes),
                               chunk_bytes=chunk_bytes)
        self.server = _native.AmSampleServer(self.rt.worker, self.arena, **server_args)

    def close(self, sends_ended: bool = True):
        """`sends_ended`: every batch's sends must have ended (else a batch UCX
        kept after its learner went is let be)."""
        done = self.server.close(5.0)
        assert done or not sends_ended
        self.server = None
        self.arena = None
        self.rt.close()


class Learner:
    """A dense ring slot of `n` rows and a client on the reader worker."""

    def __init__(self, n: int, spec: TableSpec = SPEC, client_id: int = 0):
        self.rt = UcxRuntime(config=CONFIG, env_tls="tcp")
        self.spec = spec
        self.n = n
        self.worker = self.rt.reader_worker
        self.client = _native.AmSampleClient(self.worker, client_id=client_id)
        self.layout = spec.layout(n)
        self.reads = _native.BatchLayout(
            n, self.layout.header,
            np.array([SLOT_HEADER + f.offset for f in spec.fields], np.uint64),
            np.array([f.nbytes for f in spec.fields], np.uint64),
            np.array(self.layout.offsets, np.uint64))
        self.dest = self.rt.map_region(self.layout.nbytes)
        self.buf = self.dest.view()
        self.eps = []

    def connect(self, node: Node, error_handling: bool = False):
        self.eps.append(_native.Endpoint(self.worker, node.rt.address, error_handling, "node"))

    def connect_listener(self, port: int):
        """Through the node's listener (AmSampleServer.listen), as learners do."""
        ep = _native.Endpoint.to_listener(self.worker, "127.0.0.1", port, "node")
        assert ep.flush(5.0) == 0  # connected
        self.eps.append(ep)
        return ep

    def fetch(self, node_index, slots, slot_size, timeout=10.0, **kw):
        self.buf[:] = 0xAB  # what a failed item must not keep claiming
        return self.client.fetch(self.eps, np.asarray(node_index, np.uint32),
                                 np.asarray(slots, np.uint64) * np.uint64(slot_size),
                                 np.arange(len(slots), dtype=np.uint64), self.reads, self.dest,
                                 timeout, **kw)

    def data(self) -> dict:
        return self.spec.views(self.buf, self.layout)

    def headers(self) -> np.ndarray:
        return self.spec.header_view(self.buf, self.layout)

    def close(self):
        self.client.close()
        for ep in self.eps:
            ep.close(ep.error_handling, 1.0)
        self.eps = []
        self.dest = self.buf = None
        self.rt.close()


@pytest.fixture(params=["item-by-item", "runs"])
def node(request):
    """A node sending each item's part alone, or runs of items from 1 MiB
    chunks (as storage/sample_server.py makes it)."""
    n = Node(chunk_bytes=(1 << 20) if request.param == "runs" else None)
    yield n
    n.close()


@pytest.fixture
def learner():
    lr = Learner(16)
    yield lr
    lr.close()


def check_rows(learner: Learner, slots, rows=None) -> None:
    rows = range(len(slots)) if rows is None else rows
    data, headers = learner.data(), learner.headers()
    for r in rows:
        s = int(slots[r])
        assert tuple(headers[r]) == tuple(int(x) for x in header_of(s)), r
        for f, want in zip(learner.spec.fields, slot_bytes(learner.spec, s)):
            got = data[f.name][r]
            assert np.array_equal(np.ascontiguousarray(got).reshape(-1).view(np.uint8), want), \
                (r, f.name)


@pytest.mark.parametrize("error_handling", [False, True])
def test_every_field_lands_in_its_dense_array_and_the_header_beside(node, learner,
                                                                    error_handling):
    learner.connect(node, error_handling)
    slots = np.random.default_rng(0).choice(SLOTS, learner.n, replace=False)
    for _ in range(3):
        statuses = learner.fetch(np.zeros(learner.n), slots, node.slot)
        assert (statuses == 0).all(), statuses
        check_rows(learner, slots)
    assert all(a.flags.c_contiguous for a in learner.data().values())
    # The node's sends end after the learner has its bytes (the
    # acknowledgements are on their way back).
    wait_for(lambda: node.server.stats["batches_done"] == 3, 10.0, "the node's sends to end",
             lambda: node.server.stats)
    stats = node.server.stats
    assert stats["in_flight"] == 0 and stats["batches_failed"] == 0
    if node.runs:  # 16 rows in a row: each field of the batch in one message
        assert stats["messages"] == stats["runs"] == 3 * len(SPEC.fields)
    else:
        assert stats["messages"] == 3 * learner.n * len(SPEC.fields) and stats["runs"] == 0
    assert learner.client.stats["batches"] == 3 and learner.client.stats["malformed"] == 0


def fetch_rows(learner: Learner, node: Node, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Read slot slots[i] into row rows[i]; the slot each row holds."""
    learner.buf[:] = 0xAB
    statuses = learner.client.fetch(learner.eps, np.zeros(len(slots), np.uint32),
                                    slots.astype(np.uint64) * np.uint64(node.slot),
                                    rows.astype(np.uint64), learner.reads, learner.dest, 10.0)
    assert (statuses == 0).all(), statuses
    at_row = np.empty(learner.n, np.int64)
    at_row[rows] = slots
    return at_row


def test_runs_are_cut_at_the_chunk_and_where_the_rows_do_not_follow(learner):
    # 3 items of 20000 bytes fill a 64 KiB chunk; rows 0-7, 9, 8, 10-15 make
    # the runs 0-7 (cut 3+3+2), 9, 8 and 10-15 (3+3): 7 messages a field.
    node = Node(chunk_bytes=1 << 16, chunks=64)
    try:
        learner.connect(node)
        slots = np.random.default_rng(7).choice(SLOTS, learner.n, replace=False)
        rows = np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 8, 10, 11, 12, 13, 14, 15])
        for _ in range(2):
            check_rows(learner, fetch_rows(learner, node, slots, rows))
        wait_for(lambda: node.server.stats["batches_done"] == 2, 10.0, "the node's sends to end",
                 lambda: node.server.stats)
        stats = node.server.stats
        assert stats["messages"] == 2 * 7 * len(SPEC.fields), stats
        assert stats["runs"] == 2 * 5 * len(SPEC.fields) and stats["unpacked"] == 0, stats
    finally:
        node.close()


def test_without_a_free_chunk_a_run_goes_item_by_item(learner):
    # One chunk: the first field's run takes it; while its rendezvous is
    # under way the other two fields go item by item from the arena.
    node = Node(chunk_bytes=1 << 20, chunks=1)
    try:
        learner.connect(node)
        slots = np.random.default_rng(8).choice(SLOTS, learner.n, replace=False)
        for k in range(1, 4):
            assert (learner.fetch(np.zeros(learner.n), slots, node.slot) == 0).all()
            check_rows(learner, slots)
            wait_for(lambda k=k: node.server.stats["batches_done"] == k, 10.0,
                     "the node's sends to end", lambda: node.server.stats)
        stats = node.server.stats
        assert stats["runs"] >= 3 and stats["unpacked"] >= 3, stats
        assert stats["runs"] + stats["unpacked"] == 3 * len(SPEC.fields), stats
        assert stats["messages"] == stats["runs"] + learner.n * stats["unpacked"], stats
    finally:
        node.close()


def test_a_bounce_region_without_a_chunk_is_refused(node):
    with pytest.raises(InvalidArgument, match="no chunk"):
        _native.AmSampleServer(node.rt.worker, node.arena, request_id=0x4461,
                               bounce=node.rt.map_region(4096), chunk_bytes=8192)


@pytest.mark.parametrize("runs", [False, True])
def test_one_call_reads_from_several_nodes(runs):
    nodes = [Node(chunk_bytes=(1 << 20) if runs else None) for _ in range(2)]
    learner = Learner(16)
    try:
        for n in nodes:
            learner.connect(n)
        slots = np.random.default_rng(1).choice(SLOTS, 16, replace=False)
        # Alternating nodes join no items; halves make one run per node.
        for which in (np.arange(16) % 2, np.arange(16) // 8):
            statuses = learner.fetch(which, slots, nodes[0].slot)
            assert (statuses == 0).all(), statuses
            check_rows(learner, slots)  # both arenas hold the same pattern
        assert [n.server.stats["requests"] for n in nodes] == [2, 2]
        wait_for(lambda: all(n.server.stats["in_flight"] == 0 for n in nodes), 10.0,
                 "the nodes' sends to end")
        assert [n.server.stats["runs"] for n in nodes] == [3 * runs, 3 * runs]
    finally:
        learner.close()
        for n in nodes:
            n.close()


def test_a_header_only_layout_reads_just_the_headers(node):
    learner = Learner(8)
    try:
        learner.connect(node)
        learner.reads = _native.BatchLayout(8, 0, np.zeros(0, np.uint64),
                                            np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        slots = np.arange(8) + 3
        assert (learner.fetch(np.zeros(8), slots, node.slot) == 0).all()
        headers = learner.buf[:128].view(np.uint64).reshape(8, 2)
        assert (headers[:, 0] == header_of(slots)[0]).all()
    finally:
        learner.close()


def test_a_request_outside_the_arena_is_refused_and_its_items_fail(node, learner):
    learner.connect(node)
    slots = np.arange(learner.n)
    slots[5] = SLOTS  # one slot past the end: the node refuses the whole request
    statuses = learner.fetch(np.zeros(learner.n), slots, node.slot)
    assert {_native.status_name(int(s)) for s in statuses} == {"DISTORE_OUT_OF_BOUNDS"}
    assert (learner.headers() == 0).all()  # no failed row claims an item
    assert node.server.stats["refused"] == 1 and learner.client.stats["refused"] == 1
    # The node serves on.
    slots[5] = 5
    assert (learner.fetch(np.zeros(learner.n), slots, node.slot) == 0).all()
    check_rows(learner, slots)


def test_malformed_arguments_raise_before_anything_is_sent(node, learner):
    learner.connect(node)
    with pytest.raises(InvalidArgument, match="node index"):
        learner.fetch(np.ones(learner.n), np.arange(learner.n), node.slot)
    with pytest.raises(OutOfBoundsError, match="row"):
        learner.client.fetch(learner.eps, np.zeros(1, np.uint32), np.zeros(1, np.uint64),
                             np.array([learner.n], np.uint64), learner.reads, learner.dest)
    with pytest.raises(OutOfBoundsError, match="not aligned"):
        learner.client.fetch(learner.eps, np.zeros(1, np.uint32), np.array([4], np.uint64),
                             np.zeros(1, np.uint64), learner.reads, learner.dest)
    with pytest.raises(InvalidArgument, match="endpoints must be"):
        _native.AmSampleServer(node.rt.worker, node.arena, request_id=0x4460, endpoints="any")
    assert node.server.stats["requests"] == 0


def test_items_a_node_never_answers_time_out(node, learner):
    learner.connect(node)
    assert node.server.close(5.0)  # its handler is gone: requests are dropped
    statuses = learner.fetch(np.zeros(learner.n), np.arange(learner.n), node.slot, timeout=0.5)
    assert {_native.status_name(int(s)) for s in statuses} == {"UCS_ERR_TIMED_OUT"}
    assert (learner.headers() == 0).all()


def test_registered_endpoints_answer_only_the_learners_the_node_registered():
    node = Node(endpoints="registered")
    learner = Learner(8, client_id=77)
    try:
        learner.connect(node, error_handling=True)
        slots = np.arange(8)
        statuses = learner.fetch(np.zeros(8), slots, node.slot)
        assert {_native.status_name(int(s)) for s in statuses} == {"UCS_ERR_NOT_CONNECTED"}
        # The node's own endpoint to the learner's worker; UCX refuses one whose
        # error handling differs from the learner's endpoint between the same
        # two workers ("asymmetric endpoint configuration").
        ep = _native.Endpoint(node.rt.worker, bytes(learner.worker.address), True, "learner")
        node.server.set_peer(77, ep)
        assert (learner.fetch(np.zeros(8), slots, node.slot) == 0).all()
        check_rows(learner, slots)
        node.server.drop_peer(77)
        statuses = learner.fetch(np.zeros(8), slots, node.slot)
        assert {_native.status_name(int(s)) for s in statuses} == {"UCS_ERR_NOT_CONNECTED"}
        ep.close(True, 1.0)
    finally:
        learner.close()
        node.close()


def test_threads_fetch_through_one_client_at_once(node, learner):
    # One client per worker (it owns the worker's data handler): a process's
    # learners share it, each fetching into its own ring slot.
    learner.connect(node)
    second = learner.rt.map_region(learner.layout.nbytes)
    rng = np.random.default_rng(3)
    errors = []

    def run(dest, seed):
        try:
            r = np.random.default_rng(seed)
            view = dest.view()
            for _ in range(10):
                slots = r.choice(SLOTS, learner.n, replace=False)
                statuses = learner.client.fetch(
                    learner.eps, np.zeros(learner.n, np.uint32),
                    slots.astype(np.uint64) * np.uint64(node.slot),
                    np.arange(learner.n, dtype=np.uint64), learner.reads, dest, 10.0)
                assert (statuses == 0).all(), statuses
                headers = SPEC.header_view(view, learner.layout)
                assert (headers[:, 0] == header_of(slots)[0]).all()
                obs = SPEC.views(view, learner.layout)["obs"]
                for row, s in enumerate(slots.tolist()):
                    assert np.array_equal(obs[row], slot_bytes(SPEC, s)[0])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d, int(rng.integers(1 << 30))))
               for d in (learner.dest, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert learner.client.stats["batches"] == 20 and learner.client.stats["late"] == 0


def test_learners_connected_through_the_listener_get_every_field(node, learner):
    # Peer-failure handling and zero-copy rendezvous at once (am_connections.h).
    port = node.server.listen("127.0.0.1", 0)
    assert 0 < port < 65536
    ep = learner.connect_listener(port)
    assert ep.error_handling
    slots = np.random.default_rng(5).choice(SLOTS, learner.n, replace=False)
    for _ in range(3):
        statuses = learner.fetch(np.zeros(learner.n), slots, node.slot)
        assert (statuses == 0).all(), statuses
        check_rows(learner, slots)
    wait_for(lambda: node.server.stats["batches_done"] == 3, 10.0, "the node's sends to end",
             lambda: node.server.stats)
    assert node.server.connections["open"] == 1 and node.server.connections["accepted"] == 1
    with pytest.raises(InvalidArgument, match="listens already"):
        node.server.listen("127.0.0.1", 0)
    # A learner that closes its endpoint (unforced, as runtime.drop_listener_endpoint
    # does a live one): the node's end fails and is reaped. (A killed
    # learner's: tests/integration/test_am_sample_path.py.)
    ep.close(False, 1.0)
    wait_for(lambda: node.server.reap(0.5) >= 0 and node.server.connections["open"] == 0, 10.0,
             "the learner's connection to be closed", lambda: node.server.connections)
    assert node.server.connections["failed"] == 1


def test_the_remote_key_for_busy_items_reads_on_the_listener_endpoint(node, learner):
    # Items a busy node refuses are read by gets through a remote key on the
    # same endpoint: UCX refuses a second endpoint between the same two
    # workers whose error handling differs.
    ep = learner.connect_listener(node.server.listen("127.0.0.1", 0))
    key = _native.RemoteKey(ep, node.arena.pack_rkey(), node.arena.address, node.arena.size,
                            "node")
    slots = np.arange(4)
    statuses = _native.gather(learner.worker, [key], np.zeros(4, np.uint32),
                              np.uint64(node.arena.address) + slots.astype(np.uint64)
                              * np.uint64(node.slot),
                              np.full(4, 16, np.uint64), learner.dest,
                              np.arange(4, dtype=np.uint64) * np.uint64(16), 5.0)
    assert (statuses == 0).all(), statuses
    got = learner.buf[:64].view(np.uint64).reshape(4, 2)
    assert (got[:, 0] == header_of(slots)[0]).all() and (got[:, 1] == header_of(slots)[1]).all()
    # ...and the fetch beside it still works.
    assert (learner.fetch(np.zeros(learner.n), np.arange(learner.n), node.slot) == 0).all()
    check_rows(learner, np.arange(learner.n))
    del key


def test_a_node_that_stops_answering_fails_after_the_stall_and_is_closed(learner):
    node = Node(stall=30.0)
    try:
        stop_and_fetch(node, learner)
    finally:
        node.close()


def stop_and_fetch(node: Node, learner: Learner) -> None:
    # A stopped node (SIGSTOP) progresses nothing: its sockets stay open.
    # Its progress thread stops for good here; the test progresses its
    # worker itself once it "wakes up".
    ep = learner.connect_listener(node.server.listen("127.0.0.1", 0))
    node.rt.worker.stop_progress_thread()
    node.rt._progress = False  # nothing to stop at close
    t0 = time.monotonic()
    statuses = learner.fetch(np.zeros(learner.n), np.arange(learner.n), node.slot,
                             timeout=30.0, stall=0.5)
    took = time.monotonic() - t0
    assert {_native.status_name(int(s)) for s in statuses} == {"UCS_ERR_TIMED_OUT"}
    assert took < 5.0, took  # the stall, not the timeout
    assert (learner.headers() == 0).all()
    assert not ep.alive  # force-closed: dropping it costs no wait

    def both_progressed() -> bool:  # the node woke up; the learner's next batch
        node.rt.worker.progress()
        learner.worker.progress()
        return True

    # The node, going on, finds the learner's connection gone (once the
    # learner's worker is progressed, as its next batch does, UCX closes the
    # socket): the batch's sends fail and the connection is reaped.
    wait_for(lambda: both_progressed() and node.server.reap(0.5) >= 0
             and node.server.connections["open"] == 0 and node.server.stats["in_flight"] == 0,
             20.0, "the node to drop the learner", lambda: (node.server.connections,
                                                           node.server.stats),
             interval=0.005)
    assert node.server.connections["failed"] == 1
    assert node.server.stats["stuck"] == 0 and node.server.stats["abandoned"] == 0
