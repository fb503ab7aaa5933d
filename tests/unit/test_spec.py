"""Table specs: parsing, packing one item or a batch, strided views."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.errors import ConfigError, SpecMismatch
from distore_ucx.spec import SLOT_HEADER, TableSpec

SPEC = {"obs": ((4, 84, 84), "uint8"), "action": ((), "int64"), "reward": ((), "float32")}


def test_layout_is_packed_aligned_and_padded():
    s = TableSpec.parse(SPEC)
    assert [f.offset for f in s.fields] == [0, 28224, 28232]
    assert s.item_bytes == 28236
    assert s.slot_size % 64 == 0 and s.slot_size >= SLOT_HEADER + s.item_bytes


def test_wire_round_trip():
    s = TableSpec.parse(SPEC)
    assert TableSpec.from_wire(s.to_wire()) == s
    u = TableSpec.parse(((3, 2), "float64"))
    assert u.unnamed and TableSpec.from_wire(u.to_wire()) == u


def test_pack_one_item_and_a_batch_then_view_them_back():
    s = TableSpec.parse(SPEC)
    rng = np.random.default_rng(0)
    batch = {
        "obs": rng.integers(0, 255, (5, 4, 84, 84), dtype=np.uint8),
        "action": np.arange(5),
        "reward": np.linspace(0, 1, 5, dtype=np.float32),
    }
    rows = s.pack(batch)
    assert rows.shape == (5, s.item_bytes)
    one = s.pack({k: v[2] for k, v in batch.items()})
    assert np.array_equal(one[0], rows[2])
    layout = s.layout(5)
    buf = np.zeros(layout.nbytes, np.uint8)
    for f, at in zip(s.fields, layout.offsets):  # what a reader scatters
        buf[at : at + 5 * f.nbytes] = rows[:, f.offset : f.offset + f.nbytes].reshape(-1)
    views = s.views(buf, layout)
    for k, v in batch.items():
        assert np.array_equal(views[k], v)
        assert np.shares_memory(views[k], buf)  # views, not copies
        assert views[k].flags.c_contiguous and views[k].shape == (5,) + v.shape[1:]
        assert np.shares_memory(np.ascontiguousarray(views[k]), buf)  # dense: free


def test_batch_layout_gives_each_array_its_own_aligned_region():
    s = TableSpec.parse({"obs": ((4, 84, 84), "uint8"), "action": ((), "int32"),
                         "reward": ((), "float64")})
    layout = s.layout(3)
    assert layout.rows == 3 and layout.header == 0
    spans = [(layout.header, 3 * SLOT_HEADER)] + [
        (at, at + 3 * f.nbytes) for f, at in zip(s.fields, layout.offsets)]
    assert all(a % 64 == 0 for a, _ in spans)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0  # in order, never overlapping
    assert spans[-1][1] <= layout.nbytes and layout.nbytes % 64 == 0
    buf = np.zeros(layout.nbytes, np.uint8)
    header = s.header_view(buf, layout)
    header[2] = (7, 9)
    assert header.shape == (3, 2) and buf[32:48].view(np.uint64).tolist() == [7, 9]


def test_unnamed_spec_packs_plain_arrays():
    s = TableSpec.parse(((2, 3), "float32"))
    rows = s.pack(np.ones((4, 2, 3), np.float32))
    assert rows.shape == (4, 24)
    layout = s.layout(4)
    buf = np.zeros(layout.nbytes, np.uint8)
    buf[layout.offsets[0] : layout.offsets[0] + 4 * 24] = rows.reshape(-1)
    view = s.views(buf, layout)
    assert np.array_equal(view, np.ones((4, 2, 3), np.float32)) and view.flags.c_contiguous


@pytest.mark.parametrize(
    "data, message",
    [
        ({"obs": np.zeros((4, 84, 84), np.uint8), "action": 1}, "fields missing"),
        ({**{k: 0 for k in SPEC}, "extra": 1}, "unknown fields"),
        ({"obs": np.zeros((3, 84, 84), np.uint8), "action": 1, "reward": 0.0}, "shape"),
        (
            {"obs": np.zeros((2, 4, 84, 84), np.uint8), "action": [1, 2, 3], "reward": [0, 0]},
            "disagree",
        ),
        ({"obs": np.zeros((4, 84, 84), np.float64), "action": 1, "reward": 0.0},
         "cannot be stored"),
        ([1, 2], "pass a dict"),
    ],
)
def test_mismatched_data_is_refused_with_a_clear_message(data, message):
    with pytest.raises(SpecMismatch, match=message):
        TableSpec.parse(SPEC).pack(data)


@pytest.mark.parametrize("bad", [{}, 5, {"x": ((-1,), "uint8")}, {"x": ((), "object")}, {"x": 3}])
def test_bad_specs_are_config_errors(bad):
    with pytest.raises(ConfigError):
        TableSpec.parse(bad)


@pytest.mark.parametrize("values, fits", [([300, 2], False), ([3, 2], True)])
def test_a_cast_that_would_wrap_values_is_never_advised(values, fits):
    # int64 300 into a uint8 field: np.asarray(x, dtype=np.uint8) gives 44.
    spec = TableSpec.parse({"x": ((2,), "uint8")})
    with pytest.raises(SpecMismatch) as err:
        spec.pack({"x": np.array(values, np.int64)})
    text = str(err.value)
    assert "np.asarray(x, dtype" not in text
    if fits:
        assert "its values fit" in text and "x.astype(np.uint8)" in text
    else:
        assert "from 2 to 300 do not fit in uint8 (0..255)" in text and "wrap" in text
