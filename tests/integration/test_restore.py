"""Control-plane crashes and restarts: checkpoints, --restore, nodes re-joining,
clients carrying on. Real processes over tcp and sm."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading

import numpy as np
import pytest
from helpers import check_keyed, keyed_items, wait_for

import distore_ucx as ds
from distore_ucx.control import checkpoint

SPEC = {"obs": ((512,), "uint8"), "key": ((), "uint64")}


def items(keys_from: int, n: int) -> dict:
    return keyed_items(keys_from, n, 512, mult=5)


def check(batch) -> None:
    check_keyed(batch, 512, mult=5)


# The control plane never loads UCX: the transport of its nodes plays no part in
# refusing a checkpoint at start, so the tests of refusals alone run over tcp.
CONTROL_PLANE_ONLY = pytest.mark.parametrize("tls", ["tcp"], indirect=True)


@pytest.fixture
def ckpt(tmp_path):
    return str(tmp_path / "store.ckpt")


def test_sigkilled_control_plane_restored_gets_items_and_priorities_back(make_cluster, ckpt,
                                                                        tls):
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, restore_grace=30)
    client = ds.connect(cluster.address)
    client.create_table("per", capacity=10_000, spec=SPEC, sampler=ds.Prioritized(1.0))
    writer = client.writer(max_items=100)
    keys = writer.insert("per", items(0, 600), priority=1.0)
    writer.flush()
    learner = client.learner("per", batch_size=64)
    check(learner.sample())
    learner.update_priorities(keys[:20], np.full(20, 40.0), wait=True)  # in the checkpoint
    nodes_before = sorted(n["node_id"] for n in client.status()["nodes"])
    assert client.checkpoint()["items"] == 600
    # After the checkpoint: this update is lost with the crash, these inserts are not.
    learner.update_priorities(keys[20:40], np.full(20, 40.0))
    late = writer.insert("per", items(600, 100), priority=3.0)
    writer.flush()

    cluster.kill_control()  # SIGKILL: nothing written on the way out
    # An insert while there is no control plane waits for the new one.
    writer.insert("per", items(700, 50), priority=3.0)
    flushed = threading.Thread(target=writer.flush)
    flushed.start()
    cluster.start_control(restore=True)

    wait_for(lambda: client.table_info("per")["size"] >= 750, 10, "every item back")
    flushed.join(30)
    assert not flushed.is_alive()
    info = client.table_info("per")
    assert info["size"] == 750 and info["awaiting_restore"] == 0
    st = client.status()
    assert sorted(n["node_id"] for n in st["nodes"]) == nodes_before  # re-joined, same ids
    assert all(n["alive"] for n in st["nodes"])

    # Priorities are the checkpoint's; items newer than it keep their insert priority.
    expected = {int(k): 1.0 for k in keys}
    expected.update({int(k): 40.0 for k in keys[:20]})
    expected.update({int(k): 3.0 for k in late})
    total = sum(expected.values()) + 50 * 3.0
    seen = 0
    check(learner.sample())  # asked for before the crash (prefetched): old probabilities
    for _ in range(30):  # the learner of before the crash carries on
        batch = learner.sample(timeout=10)
        check(batch)
        for k, p in zip(batch.keys.tolist(), batch.probabilities.tolist()):
            assert p == pytest.approx(expected.get(k, 3.0) / total, rel=1e-9)
            seen += 1
    assert seen == 30 * 64
    # Keys stay unique: a writer registered now gets an id no earlier run gave.
    new_writer = client.writer()
    assert new_writer.writer_id > writer.writer_id
    new_keys = new_writer.insert("per", items(800, 10))
    new_writer.flush()
    assert not set(new_keys.tolist()) & set(expected)
    assert client.table_info("per")["size"] == 760
    learner.close()
    client.close()


def test_periodic_and_shutdown_checkpoints(make_cluster, ckpt, tls):
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0.3, nodes=1)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=1000, spec=SPEC, sampler=ds.MaxHeap())
    with client.writer() as writer:
        keys = writer.insert("t", items(0, 100))
    first = wait_for(lambda: _items_in(ckpt) == 100 and _created(ckpt), 5, "a periodic checkpoint")
    wait_for(lambda: _created(ckpt) > first, 5, "the next periodic checkpoint")
    client.learner("t", batch_size=1).update_priorities(keys[7:8], [9.0], wait=True)
    st = client.status()["checkpoint"]
    assert st["path"] == ckpt and st["why"] in ("periodic", "on demand")

    assert cluster.kill_control(signal.SIGTERM) == 0  # writes a last checkpoint
    image = checkpoint.read(ckpt).tables[0]
    assert image.priorities[list(image.keys).index(keys[7])] == 9.0
    cluster.start_control(restore=True)
    learner = client.learner("t", batch_size=1)
    wait_for(lambda: client.table_info("t")["size"] == 100, 10, "items back")
    batch = learner.sample()
    assert batch.keys[0] == keys[7]  # the max-heap's top, from the checkpoint's priority
    learner.close()
    client.close()


def test_restart_without_restore_starts_afresh_and_nodes_discard_their_items(make_cluster,
                                                                             tls):
    cluster = make_cluster()
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=1000, spec=SPEC)
    with client.writer() as writer:
        writer.insert("t", items(0, 200))
    cluster.restart_control(restore=False)

    def discarded() -> int:
        said = [re.findall(r"(\d+) items of table 't' on node \S+ are discarded", n.log_tail())
                for n in cluster.nodes]
        return sum(int(x) for found in said for x in found)

    wait_for(lambda: discarded() == 200, 10, "nodes saying they discarded all 200 items")

    def rejoined_empty() -> bool:
        nodes = client.status()["nodes"]
        return len(nodes) == 2 and all(n["alive"] and n["used_bytes"] == 0 for n in nodes)

    wait_for(rejoined_empty, 10, "both nodes re-joined, empty",
             state=lambda: client.status()["nodes"])
    with pytest.raises(ds.TableNotFound):
        client.table_info("t")
    client.create_table("t", capacity=1000, spec=SPEC)  # and it works as a new store
    with client.writer() as writer:
        writer.insert("t", items(0, 50))
    learner = client.learner("t", batch_size=16)
    for _ in range(5):
        check(learner.sample())
    learner.close()
    client.close()


def test_items_of_a_node_lost_while_the_control_plane_was_down_are_dropped(make_cluster, ckpt,
                                                                          tls):
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, restore_grace=1.0)
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=1000, spec=SPEC)
    with client.writer(max_items=20) as writer:
        writer.insert("t", items(0, 200))
    survivor = cluster.nodes[1].info["node_id"]
    kept = next(n["used_bytes"] for n in client.status()["nodes"] if n["node_id"] == survivor)
    client.checkpoint()
    cluster.kill_control()
    cluster.kill_node(0)
    cluster.start_control(restore=True)
    slot = client.table_info("t")["slot_size"]
    wait_for(lambda: client.table_info("t")["awaiting_restore"] == 0, 10, "the restore to end")
    assert client.table_info("t")["size"] == kept // slot
    assert "were not re-sent by any node" in cluster.control.log_tail()
    learner = client.learner("t", batch_size=32)
    for _ in range(10):
        check(learner.sample())
    learner.close()
    client.close()


@CONTROL_PLANE_ONLY
def test_restore_refuses_a_corrupt_checkpoint_and_says_why(make_cluster, ckpt, tls):
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, nodes=1)
    client = ds.connect(cluster.address)
    client.checkpoint()
    client.close()
    with open(ckpt, "r+b") as fh:
        fh.seek(-3, 2)
        fh.write(b"xyz")
    cluster.kill_control()
    with pytest.raises(ds.ConnectionFailed, match="corrupt"):
        cluster.start_control(restore=True)


def _items_in(path: str) -> int:
    try:
        return checkpoint.read(path).items
    except ds.CheckpointError:
        return -1


def _created(path: str) -> float:
    try:
        return checkpoint.read(path).created
    except ds.CheckpointError:
        return 0.0


# -- restores that would mix up stores (issue 33 item 5) ----------------------

@CONTROL_PLANE_ONLY
def test_a_checkpoint_without_its_id_file_is_refused(make_cluster, ckpt, tls):
    # Before: it started silently and a new writer reused id 1 (duplicate keys).
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, nodes=1)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=100, spec=SPEC)
        client.writer().insert("t", items(0, 10))
        client.checkpoint()
    cluster.kill_control()
    os.unlink(ckpt + ".ids")
    with pytest.raises(ds.ConnectionFailed, match="has no id file"):
        cluster.start_control(restore=True)
    assert cluster.control.log_tail().count("has no id file") >= 1
    assert "Traceback" not in cluster.control.log_tail()


def test_a_checkpoint_of_another_store_is_refused(make_cluster, tmp_path, tls):
    # Before: another store's checkpoint was accepted and the live node's
    # items were discarded, with only log lines.
    mine = str(tmp_path / "a.ckpt")
    cluster = make_cluster(checkpoint=mine, checkpoint_interval=0, nodes=1)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=2000, spec=SPEC)
        w = client.writer()
        w.insert("t", items(0, 1000))
        w.flush()
        client.checkpoint()
    other = make_cluster(checkpoint=str(tmp_path / "b.ckpt"), checkpoint_interval=0, nodes=0)
    with ds.connect(other.address) as client:
        client.create_table("t", capacity=2000, spec=SPEC)
        client.checkpoint()
    cluster.kill_control()
    saved = {ext: open(mine + ext, "rb").read() for ext in ("", ".ids")}

    # Its checkpoint beside our id file: refused at start.
    shutil.copy(str(tmp_path / "b.ckpt"), mine)
    with pytest.raises(ds.ConnectionFailed, match="is a checkpoint of store"):
        cluster.start_control(restore=True)

    # Its checkpoint and id file both: it starts as that store, and our node,
    # re-joining with our items, is refused and keeps them.
    shutil.copy(str(tmp_path / "b.ckpt.ids"), mine + ".ids")
    cluster.start_control(restore=True)
    wait_for(lambda: "refused, its items kept" in cluster.control.log_tail(1000), 60,
             "the node of another store to be refused")
    with ds.connect(cluster.address) as client:
        assert client.table_info("t")["size"] == 0
    cluster.kill_control()

    # Our own store back: the node re-joins with all 1,000 items.
    for ext, data in saved.items():
        with open(mine + ext, "wb") as fh:
            fh.write(data)
    cluster.start_control(restore=True)
    with ds.connect(cluster.address) as client:
        wait_for(lambda: client.table_info("t")["size"] == 1000, 60, "our items back")
        with client.learner("t", batch_size=32) as learner:
            check(learner.sample(timeout=10))


@CONTROL_PLANE_ONLY
def test_a_crafted_checkpoint_with_nan_priorities_is_refused(make_cluster, ckpt, tls):
    # Before: a valid checksum over NaN priorities gave NaN probabilities.
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, nodes=1)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=100, spec=SPEC, sampler=ds.Prioritized(1.0))
        w = client.writer()
        w.insert("t", items(0, 10))
        w.flush()
        client.checkpoint()
    cluster.kill_control()
    image = checkpoint.read(ckpt)
    image.tables[0].priorities[:] = np.nan
    checkpoint.write(ckpt, image)
    with pytest.raises(ds.ConnectionFailed, match="not finite"):
        cluster.start_control(restore=True)


# -- restores of a full table (issue 31 item 11) -------------------------------

def _restoring(client) -> bool:
    return client.status()["restoring_s"] is not None


def test_a_restore_ends_once_every_node_has_resent_not_at_the_grace(make_cluster, ckpt, tls):
    # Before: 1,000 checkpointed items evicted after the checkpoint (their
    # nodes freed them) were awaited for the whole grace, "restoring ... 50%"
    # sat there, and a checkpoint taken meanwhile held 3,000 items of a
    # capacity-2,000 table.
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, restore_grace=60,
                           log_level="INFO")
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=2000, spec=SPEC)
    # One batch in flight: FIFO order is the order batches are registered, so
    # the evicted ones are exactly the first 1,000 keys (with several in
    # flight, batches of two nodes may register out of key order).
    with client.writer(max_items=200, max_in_flight=1) as writer:
        old = writer.insert("t", items(0, 2000))
        writer.flush()
        assert client.checkpoint()["items"] == 2000
        new = writer.insert("t", items(2000, 1000))  # evicts the oldest 1,000 checkpointed
    assert client.table_info("t")["size"] == 2000
    cluster.restart_control(restore=True)
    wait_for(lambda: not _restoring(client), 15, "the restore to end (its grace is 60 s)",
             state=lambda: (client.status()["restoring_s"], client.table_info("t")))
    info = client.table_info("t")
    assert info["size"] == 2000 and info["awaiting_restore"] == 0
    log = cluster.control.log_tail()
    assert "every node re-sent its items" in log
    assert client.checkpoint()["items"] == 2000
    # None of the evicted ones came back.
    assert set(checkpoint.read(ckpt).tables[0].keys.tolist()) == set(old[1000:].tolist()) | set(
        new.tolist())
    with client.learner("t", batch_size=32) as learner:
        batch = learner.sample(timeout=10)
        check(batch)
        assert (batch.data["key"] >= 1000).all()
    client.close()


def test_a_checkpoint_taken_during_a_restore_holds_at_most_the_capacity(make_cluster, ckpt,
                                                                        tls):
    # Before: live items plus every checkpointed item not re-sent yet, with
    # no cap (the 2,688 items in a capacity-2,000 table).
    cluster = make_cluster(checkpoint=ckpt, checkpoint_interval=0, restore_grace=60,
                           log_level="INFO")
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=2000, spec=SPEC)
    with client.writer(max_items=100) as writer:
        writer.insert("t", items(0, 2000))
    lost = cluster.nodes[0].info["node_id"]
    client.checkpoint()
    cluster.kill_control()
    cluster.kill_node(0)  # its checkpointed items never come back: the restore goes on
    cluster.start_control(restore=True)
    wait_for(lambda: client.table_info("t")["size"] > 0, 15, "the live node's items back")
    with client.writer(max_items=100) as writer:
        new = writer.insert("t", items(5000, 2000))  # fills the table with new items
    info = client.table_info("t")
    assert _restoring(client) and info["size"] == 2000 and info["awaiting_restore"] > 0
    assert client.checkpoint()["items"] == 2000
    image = checkpoint.read(ckpt).tables[0]
    assert sorted(image.keys.tolist()) == sorted(new.tolist())  # FIFO: the newest stay
    wait_for(lambda: re.search(rf"waiting for node {lost}\b", cluster.control.log_tail()), 15,
             "the progress line to name the node it waits for",
             state=lambda: cluster.control.log_tail()[-2000:])
    client.close()
