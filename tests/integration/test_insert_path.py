"""The insert path: writers stage batches, storage nodes pull them one-sided.

Over UCX_TLS=tcp (UCX gets through the node's endpoint to the writer), sm
(same host, mapping off: the node reads the writer's process) and mapped
(same host: the writer hands the node its sealed staging memfds and the
node copies out of a read-only mapping), every inserted item is
read back whole; a writer killed with batches in flight leaves no slot
behind and nothing half-written; malformed descriptors get an error reply
and the node goes on serving; a writer held by a rate limiter fails after
its timeout with the exact keys stored and not stored.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx._native_loader import _native
from distore_ucx.client.writer import in_flight as writer_in_flight
from distore_ucx.config import AM_MIN_ITEM_BYTES
from distore_ucx.errors import RemoteError
from distore_ucx.protocol import AM_INSERT_AUTH_ID, AM_INSERT_ID
from distore_ucx.transport import rpc
from distore_ucx.transport.local_map import send_staging
from distore_ucx.transport.same_host import host_id

ITEM = 3000  # bytes: the first 8 hold the item's index, the rest derive from it


def items(index: np.ndarray, nbytes: int = ITEM) -> np.ndarray:
    """Items whose bytes all follow from their index (so a torn one is visible)."""
    index = np.asarray(index, np.uint64)
    body = (np.arange(nbytes - 8, dtype=np.uint64)[None, :] * np.uint64(31)
            + index[:, None] * np.uint64(7)) & np.uint64(0xFF)
    out = np.empty((len(index), nbytes), np.uint8)
    out[:, :8] = index[:, None].view(np.uint8).reshape(len(index), 8)
    out[:, 8:] = body.astype(np.uint8)
    return out


ITEMS_SOURCE = textwrap.indent(inspect.getsource(items), "    ").strip()


def whole(rows: np.ndarray) -> np.ndarray:
    """Which sampled rows are exactly the item their first 8 bytes name."""
    index = rows[:, :8].copy().view(np.uint64).ravel()
    return (rows == items(index, rows.shape[1])).all(axis=1)


def wait_for(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


def node_bytes_match_table(client, table: str) -> bool:
    info = client.table_info(table)
    used = sum(n["used_bytes"] for n in client.status()["nodes"])
    return used == info["size"] * info["slot_size"]


@pytest.fixture
def messages(monkeypatch):
    # Active-message inserts are on by default over TCP, for items of
    # AM_MIN_ITEM_BYTES and more. Items here are 3000 bytes: have writers
    # (this process and the ones it starts) send them as active messages, as
    # they would send large ones.
    monkeypatch.setenv("DISTORE_AM_MIN_ITEM", "0")


ALL_PATHS = pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)
VIA = {"tcp": "ucx active messages (UCX_TLS=tcp)", "tcp_gets": "ucx (UCX_TLS=tcp)",
       "sm": "cma (same host)", "mapped": "mapped (same host)"}


def expected_via() -> str:
    """How nodes read inserts in this test (the tls and messages fixtures set
    the environment)."""
    if os.environ["UCX_TLS"] == "tcp":
        messages = (os.environ.get("DISTORE_AM_MIN_ITEM") == "0"
                    and os.environ.get("DISTORE_AM_INSERTS") != "0")
        return VIA["tcp" if messages else "tcp_gets"]
    return VIA["mapped" if os.environ.get("DISTORE_LOCAL_MAP") == "1" else "sm"]


# Tests that use tables of their own and look at nothing store-wide (the
# nodes' used bytes, their logs) take `shared_client`, of the module's cluster
# of their read path (conftest's module_clusters); the others a cluster each.


@ALL_PATHS
def test_every_item_arrives_whole_one_per_call_and_batched(shared_client, tls):
    client = shared_client
    client.create_table("whole", capacity=10_000, spec=((ITEM,), "uint8"))
    writer = client.writer(batch_bytes=64 << 10, max_in_flight=3)
    src = items(np.arange(1500))
    keys = [writer.insert("whole", row) for row in src[:500]]  # one per call
    keys.append(writer.insert("whole", src[500:1500]))  # one call, many batches
    writer.flush()
    keys = np.concatenate(keys)
    assert client.table_info("whole")["size"] == 1500 == writer.inserted
    via = set(writer.paths.values())
    assert via == {expected_via()}, via
    learner = client.learner("whole", batch_size=100)
    seen = set()
    for _ in range(60):
        batch = learner.sample()
        assert whole(batch.data).all()
        index = batch.data[:, :8].copy().view(np.uint64).ravel()
        assert np.array_equal(keys[index.astype(np.int64)], batch.keys)  # key <-> content
        seen.update(index.tolist())
    assert len(seen) > 1200
    learner.close()
    writer.close()


def _queue_order(client, max_in_flight: int) -> list:
    client.create_table("q", capacity=5000, spec=((ITEM,), "uint8"),
                        rate_limiter=ds.Queue(5000))
    with client.writer(batch_bytes=8 * ITEM, max_in_flight=max_in_flight) as writer:
        for row in items(np.arange(2000)):
            writer.insert("q", row)
    learner = client.learner("q", batch_size=100)
    got = []
    while len(got) < 2000:
        batch = learner.sample(timeout=10)
        assert whole(batch.data).all()
        got.extend(batch.data[:, :8].copy().view(np.uint64).ravel().tolist())
    learner.close()
    return got


@ALL_PATHS
def test_a_writers_batches_in_flight_to_one_node_keep_their_order(make_cluster, tls):
    # A node answers one connection's inserts in arrival order, so a Queue on
    # one node hands items out exactly as one writer inserted them, with
    # several batches in flight.
    cluster = make_cluster(nodes=1)
    with ds.connect(cluster.address) as client:
        assert _queue_order(client, max_in_flight=4) == list(range(2000))


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_one_batch_in_flight_keeps_a_writers_order_across_nodes(shared_client, tls):
    # Across nodes, batches in flight at once may be registered in either
    # order (docs/semantics.md); max_in_flight=1 keeps the writer's order.
    assert _queue_order(shared_client, max_in_flight=1) == list(range(2000))


@ALL_PATHS
def test_an_item_larger_than_batch_bytes_grows_its_buffer(shared_client, tls):
    client = shared_client
    client.create_table("big", capacity=10, spec=((300_000,), "uint8"))
    data = np.random.default_rng(3).integers(0, 256, (3, 300_000), dtype=np.uint8)
    with client.writer(batch_bytes=64 << 10, max_in_flight=2) as writer:
        keys = writer.insert("big", data)
    batch = client.learner("big", batch_size=12).sample()
    for key, row in zip(batch.keys, batch.data):
        assert np.array_equal(row, data[int(np.flatnonzero(keys == key)[0])])


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_default_batches_hold_eight_large_items_and_explicit_batch_bytes_is_kept(client, tls):
    """Each batch costs milliseconds of CPU whatever its size: by default a
    table of items of megabytes gets batches of 8 (up to 32 MiB), not the
    one or two that 8 MiB holds; a batch_bytes the caller sets is kept."""
    size = 3 << 20  # 8 MiB holds 2
    client.create_table("r2d2", capacity=40, spec=((size,), "uint8"))
    client.create_table("w3", capacity=8, spec=((10 << 20,), "uint8"))
    data = np.random.default_rng(4).integers(0, 256, (16, size), dtype=np.uint8)
    with client.writer() as writer:
        assert writer.batch_bytes == 8 << 20
        keys = [writer.insert("r2d2", row)[0] for row in data]  # one item per call
        writer.flush()
        assert writer.stats.batches == 2 and writer.stats.items == 16
        assert max(b.size for b in writer._pool.buffers) == 8 * size
        writer.insert("w3", np.zeros((3, 10 << 20), np.uint8))  # 3 x 10 MiB fill 32 MiB
        writer.flush()
        assert writer.stats.batches == 3
    with client.writer(batch_bytes=8 << 20) as writer:
        for row in data[:8]:
            writer.insert("r2d2", row)
        writer.flush()
        assert writer.stats.batches == 4  # 2 items each, as asked
        assert max(b.size for b in writer._pool.buffers) == 8 << 20
    batch = client.learner("r2d2", batch_size=16, sample_ahead=1).sample()
    for key, row in zip(batch.keys, batch.data):
        k = int(key)
        if k in keys:
            assert np.array_equal(row, data[keys.index(k)])


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_next_keys_are_the_keys_the_next_inserts_get(shared_client, tls):
    client = shared_client
    client.create_table("k", capacity=100, spec=((ITEM,), "uint8"))
    with client.writer() as writer:
        ahead = writer.next_keys(5)
        assert len(writer.next_keys(0)) == 0 and ahead.dtype == np.uint64
        assert np.array_equal(writer.insert("k", items(np.arange(3))), ahead[:3])
        assert writer.insert("k", items([3])[0])[0] == ahead[3]
        assert np.array_equal(writer.next_keys(1), ahead[4:])
        with pytest.raises(ValueError, match="n must be >= 0"):
            writer.next_keys(-1)


@pytest.mark.parametrize("tls", ["mapped"], indirect=True)
def test_a_slow_writers_items_are_sent_after_max_delay_not_when_the_batch_fills(shared_client,
                                                                              tls):
    client = shared_client
    # One item every 20 ms would take minutes to fill a batch: with max_delay
    # the batch goes at the first insert after 0.1 s, without flush().
    client.create_table("slow", capacity=100, spec=((ITEM,), "uint8"))
    client.create_table("held", capacity=100, spec=((ITEM,), "uint8"))
    slow = client.writer(max_delay=0.1)
    held = client.writer(max_delay=None)
    t0 = time.monotonic()
    for row in items(np.arange(12)):
        slow.insert("slow", row)
        held.insert("held", row)
        time.sleep(0.02)
    assert time.monotonic() - t0 > 0.2
    wait_for(lambda: client.table_info("slow")["size"] >= 5,
             "a batch older than max_delay was not sent at the next insert")
    time.sleep(0.3)
    assert client.table_info("held")["size"] == 0  # waits for a full batch or flush()
    held.flush()
    assert client.table_info("held")["size"] == 12
    slow.flush()
    assert client.table_info("slow")["size"] == 12
    with pytest.raises(ds.ConfigError, match="max_delay"):
        client.writer(max_delay=-1)
    slow.close()
    held.close()


WRITER = textwrap.dedent("""
    import numpy as np, distore_ucx as ds
    ITEM = {item}
    {items}
    c = ds.connect({address!r})
    w = c.writer(batch_bytes={batch_bytes}, max_in_flight=4)
    src = items(np.arange({count}))
    w.insert("t", src[:64]); w.flush()
    print("ready", flush=True)
    i = 0
    while True:
        w.insert("t", src[i % {count}]); i += 1
""")


@ALL_PATHS
def test_a_writer_killed_with_batches_in_flight_leaves_nothing_behind(client, cluster, tls,
                                                                     tmp_path):
    client.create_table("t", capacity=2000, spec=((ITEM,), "uint8"), remover=ds.Fifo())
    for attempt in range(3):  # kill at different moments
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(items=ITEMS_SOURCE, item=ITEM,
                                                 batch_bytes=256 << 10, count=4096,
                                                 address=cluster.address)],
            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.2 + 0.3 * attempt)  # batches in flight at some point
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        # Slots of batches the node was pulling or registering come back.
        wait_for(lambda: node_bytes_match_table(client, "t"),
                 "the nodes hold slots the control plane does not know")
    assert all(n["alive"] for n in client.status()["nodes"])
    learner = client.learner("t", batch_size=200)
    for _ in range(10):
        assert whole(learner.sample().data).all()  # nothing half-written is sampled
    learner.close()
    with client.writer() as w:  # and the nodes take inserts as before
        w.insert("t", items(np.arange(10)))


BIG = 2 * AM_MIN_ITEM_BYTES  # sent as active messages by default over TCP


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_writers_killed_mid_batch_sending_messages_leave_nothing_behind(client, cluster, tls,
                                                                       tmp_path):
    # Over TCP, items this large go as active messages over the node's insert
    # listener by default: writers SIGKILLed at random moments, most of them
    # with rendezvous transfers under way, never crash or wedge the node nor
    # leave it holding slots; nothing half-written is ever sampled.
    client.create_table("t", capacity=200, spec=((BIG,), "uint8"), remover=ds.Fifo())
    rng = np.random.default_rng(34)
    for _ in range(int(os.environ.get("DISTORE_WRITER_KILLS", "8"))):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(items=ITEMS_SOURCE, item=BIG,
                                                 batch_bytes=8 * BIG, count=96,
                                                 address=cluster.address)],
            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        wait_for(lambda: node_bytes_match_table(client, "t"),
                 "the nodes hold slots the control plane does not know", timeout=30.0)
        learner = client.learner("t", batch_size=16)
        assert whole(np.asarray(learner.sample().data).reshape(16, BIG)).all()
        learner.close()
    assert all(n["alive"] for n in client.status()["nodes"])
    with client.writer() as w:  # the nodes take inserts as before, by message
        w.insert("t", items(np.arange(1000, 1064), BIG))
    assert set(w.paths.values()) == {VIA["tcp"]}
    batch = client.learner("t", batch_size=64).sample()
    assert whole(np.asarray(batch.data).reshape(64, BIG)).all()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_node_whose_insert_listener_cannot_be_reached_reads_batches_with_gets(
        messages, client, tls, monkeypatch, caplog):
    # As behind a firewall that lets only the node's RPC port through: the
    # writer says so once and the node reads its batches with gets.
    client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nobody listens there once closed
    listed = client.nodes

    def nodes():
        return [dict(n, insert_port=closed) for n in listed()]

    monkeypatch.setattr(client, "nodes", nodes)
    with caplog.at_level("INFO", "distore_ucx.client.writer.send"):
        with client.writer(batch_bytes=64 << 10) as writer:
            writer.insert("t", items(np.arange(300)))
    assert set(writer.paths.values()) == {VIA["tcp_gets"]}
    warned = [r for r in caplog.records if "one-sided gets" in r.getMessage()]
    assert len(warned) == len(client.nodes()), [r.getMessage() for r in warned]
    assert all(r.levelname == "WARNING" and str(closed) in r.getMessage() for r in warned)
    assert whole(client.learner("t", batch_size=100).sample().data).all()


def node_logs(cluster) -> str:
    """Every storage node's log of `cluster` so far."""
    return "".join(open(os.path.join(cluster.log_dir, name)).read()
                   for name in sorted(os.listdir(cluster.log_dir))
                   if name.startswith("node") and name.endswith(".log"))


def descriptor(region, keys, **over):
    n = len(keys)
    f = {"table": "t", "slot_size": ds.TableSpec.parse(((ITEM,), "uint8")).slot_size,
             "item_bytes": ITEM, "keys": keys, "priorities": np.ones(n),
             "offsets": np.arange(n, dtype=np.uint64) * np.uint64(ITEM),
             "lengths": np.full(n, ITEM, np.uint64), "worker_address": over.pop("worker_address"),
             "rkey": region.pack_rkey(), "base": region.address, "size": region.size,
             "pid": os.getpid(), "host_id": host_id(), "timeout": 5.0}
    f.update(over)
    return {k: v for k, v in f.items() if v is not None}


def test_malformed_insert_descriptors_get_an_error_and_the_node_serves_on(client, tls):
    client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
    runtime = client.runtime
    region = _native.MemoryRegion.write_protected(runtime.region_owner, 1 << 20)
    region.view()[: 4 * ITEM] = items(np.arange(4)).ravel()
    node = client.nodes()[0]
    conn = rpc.RpcClient(node["address"], 10.0, name="node", token=client.token)
    me = runtime.address
    keys = np.arange(1, 5, dtype=np.uint64) + np.uint64(1 << 60)
    bad = {
        "lengths": {"lengths": np.full(4, ITEM - 1, np.uint64)},
        "outside": {"offsets": np.array([0, 1, 2, 1 << 20], np.uint64) * np.uint64(ITEM)},
        "overlapping the end": {"offsets": np.full(4, (1 << 20) - 100, np.uint64)},
        "wrapping": {"base": 2**64 - 4096, "size": 4096},
        "no such rkey": {"rkey": b"DSRK" + os.urandom(40), "pid": None},
        "another process": {"pid": client.nodes()[0]["pid"], "rkey": b"garbage"},
        "unmapped source": {"base": 4096, "size": 1 << 20, "rkey": b"garbage"},
    }
    for name, over in bad.items():
        with pytest.raises((ds.DistoreError, RemoteError)) as info:
            conn.call("insert", **descriptor(region, keys, worker_address=me, **over))
        assert str(info.value), name
    assert client.table_info("t")["size"] == 0  # none of them stored anything
    wait_for(lambda: node_bytes_match_table(client, "t"), "a refused insert kept its slots")
    # A well-formed descriptor on the same connection still works.
    reply = conn.call("insert", **descriptor(region, keys, worker_address=me))
    assert reply["n"] == 4
    conn.close()
    batch = client.learner("t", batch_size=8).sample()
    assert whole(batch.data).all()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_insert_messages_that_do_not_match_their_descriptor_fail_and_the_node_serves_on(
        messages, client, cluster, tls):
    # Over TCP writers send items as UCX active messages headed by a batch
    # token that their descriptor names (storage/pulls.py).
    client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
    runtime = client.runtime
    region = _native.MemoryRegion.write_protected(runtime.region_owner, 1 << 20)
    region.view()[: 4 * ITEM] = items(np.arange(4)).ravel()
    node = client.nodes()[0]
    assert node.get("insert_port"), "a node over TCP takes inserts as active messages"
    host = node["address"].rpartition(":")[0]
    ep = runtime.listener_endpoint(host, node["insert_port"], "node", cap=node["am_cap"],
                                   auth_id=AM_INSERT_AUTH_ID)  # as a writer proves it may send
    conn = rpc.RpcClient(node["address"], 10.0, name="node", token=client.token)
    keys = np.arange(1, 5, dtype=np.uint64) + np.uint64(1 << 60)
    offsets = np.arange(4, dtype=np.uint64) * np.uint64(ITEM)
    # Messages one byte shorter than the descriptor's lengths.
    _native.am_send(ep, region, AM_INSERT_ID, 77, offsets, np.full(4, ITEM - 1, np.uint64))
    with pytest.raises((ds.DistoreError, RemoteError), match="could not read 4 of 4 items"):
        conn.call("insert", **descriptor(region, keys, worker_address=runtime.address,
                                         am_token=77))
    assert client.table_info("t")["size"] == 0
    wait_for(lambda: node_bytes_match_table(client, "t"), "a refused insert kept its slots")
    # The node's operator sees it too, not only the writer.
    wait_for(lambda: "an insert of 4 items into 't'" in node_logs(cluster),
             "the node did not log the failed insert")
    assert "could not read 4 of 4 items" in node_logs(cluster)
    # The same items under another token, whole: stored, and read back whole.
    _native.am_send(ep, region, AM_INSERT_ID, 78, offsets, np.full(4, ITEM, np.uint64))
    reply = conn.call("insert", **descriptor(region, keys, worker_address=runtime.address,
                                             am_token=78))
    assert reply["n"] == 4 and reply["via"] == VIA["tcp"]
    conn.close()
    batch = client.learner("t", batch_size=8).sample()
    assert whole(batch.data).all()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_small_items_go_by_gets_and_large_ones_as_messages_when_on(messages, client, tls,
                                                                    monkeypatch):
    monkeypatch.delenv("DISTORE_AM_MIN_ITEM")
    large = AM_MIN_ITEM_BYTES
    client.create_table("small", capacity=1000, spec=((ITEM,), "uint8"))
    client.create_table("large", capacity=100, spec=((large,), "uint8"))
    with client.writer() as writer:
        writer.insert("small", items(np.arange(100)))
        writer.flush()
        assert set(writer.paths.values()) == {"ucx (UCX_TLS=tcp)"}
    with client.writer() as writer:
        data = np.random.default_rng(1).integers(0, 255, (20, large), np.uint8)
        writer.insert("large", data)
        writer.flush()
        assert set(writer.paths.values()) == {VIA["tcp"]}
    batch = client.learner("large", batch_size=20).sample()
    got = {bytes(row) for row in np.asarray(batch.data).reshape(20, large)}
    assert got <= {bytes(row) for row in data}


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["default", "on", "off"])
def test_am_inserts_are_on_unless_turned_off(messages, make_cluster, tls, monkeypatch,
                                             setting):
    if setting is None:  # on unless turned off
        monkeypatch.delenv("DISTORE_AM_INSERTS", raising=False)
    else:
        monkeypatch.setenv("DISTORE_AM_INSERTS", setting)  # nodes and writer
    cluster = make_cluster(nodes=1)
    with ds.connect(cluster.address) as client:
        node = client.nodes()[0]
        assert "insert_address" not in node  # the old advertisement: old writers use gets
        if setting == "0":
            assert "insert_port" not in node
        else:
            assert 0 < node["insert_port"] < 65536
        client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
        with client.writer() as writer:
            writer.insert("t", items(np.arange(100)))
        assert set(writer.paths.values()) == {expected_via()}
        assert whole(client.learner("t", batch_size=50).sample().data).all()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
@pytest.mark.parametrize("node_runs", ["1", "0"], ids=["node-runs", "node-no-runs"])
def test_small_items_go_in_runs_to_nodes_that_take_them(messages, make_cluster, tls,
                                                        monkeypatch, node_runs):
    # A node that takes runs says how large (insert_run_bytes); the writer
    # then sends several items a message, and one a message to a node that
    # does not (DISTORE_AM_INSERT_RUNS=0 there): every item whole either way.
    monkeypatch.setenv("DISTORE_AM_INSERT_RUNS", node_runs)
    cluster = make_cluster(nodes=1)
    monkeypatch.delenv("DISTORE_AM_INSERT_RUNS")  # the writer: runs on (the default)
    with ds.connect(cluster.address) as client:
        node = client.nodes()[0]
        if node_runs == "1":
            assert node["insert_run_bytes"] == _native.AmInbox.run_bytes
        else:
            assert "insert_run_bytes" not in node and node["insert_port"]
        client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
        with client.writer() as writer:
            for i in range(300):  # one per call, then batched: runs across a batch's items
                writer.insert("t", items(np.array([i]))[0])
            writer.insert("t", items(np.arange(300, 700)))
            writer.flush()
            assert set(writer.paths.values()) == {VIA["tcp"]}
        assert client.table_info("t")["size"] == 700
        seen = set()
        learner = client.learner("t", batch_size=100)
        for _ in range(30):
            rows = np.asarray(learner.sample().data)
            assert whole(rows).all()
            seen |= set(rows[:, :8].copy().view(np.uint64).ravel().tolist())
        assert len(seen) > 600  # most of the 700 items sampled, each whole


@pytest.mark.parametrize("tls", ["mapped"], indirect=True)
def test_malformed_mapped_descriptors_get_an_error_and_the_node_serves_on(client, tls):
    """Descriptors naming a handed-over staging buffer: unknown tickets,
    ranges outside the mapping, a claimed size larger than what was handed,
    a file that is not a sealed memfd: an error each, nothing stored."""
    client.create_table("t", capacity=1000, spec=((ITEM,), "uint8"))
    region = _native.MemoryRegion.write_protected(client.runtime.region_owner, 1 << 20)
    region.view()[: 4 * ITEM] = items(np.arange(4)).ravel()
    node = client.nodes()[0]
    who = f"node {node['node_id']}"

    def hand(fd, size, ticket):
        send_staging(node["local_socket"], fd, size, ticket, client.token, node["pid"], who)

    with pytest.raises(ds.ConnectionFailed, match="not to the node"):
        # Told to expect another pid than the socket's owner: nothing is sent.
        send_staging(node["local_socket"], region.share_fd, region.size, os.urandom(16),
                     client.token, os.getpid(), who)
    plain = os.memfd_create("not-sealed")
    os.ftruncate(plain, 1 << 20)
    with pytest.raises(ds.ConnectionFailed, match="sealed"):
        hand(plain, 1 << 20, os.urandom(16))  # the node refuses what could shrink under it
    os.close(plain)
    with pytest.raises(ds.ConnectionFailed, match="smaller"):
        hand(region.share_fd, 4 << 20, os.urandom(16))
    conn = rpc.RpcClient(node["address"], 10.0, name="node", token=client.token)
    me = client.runtime.address
    keys = np.arange(1, 5, dtype=np.uint64) + np.uint64(1 << 60)
    ticket = os.urandom(16)
    bad = {
        "never handed": {"staging": os.urandom(16)},
        "larger than handed": {"staging": ticket, "size": 2 << 20},
        "outside": {"staging": ticket,
                    "offsets": np.array([0, 1, 2, 1 << 20], np.uint64) * np.uint64(ITEM)},
        "overlapping the end": {"staging": ticket,
                                "offsets": np.full(4, (1 << 20) - 100, np.uint64)},
        "lengths": {"staging": ticket, "lengths": np.full(4, ITEM + 1, np.uint64)},
    }
    for name, over in bad.items():
        if over.get("staging") == ticket:  # each claim binds the ticket; hand it anew
            ticket = over["staging"] = os.urandom(16)
            hand(region.share_fd, region.size, ticket)
        with pytest.raises((ds.DistoreError, RemoteError)) as info:
            conn.call("insert", **descriptor(region, keys, worker_address=me, **over))
        assert str(info.value), name
    assert client.table_info("t")["size"] == 0  # none of them stored anything
    wait_for(lambda: node_bytes_match_table(client, "t"), "a refused insert kept its slots")
    ticket = os.urandom(16)
    hand(region.share_fd, region.size, ticket)
    reply = conn.call("insert", **descriptor(region, keys, worker_address=me, staging=ticket))
    assert reply["n"] == 4 and reply["via"] == VIA["mapped"]
    # The ticket is bound to this connection now: another one cannot use it.
    other = rpc.RpcClient(node["address"], 10.0, name="node", token=client.token)
    with pytest.raises(ds.DistoreError, match="never handed"):
        other.call("insert", **descriptor(region, keys + np.uint64(10), worker_address=me,
                                          staging=ticket))
    other.close()
    conn.close()
    batch = client.learner("t", batch_size=8).sample()
    assert whole(batch.data).all()


def test_a_writer_held_by_a_rate_limiter_fails_at_its_timeout_with_exact_keys(shared_client,
                                                                             tls):
    client = shared_client
    client.create_table("limited", capacity=10_000, spec=((ITEM,), "uint8"),
                        rate_limiter=ds.SampleToInsertRatio(samples_per_insert=1.0,
                                                            min_size_to_sample=1,
                                                            error_buffer=100))
    writer = client.writer(max_items=40, max_in_flight=3, timeout=2.0)
    all_keys = []
    t0 = time.monotonic()
    with pytest.raises(ds.RateLimiterTimeout) as info:
        for i in range(100):
            all_keys.append(writer.insert("limited", items(np.arange(20 * i, 20 * i + 20))))
        writer.flush()
    waited = time.monotonic() - t0
    exc = info.value
    assert 2.0 <= waited < 3.5, waited  # one timeout, not one per batch in flight
    issued = np.concatenate(all_keys + [exc.unstored_keys])
    stored = writer.inserted
    size = client.table_info("limited")["size"]
    assert size == stored  # every acknowledged item, and only those, is in the table
    assert exc.not_stored == len(exc.unstored_keys) > 0
    assert not set(exc.stored_keys.tolist()) & set(exc.unstored_keys.tolist())
    # The keys not stored are exactly those issued and not acknowledged.
    assert len(set(issued.tolist())) == stored + exc.not_stored
    assert f"{exc.not_stored} items not stored" in str(exc)
    assert "deadlock" in str(exc)
    # Not stored means not sampleable: sample everything there is.
    learner = client.learner("limited", batch_size=size)
    batch = learner.sample()
    assert not set(batch.keys.tolist()) & set(exc.unstored_keys.tolist())
    learner.close()
    writer.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_writer_held_by_a_rate_limiter_says_so_while_it_waits(shared_client, tls, monkeypatch,
                                                                caplog):
    client = shared_client
    # A learner that stopped sampling leaves the writer's batches held by the
    # table's rate limiter: the writer says why it waits, once, instead of
    # sitting silent in flush() (or at exit) for its whole timeout.
    monkeypatch.setattr(writer_in_flight, "WAIT_NOTICE", 0.5)
    client.create_table("limited_notice", capacity=10_000, spec=((ITEM,), "uint8"),
                        rate_limiter=ds.SampleToInsertRatio(samples_per_insert=1.0,
                                                            min_size_to_sample=1,
                                                            error_buffer=100))
    writer = client.writer(max_items=40, max_in_flight=3, timeout=2.0)
    with caplog.at_level(logging.WARNING, logger="distore_ucx.client.writer.in_flight"):
        with pytest.raises(ds.RateLimiterTimeout):
            for i in range(20):
                writer.insert("limited_notice", items(np.arange(40 * i, 40 * i + 40)))
            writer.flush()
    notices = [r.getMessage() for r in caplog.records if "have waited" in r.getMessage()]
    assert len(notices) == 1, notices
    assert "takes no more inserts until it is sampled" in notices[0], notices[0]
    assert "are its learners still sampling?" in notices[0]
    assert "timeout (2 s)" in notices[0]
    writer.close()


@ALL_PATHS
def test_batches_in_flight_to_a_node_that_dies_are_resent_once(make_cluster, tls):
    _resent_once(make_cluster)


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_batches_sent_as_messages_to_a_node_that_dies_are_resent_once(messages, make_cluster,
                                                                      tls):
    # Over the dead node's insert listener: posting fails, or its
    # acknowledgement never comes; either way the batch goes elsewhere.
    assert _resent_once(make_cluster) == {VIA["tcp"]}


def _resent_once(make_cluster) -> set[str]:
    """Kill one of two nodes with a writer's batches in flight; the paths
    the writer's batches took to the survivor."""
    cluster = make_cluster(nodes=2, arena_bytes=64 << 20)
    client = ds.connect(cluster.address)
    # Each item sampled exactly once: sampling everything lists the table's keys.
    client.create_table("t", capacity=20_000, spec=((ITEM,), "uint8"),
                        rate_limiter=ds.Queue(20_000))
    writer = client.writer(batch_bytes=32 * ITEM, max_in_flight=4)
    first = writer.insert("t", items(np.arange(2000)))
    in_flight = [b.all_keys() for _, b, _, _ in writer._flight.queue]
    assert in_flight  # batches were on their way when the node died
    cluster.kill_node(0)  # SIGKILL
    second = writer.insert("t", items(np.arange(2000, 4000)))
    writer.flush()  # no error: what the dead node had in flight went elsewhere
    size = client.table_info("t")["size"]
    learner = client.learner("t", batch_size=size)
    batch = learner.sample()
    got = batch.keys.tolist()
    assert len(set(got)) == len(got) == size  # nothing doubled
    assert whole(batch.data).all()
    assert set(second.tolist()) <= set(got)  # nothing sent after the death lost
    # Batches in flight at the death are there, unless the dead node had
    # acknowledged them (then they went with it, as its stored items did).
    lost = set(first.tolist()) - set(got)
    for keys in in_flight:
        k = set(keys.tolist())
        assert k <= set(got) or k <= lost
    learner.close()
    paths = set(writer.paths.values())
    writer.close()
    client.close()
    return paths
