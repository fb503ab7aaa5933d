"""A storage node's slot table: allocation, acknowledgement, frees, and what
it re-sends after a control-plane restart."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.storage.slots import ALLOCATED, FREE, LIVE, SlotTable

SLOT = 4096


def carve(slots: SlotTable, start: int, n: int) -> np.ndarray:
    offsets = (start + np.arange(n, dtype=np.uint64)) * np.uint64(SLOT)
    slots.carve(offsets)
    return offsets


def test_only_acknowledged_slots_are_resent():
    slots = SlotTable(SLOT, initial=4)
    a = carve(slots, 0, 3)
    b = carve(slots, 10, 5)  # other tables' slots lie in between; grows past 4
    slots.commit(b[:2], [7, 8], [1, 2], [0.5, 0.25])
    keys, offsets, gens, prios = slots.live()
    assert keys.tolist() == [7, 8] and offsets.tolist() == b[:2].tolist()
    assert gens.tolist() == [1, 2] and prios.tolist() == [0.5, 0.25]
    assert slots.cols["state"][: slots.n].tolist() == [ALLOCATED] * 3 + [LIVE] * 2 + [ALLOCATED] * 3
    assert slots.release(np.concatenate([a, b[:1]])) == 4
    assert slots.live()[0].tolist() == [8]


def test_a_freed_slot_is_reused_once_even_if_freed_twice():
    slots = SlotTable(SLOT)
    offs = carve(slots, 0, 4)
    assert slots.release(offs[1:3]) == 2
    assert slots.release(offs[1:3]) == 0  # repeated: ignored
    assert slots.free_slots == 2
    again = slots.reuse(5)
    assert sorted(again.tolist()) == sorted(offs[1:3].tolist())
    assert slots.free_slots == 0 and slots.reuse(1).size == 0
    assert (slots.cols["state"][: slots.n] != FREE).all()


def test_offsets_that_are_not_slots_are_refused():
    slots = SlotTable(SLOT)
    carve(slots, 0, 2)
    with pytest.raises(ValueError, match="not slots"):
        slots.release(np.array([SLOT // 2], np.uint64))
    with pytest.raises(ValueError, match="not slots"):
        slots.release(np.array([50 * SLOT], np.uint64))


def test_steps_keep_their_episode_position_and_flags_for_a_restore():
    # A table of slices: each LIVE slot keeps its step's place, re-sent to a
    # restored control plane with the slot (storage/session.py), through
    # the columns' growth; a table of items keeps none.
    slots = SlotTable(SLOT, initial=2)
    a = carve(slots, 0, 2)
    assert slots.live_steps() is None and slots.steps_of(a) is None
    slots.commit(a, [1, 2], [1, 1], [1.0, 1.0],
                 (np.array([9, 9], np.uint64), np.array([0, 1], np.uint32),
                  np.array([0, 1], np.uint8)))
    b = carve(slots, 5, 3)  # grows every column, the steps' too
    slots.commit(b[1:], [3, 4], [1, 1], [1.0, 1.0],
                 (np.array([12, 12], np.uint64), np.array([4, 5], np.uint32),
                  np.array([0, 0], np.uint8)))
    episodes, positions, flags = slots.live_steps()
    assert slots.live()[0].tolist() == [1, 2, 3, 4]
    assert episodes.tolist() == [9, 9, 12, 12] and positions.tolist() == [0, 1, 4, 5]
    assert flags.tolist() == [0, 1, 0, 0]
    assert [c.tolist() for c in slots.steps_of(b[2:])] == [[12], [5], [0]]


def test_a_refused_acknowledgement_or_free_changes_nothing():
    # The slot table's calls are native, a batch a call (native/slot_table.h):
    # a batch naming one offset that is not a slot is refused whole.
    slots = SlotTable(SLOT)
    offs = carve(slots, 0, 3)
    before = {name: col.copy() for name, col in slots.cols.items()}
    bad = np.array([offs[0], offs[1] + 1], np.uint64)
    with pytest.raises(ValueError, match="not slots"):
        slots.commit(bad, [1, 2], [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="not slots"):
        slots.release(bad)
    for name, col in slots.cols.items():
        assert np.array_equal(col, before[name]), name
    assert slots.free_slots == 0


def test_acknowledgements_take_lists_scalars_and_any_dtype():
    slots = SlotTable(SLOT)
    offs = carve(slots, 0, 3)
    slots.commit(offs.tolist(), np.array([5, 6, 7], np.int64), 9, np.float32(0.5))
    keys, offsets, gens, prios = slots.live()
    assert keys.tolist() == [5, 6, 7] and gens.tolist() == [9, 9, 9]
    assert prios.tolist() == [0.5] * 3 and offsets.tolist() == offs.tolist()
    with pytest.raises(ValueError, match="one value per offset"):
        slots.commit(offs, [1, 2], [1, 2, 3], [1.0] * 3)


def test_columns_shorter_than_asked_are_refused():
    from distore_ucx._native_loader import _native

    carved = np.arange(4, dtype=np.uint64) * np.uint64(SLOT)
    state = np.zeros(2, np.uint8)
    with pytest.raises(ValueError, match="column"):
        _native.slot_index(carved, 5, carved[:1])
    with pytest.raises(ValueError, match="column"):
        _native.slot_release(carved, 4, state, carved[:1], False, np.zeros(4, np.int64), 0)
    with pytest.raises(ValueError, match="free stack"):
        _native.slot_release(carved, 2, state, carved[:2], False, np.zeros(1, np.int64), 0)
    with pytest.raises(ValueError, match="stack"):
        _native.slot_reuse(np.zeros(2, np.int64), 3, 1, state, carved)
    with pytest.raises(ValueError, match="outside"):
        _native.slot_reuse(np.array([7], np.int64), 1, 1, state, carved)


def test_new_slots_below_the_last_or_out_of_order_are_refused():
    slots = SlotTable(SLOT)
    carve(slots, 0, 2)
    for bad in ([SLOT], [SLOT + 1], [5 * SLOT, 4 * SLOT], [4 * SLOT, 4 * SLOT]):
        with pytest.raises(ValueError, match="ascend"):
            slots.carve(np.array(bad, np.uint64))
    assert slots.n == 2 and slots.end == 2 * SLOT
    slots.carve(np.array([4 * SLOT], np.uint64))  # a gap (other tables' slots): fine
    assert slots.end == 5 * SLOT
