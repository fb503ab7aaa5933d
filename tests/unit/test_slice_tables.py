"""A control-plane table of slices (control/tables.py with a SliceIndex):
steps registered with their episodes, slices drawn and leased whole,
evictions and node loss ending the slices through their steps, priorities
set through a slice's key, restores discarding steps."""

from __future__ import annotations

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.control.tables import Table
from distore_ucx.errors import ConfigError, InvalidRequest
from distore_ucx.spec import TableSpec
from distore_ucx.table_definition import TableDefinition

SPEC = TableSpec.parse(((8,), "uint8"))


def table(capacity=100, slice_len=4, period=1, sampler=None) -> Table:
    return Table(TableDefinition.make("s", capacity, SPEC, sampler, slice_len=slice_len,
                                      slice_period=period), seed=3)


def add(t: Table, node: int, episode: int, positions, first_key: int, last: bool = False,
        priorities=None):
    n = len(positions)
    keys = np.arange(first_key, first_key + n, dtype=np.uint64)
    flags = np.zeros(n, np.uint8)
    if last:
        flags[-1] = 1
    prios = np.ones(n) if priorities is None else np.asarray(priorities, float)
    return t.add(node, keys, np.arange(n, dtype=np.uint64) * 64 + first_key * 64,
                 np.ones(n, np.uint64), prios,
                 (np.full(n, episode, np.uint64), np.asarray(positions, np.uint32), flags))


def test_slices_are_drawn_whole_leased_and_described_per_step():
    t = table()
    add(t, 1, 10, range(6), 100, last=True)  # starts 0, 1, 2
    add(t, 1, 11, range(3), 200)  # shorter than a slice: no start
    assert t.sampleable == 3 and t.size == 9 and t.info()["valid_starts"] == 3
    recs, probs, positions, flags = t.sample_slices(4 * 5)
    assert len(recs) == 20 and np.allclose(probs, 1 / 3)
    pos = positions.reshape(5, 4)
    assert (np.diff(pos, axis=1) == 1).all() and set(pos[:, 0]) <= {0, 1, 2}
    assert (flags.reshape(5, 4)[:, -1] == (pos[:, -1] == 5)).all()  # the episode's last step
    assert t.samples == 5 and (t.store.leases[recs] > 0).all()


def test_fifo_eviction_and_node_loss_end_the_slices_through_their_steps():
    t = table(capacity=8)
    add(t, 1, 10, range(8), 100)  # starts 0..4
    assert t.sampleable == 5
    add(t, 2, 11, range(2), 200)  # evicts steps 0 and 1 of episode 10
    assert t.sampleable == 3  # starts 2, 3, 4 remain
    recs, _, positions, _ = t.sample_slices(4 * 50)
    assert positions.reshape(50, 4)[:, 0].min() == 2
    assert t.drop_node(1) == 6 and t.sampleable == 0 and not t.can_sample(4)


def test_a_slice_priority_is_its_start_steps_and_follows_updates():
    t = table(sampler=ds.Prioritized(1.0), period=2)
    add(t, 1, 10, range(8), 100, priorities=np.ones(8))  # starts 0, 2, 4
    assert t.sampleable == 3
    t.update_priorities(np.array([104], np.uint64), np.array([1e6]))  # the start at 4
    _, probs, positions, _ = t.sample_slices(4 * 200)
    assert (positions.reshape(200, 4)[:, 0] == 4).mean() > 0.95
    assert t.min_probability < 1e-5


def test_steps_and_items_do_not_mix_and_restores_discard_steps():
    t = table()
    with pytest.raises(InvalidRequest, match="writer.append"):
        t.add(1, np.arange(3, dtype=np.uint64), np.arange(3, dtype=np.uint64) * 64,
              np.ones(3, np.uint64), np.ones(3))
    items = Table.make("i", 10, SPEC)
    with pytest.raises(InvalidRequest, match="writer.insert"):
        add(items, 1, 10, range(3), 100)
    freed, counts = t.restore_items(1, np.arange(3, dtype=np.uint64),
                                    np.arange(3, dtype=np.uint64) * 64, np.ones(3, np.uint64),
                                    np.ones(3))
    assert counts == {"restored": 0, "adopted": 0, "discarded": 3} and len(freed.nodes) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"slice_len": 4, "sampler": ds.Fifo()}, "Uniform.*Prioritized"),
    ({"slice_len": 4, "max_times_sampled": 1}, "max_times_sampled"),
    ({"slice_len": 400}, "holds no slice"),
    ({"slice_len": -1}, "slice_len"),
    ({"slice_len": 4, "slice_period": 0}, "slice_period"),
])
def test_definitions_of_tables_of_slices_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TableDefinition.make("s", 100, SPEC, **kwargs)


def test_a_definition_of_slices_goes_over_the_wire_and_items_stay_as_they_were():
    d = TableDefinition.make("s", 100, SPEC, slice_len=80, slice_period=40)
    assert TableDefinition.from_wire(d.to_wire()) == d and d.slices
    items = TableDefinition.make("i", 100, SPEC)
    assert "slice_len" not in items.to_wire() and not items.slices


def test_a_checkpoint_keeps_episodes_and_a_restore_puts_steps_back_in_them(tmp_path):
    from distore_ucx.control import checkpoint

    t = table()
    add(t, 1, 10, range(6), 100, last=True)  # starts 0, 1, 2
    add(t, 1, 11, range(5), 200)  # starts 0, 1
    path = str(tmp_path / "c.ckpt")
    checkpoint.write(path, checkpoint.Image([t.image()]))
    image = checkpoint.read(path).tables[0]
    assert len(image.episodes) == 11 and image.step_flags.sum() == 1
    back = Table.from_image(image, seed=3)
    assert back.sampleable == 0
    # The node re-sends what it holds: the checkpoint's steps and one newer.
    keys = np.r_[np.arange(100, 106), np.arange(200, 205), [300]].astype(np.uint64)
    offsets = np.arange(len(keys), dtype=np.uint64) * 64
    freed, counts = back.restore_items(1, keys, offsets, np.ones(len(keys), np.uint64),
                                       np.ones(len(keys)))
    assert counts == {"restored": 11, "adopted": 0, "discarded": 1}
    assert list(freed.offsets) == [offsets[-1]]  # the newer step: its episode is not known
    assert back.sampleable == 5
    recs, _, positions, flags = back.sample_slices(4 * 30)
    pos = positions.reshape(30, 4)
    assert (np.diff(pos, axis=1) == 1).all()
    assert (flags.reshape(30, 4)[:, -1] == (back.store.keys(recs).reshape(30, 4)[:, -1] == 105)
            ).all()  # the flag of episode 10's last step came back


@pytest.mark.parametrize("pad, starts", [("end", 7), ("short_episodes", 3)])
def test_short_slices_are_padded_with_their_last_step_and_flagged(pad, starts):
    """slice_pad "end": every start whose run reaches its episode's end;
    "short_episodes": only an episode shorter than the slice, whole. Rows
    past a slice's end repeat its last step, flagged STEP_PAD."""
    from distore_ucx.protocol import STEP_LAST, STEP_PAD

    t = Table(TableDefinition.make("s", 100, SPEC, slice_len=4, slice_pad=pad), seed=3)
    add(t, 1, 10, range(5), 100, last=True)  # full starts 0, 1; short 2, 3, 4 ("end")
    add(t, 1, 11, range(2), 200, last=True)  # shorter than a slice: 0 (and 1: "end")
    add(t, 1, 12, range(2), 300)  # still going: no start yet
    assert t.sampleable == starts
    recs, _, positions, flags = t.sample_slices(4 * 400)
    keys = t.store.keys(recs).reshape(400, 4)
    flags = flags.reshape(400, 4)
    real = (flags & STEP_PAD) == 0
    lengths = real.sum(axis=1)
    assert (real[:, 0]).all() and (np.diff(real.astype(int), axis=1) <= 0).all()
    for row, n in zip(keys, lengths):  # the real steps are consecutive, then repeats
        assert (np.diff(row[:n].astype(np.int64)) == 1).all() and (row[n:] == row[n - 1]).all()
        assert n == 4 or row[n - 1] in (104, 201)  # short only at an episode's end
    assert (flags[real & (keys == 104)] & STEP_LAST).all()
    drawn = {int(k) for k in keys[:, 0]}
    assert drawn == ({100, 101, 102, 103, 104, 200, 201} if pad == "end" else {100, 101, 200})


def test_slice_pad_is_checked_and_goes_over_the_wire():
    with pytest.raises(ConfigError, match="slice_pad must be one of"):
        TableDefinition.make("s", 100, SPEC, slice_len=4, slice_pad="yes")
    with pytest.raises(ConfigError, match="give slice_len too"):
        TableDefinition.make("s", 100, SPEC, slice_pad="end")
    d = TableDefinition.make("s", 100, SPEC, slice_len=4, slice_pad="short_episodes")
    assert TableDefinition.from_wire(d.to_wire()) == d
    assert "slice_pad" not in TableDefinition.make("s", 100, SPEC, slice_len=4).to_wire()


def test_a_table_of_slices_core_keeps_no_sampler():
    """The core of a table of slices holds no sampler (its draws are the
    SliceIndex's): no memory a step there, and a draw from it is refused."""
    from distore_ucx import _tables
    from distore_ucx.errors import TableCoreError

    t = table(capacity=1000)
    add(t, 1, 10, range(500), 100, last=True)
    parts = t.core.memory_usage()
    assert not any(name.startswith("sampler") for name in parts), parts
    with pytest.raises(TableCoreError, match="no sampler"):
        t.core.sample(1)
    with pytest.raises(TableCoreError, match="remover must select"):
        _tables.TableCore(0, 1.0, _tables.NO_SAMPLER, 1.0, 10, 0, 1)
    assert t.sample_slices(4 * 3)[0].shape == (12,)  # slices are drawn as ever
