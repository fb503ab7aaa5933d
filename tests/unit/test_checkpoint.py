"""Checkpoints: the file format, the ids that never repeat, and what a
restored table takes back from the nodes."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from distore_ucx.control import checkpoint
from distore_ucx.control.checkpoint import IdState, Image
from distore_ucx.control.restore import Restore
from distore_ucx.control.tables import LIVE, Table
from distore_ucx.errors import CheckpointError
from distore_ucx.rate_limiters import SampleToInsertRatio
from distore_ucx.selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Uniform
from distore_ucx.spec import TableSpec
from distore_ucx.table_definition import TableDefinition

SPEC = TableSpec.parse(((16,), "uint8"))
SLOT = np.uint64(SPEC.slot_size)
MAGIC = len(checkpoint.MAGIC)


def make(sampler=None, remover=None, capacity=1000, **kw) -> Table:
    return Table.make("t", capacity, SPEC, sampler or Prioritized(1.0), remover or Fifo(), seed=7,
                      **kw)


def fill(table: Table, keys, node=1, priorities=None) -> None:
    keys = np.asarray(keys, np.uint64)
    prios = np.ones(len(keys)) if priorities is None else np.asarray(priorities, np.float64)
    table.add(node, keys, keys * SLOT, np.arange(1, len(keys) + 1, dtype=np.uint64), prios)


def live(table: Table) -> dict[int, tuple[float, int]]:
    recs = np.flatnonzero(table.store.state == LIVE)
    return dict(zip(table.store.keys(recs).tolist(),
                    zip(table.core.priorities(recs).tolist(),
                        table.core.times_sampled(recs).tolist())))


def resend(table: Table, keys, node=2, priority=0.5):
    """A node re-sending items it holds at the slots `keys * SLOT`."""
    keys = np.asarray(keys, np.uint64)
    return table.restore_items(node, keys, keys * SLOT, np.arange(len(keys), dtype=np.uint64),
                               np.full(len(keys), priority))


# -- the file -------------------------------------------------------------

def test_image_survives_a_write_and_read(tmp_path):
    t = make(max_times_sampled=3)
    fill(t, np.arange(100, 150), priorities=np.arange(1, 51))
    t.unlease(t.sample(20)[0])
    path = str(tmp_path / "ck")
    image = Image([t.image()], incarnation=4)
    size = checkpoint.write(path, image)
    assert size == os.path.getsize(path)
    back = checkpoint.read(path)
    assert back.incarnation == 4 and back.items == len(t.image().keys)
    a, b = image.tables[0], back.tables[0]
    assert a.definition == b.definition
    assert (a.inserts, a.samples, a.deletes, a.next_seq) == (b.inserts, b.samples, b.deletes,
                                                             b.next_seq)
    for name in ("keys", "priorities", "times_sampled", "sequences", "retired"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-7], "truncated"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "corrupt"),
    (lambda d: b"something else" + d, "not a distore checkpoint"),
    (lambda d: d[:MAGIC] + (99).to_bytes(4, "little") + d[MAGIC + 4:], "format version 99"),
])
def test_damaged_checkpoints_are_refused_with_the_reason(tmp_path, damage, message):
    path = str(tmp_path / "ck")
    t = make()
    fill(t, range(10))
    checkpoint.write(path, Image([t.image()]))
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(damage(data))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.read(path)


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path):
    path = str(tmp_path / "ck")
    t = make()
    fill(t, range(10))
    checkpoint.write(path, Image([t.image()]))
    before = open(path, "rb").read()
    os.mkdir(f"{path}.tmp{os.getpid()}")  # the temporary file cannot be created
    fill(t, range(10, 20))
    with pytest.raises(CheckpointError, match="previous one is intact"):
        checkpoint.write(path, Image([t.image()]))
    assert open(path, "rb").read() == before
    assert len(checkpoint.read(path).tables[0].keys) == 10


# -- ids ------------------------------------------------------------------

def test_ids_never_repeat_across_restarts(tmp_path):
    path = str(tmp_path / "ck.ids")
    first = IdState(path)
    writers = [first.writer_id() for _ in range(3)]
    nodes = [first.node_id(None, lambda i: False) for _ in range(2)]
    assert writers == [1, 2, 3] and nodes == [1, 2]
    second = IdState(path)  # a restart, even one without a checkpoint since
    assert second.incarnation == first.incarnation + 1
    assert second.writer_id() >= checkpoint.WRITER_ID_BLOCK > max(writers)
    assert second.node_id(2, lambda i: False) == 2  # a node re-joining keeps its id
    assert second.node_id(2, lambda i: i == 2) == 3  # unless this run has seen it
    assert second.node_id(99, lambda i: False) == 4  # never an id no run handed out
    third = IdState(path)
    assert third.node_id(None, lambda i: False) == 5


def test_a_malformed_id_file_stops_the_start(tmp_path):
    path = tmp_path / "ck.ids"
    path.write_text(json.dumps({"incarnation": 1}))
    with pytest.raises(CheckpointError, match="malformed"):
        IdState(str(path))


# -- restoring a table ----------------------------------------------------

def test_restored_items_keep_priority_use_count_and_new_ones_are_adopted():
    t = make(max_times_sampled=5)
    fill(t, range(10), priorities=np.arange(1, 11))
    t.unlease(t.sample(30)[0])
    t.update_priorities(np.array([0, 1], np.uint64), np.array([70.0, 80.0]))
    before = live(t)  # items that reached 5 uses have left
    assert any(uses for _, uses in before.values())
    r = Table.from_image(t.image(), seed=1)
    assert r.size == 0 and r.info()["awaiting_restore"] == len(before)
    assert (r.inserts, r.samples) == (t.inserts, t.samples)
    # One node re-sends all but two of them and an item inserted after the checkpoint.
    back = sorted(before)[2:][::-1]
    freed, counts = resend(r, back + [500], priority=0.5)
    assert counts == {"restored": len(back), "adopted": 1, "discarded": 0}
    assert len(freed.nodes) == 0
    after = live(r)
    assert {k: after[k] for k in back} == {k: before[k] for k in back}
    assert after[500] == (0.5, 0)
    assert r.inserts == t.inserts + 1
    # Uses left: 5 per item minus what the checkpoint says they had.
    assert r.core.remaining_uses == sum(5 - uses for _, uses in after.values())
    assert r.end_restore() == 2  # their node never came back


def test_fifo_order_survives_whatever_order_nodes_resend_in():
    t = make(sampler=Fifo(), remover=Fifo())
    fill(t, range(20))
    r = Table.from_image(t.image())
    resend(r, [15, 3, 19, 0], node=2)
    resend(r, [7, 11, 1], node=3)
    resend(r, [1000], node=2)  # inserted after the checkpoint: last
    order = []
    while r.size:
        recs = r.sample(1)[0]
        order.append(int(r.store.keys(recs[:1])[0]))
        r.core.remove(recs)
    assert order == [0, 1, 3, 7, 11, 15, 19, 1000]


def test_retired_and_duplicate_items_are_freed_never_resurrected():
    t = make(sampler=Uniform(), remover=Fifo(), capacity=5)
    fill(t, range(5))
    t.lease(np.flatnonzero(t.store.state == LIVE))  # a learner holds all five
    fill(t, range(5, 7))  # evicts keys 0 and 1, whose slots stay leased (RETIRED)
    image = t.image()
    assert sorted(image.retired.tolist()) == [0, 1]
    r = Table.from_image(image)
    freed, counts = resend(r, [0, 1, 2, 3], node=2)
    assert counts == {"restored": 2, "adopted": 0, "discarded": 2}
    assert sorted((freed.offsets // SLOT).tolist()) == [0, 1] and set(freed.nodes) == {2}
    # The same key from another node: the second copy is freed, the first kept.
    freed, counts = resend(r, [2, 4], node=3)
    assert counts["discarded"] == 1 and counts["restored"] == 1
    assert freed.offsets.tolist() == [2 * SLOT] and freed.nodes.tolist() == [3]
    # The very slot the table already points at is never freed.
    freed, counts = resend(r, [2], node=2)
    assert counts == {"restored": 0, "adopted": 0, "discarded": 0} and len(freed.offsets) == 0


def test_checkpoints_taken_during_a_restore_keep_what_nodes_have_not_resent():
    t = make(sampler=MaxHeap(), remover=Fifo())
    fill(t, range(6), priorities=[1, 9, 2, 8, 3, 7])
    r = Table.from_image(t.image())
    resend(r, [0, 1])
    again = Table.from_image(r.image())  # restarted again before the others came back
    assert sorted(again.pending.keys.tolist()) == list(range(6))
    resend(again, [3, 4, 5, 0, 1, 2])
    assert live(again) == live(t)


def test_a_batch_acknowledged_after_the_restart_claims_its_checkpointed_copy():
    t = make()
    fill(t, range(4))
    r = Table.from_image(t.image())
    fill(r, [2], node=3)  # the node retried its unacknowledged insert
    assert r.info()["awaiting_restore"] == 3
    assert 2 not in r.image().keys.tolist()[1:]  # once, not twice
    assert r.image().keys.tolist().count(2) == 1


def test_definitions_round_trip_for_every_kind_of_table():
    limiter = SampleToInsertRatio(samples_per_insert=4, min_size_to_sample=10, error_buffer=40)
    for t in (make(), make(sampler=Uniform(), remover=MaxHeap(), rate_limiter=limiter),
              make(max_times_sampled=2)):
        assert Table(TableDefinition.from_wire(t.definition.to_wire())).definition == t.definition


def test_an_id_file_of_40_bit_keys_moves_writer_ids_past_their_keys(tmp_path):
    # Keys were writer_id << 40 | seq; they are writer_id << 24 | seq now:
    # old writer w's keys are those of the new ids [w << 16, (w + 1) << 16).
    path = tmp_path / "ck.ids"
    path.write_text(json.dumps({"incarnation": 1, "next_node_id": 1,
                                "writer_ids_reserved": 300}))
    ids = IdState(str(path))
    assert ids.writer_id() == 300 << 16
    assert json.loads(path.read_text())["key_bits"] == checkpoint.KEY_BITS == 24
    assert IdState(str(path)).writer_id() > 300 << 16  # converted once, not again


# -- checkpoints of another store, or made by hand (issue 33 item 5) ----------

@pytest.mark.parametrize("damage, says", [
    ("nan", "not finite"), ("inf", "not finite"), ("negative", "not finite"),
    ("sequence", "next sequence"), ("duplicate", "same key twice"),
])
def test_values_outside_their_domain_are_refused_whatever_the_checksum(tmp_path, damage, says):
    t = make()
    fill(t, np.arange(1, 11))
    image = t.image()
    if damage in ("nan", "inf", "negative"):
        image.priorities[3] = {"nan": np.nan, "inf": np.inf, "negative": -1.0}[damage]
    elif damage == "sequence":
        image.sequences[0] = image.next_seq
    else:
        image.keys[5] = image.keys[6]
    path = str(tmp_path / "ck")
    checkpoint.write(path, Image([image]))  # a valid checksum over bad values
    with pytest.raises(CheckpointError, match=f"table 't' .*{says}.*start without --restore"):
        checkpoint.read(path)


def test_a_checkpoint_without_its_id_file_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    ids = IdState(path + ".ids")
    checkpoint.write(path, Image([make().image()], store_id=ids.store_id))
    os.unlink(path + ".ids")
    with pytest.raises(CheckpointError, match="has no id file .*ck.ids beside it"):
        IdState(path + ".ids")
    assert not os.path.exists(path + ".ids")  # not made up: the operator decides


def test_checkpoints_carry_their_store_id_and_it_survives_restarts(tmp_path):
    path = str(tmp_path / "ck")
    first = IdState(path + ".ids")
    checkpoint.write(path, Image([make().image()], store_id=first.store_id))
    assert checkpoint.read(path).store_id == first.store_id
    assert IdState(path + ".ids").store_id == first.store_id
    assert IdState(str(tmp_path / "other.ids")).store_id != first.store_id


# -- restores of a full table (issue 31 item 11) ------------------------------

@pytest.mark.parametrize("remover, kept", [
    (Fifo(), [8, 9]),  # the newest
    (Lifo(), [3, 4]),  # the oldest
    (MinHeap(), [4, 6]),  # the highest priorities (7, 8)
    (MaxHeap(), [3, 7]),  # the lowest priorities (1, 0)
])
def test_a_checkpoint_taken_during_a_restore_never_holds_more_than_the_capacity(remover, kept):
    # Before: live items plus every one not re-sent yet (15 of capacity 10).
    t = make(sampler=Uniform(), remover=remover, capacity=10)
    fill(t, range(10), priorities=[5, 3, 9, 1, 7, 2, 8, 0, 6, 4])
    r = Table.from_image(t.image())
    resend(r, [0, 1, 2])
    fill(r, range(100, 105), node=3)  # 8 live: room for 2 of the 7 not re-sent
    image = r.image()
    assert len(image.keys) == 10
    assert sorted(image.keys.tolist()) == [0, 1, 2, *kept, *range(100, 105)]
    # Those left out are freed if a node re-sends them after a restart from it.
    assert sorted(image.retired.tolist()) == sorted(set(range(3, 10)) - set(kept))
    again = Table.from_image(image)
    freed, counts = resend(again, range(10))
    assert counts["restored"] == 5 and counts["discarded"] == 5
    assert r.info()["awaiting_restore"] == 7  # this restore still takes them all back


def test_a_checkpoint_over_its_capacity_is_restored_to_the_capacity():
    # As an older release wrote during a restore: 15 items in a capacity-10 table.
    big = make(sampler=Uniform(), remover=Fifo(), capacity=15)
    fill(big, range(15))
    image = big.image()
    image.definition = make(sampler=Uniform(), remover=Fifo(), capacity=10).definition.to_wire()
    r = Table.from_image(image)
    assert r.info()["awaiting_restore"] == 10  # before: 15
    freed, counts = resend(r, range(15))
    assert counts == {"restored": 10, "adopted": 0, "discarded": 5}
    assert sorted((freed.offsets // SLOT).tolist()) == [0, 1, 2, 3, 4]  # FIFO: the oldest go
    assert r.size == 10


def test_checkpoints_name_the_nodes_a_restore_waits_for(tmp_path):
    path = str(tmp_path / "ck")
    checkpoint.write(path, Image([make().image()], nodes={1: "a", 4: "b"}, next_node_id=6))
    back = checkpoint.read(path)
    assert back.nodes == {1: "a", 4: "b"} and back.next_node_id == 6
    # An older file names none: a restore then waits out its grace, as it did.
    older = Image([make().image()])
    checkpoint.write(path, older)
    assert checkpoint.read(path).nodes is None


def test_a_restore_ends_when_every_expected_node_has_resent_or_is_gone(tmp_path):
    path = str(tmp_path / "ck")
    ids = IdState(path + ".ids")
    for _ in range(4):
        ids.node_id(None, lambda i: False)  # nodes 1-4; 4 joined after the checkpoint
    t = make()
    fill(t, range(10))
    checkpoint.write(path, Image([t.image()], store_id=ids.store_id, nodes={1: "a", 2: "b",
                                                                           3: "c"}, next_node_id=4))
    restore = Restore(path, grace=60.0)
    tables = restore.load(None, next_node_id=IdState(path + ".ids").next_node_id)
    now = time.monotonic()
    assert not restore.over(now)
    assert restore.waiting_for() == "nodes 1 (a), 2 (b), 3 (c), 4 to re-join"
    restore.joined(1, "a", resends=True)
    restore.joined(9, "fresh", resends=False)  # a new node has nothing to re-send
    assert restore.waiting_for() == ("nodes 2 (b), 3 (c), 4 to re-join and node 1 (a) to "
                                     "finish re-sending")
    restore.sent(1)
    restore.joined(2, "b", resends=True)
    restore.gone(2)  # died while re-sending
    restore.joined(3, "c", resends=True)
    restore.sent(3)
    assert not restore.over(now) and restore.waiting_for() == "node 4 to re-join"
    restore.joined(4, "d", resends=True)
    assert not restore.over(now)
    restore.sent(4)
    assert restore.over(now)
    restore.end(tables)
    assert restore.over(now + 61)  # and the grace still bounds it


def test_a_restore_from_an_older_checkpoint_waits_out_its_grace(tmp_path):
    path = str(tmp_path / "ck")
    ids = IdState(path + ".ids")
    checkpoint.write(path, Image([make().image()], store_id=ids.store_id))
    restore = Restore(path, grace=60.0)
    restore.load(None, next_node_id=ids.next_node_id)
    restore.joined(1, "a", resends=True)
    restore.sent(1)
    assert not restore.over(time.monotonic())
    assert restore.over(time.monotonic() + 61)


def test_a_failed_first_write_does_not_claim_a_previous_checkpoint(tmp_path):
    path = str(tmp_path / "missing" / "ck")
    with pytest.raises(CheckpointError) as err:
        checkpoint.write(path, Image([make().image()]))
    said = str(err.value)
    assert "intact" not in said
    assert "no checkpoint there yet" in said and "missing does not exist" in said
