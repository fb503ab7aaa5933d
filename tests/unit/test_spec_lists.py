"""Packing Python lists and counting items without packing."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.errors import SpecMismatch
from distore_ucx.spec import TableSpec

SPEC = {"obs": ((2, 3), "uint8"), "reward": ((), "float32")}


def test_nested_python_lists_are_stored_when_their_values_fit():
    s = TableSpec.parse(SPEC)
    rows = s.pack({"obs": [[[1, 2, 3], [4, 5, 255]], [[0, 0, 0], [9, 9, 9]]],
                   "reward": [1, 2]})  # ints for a float32 field too
    layout = s.layout(2)
    buf = np.zeros(layout.nbytes, np.uint8)
    for f, at in zip(s.fields, layout.offsets):
        buf[at: at + 2 * f.nbytes] = rows[:, f.offset: f.offset + f.nbytes].reshape(-1)
    views = s.views(buf, layout)
    assert views["obs"].tolist() == [[[1, 2, 3], [4, 5, 255]], [[0, 0, 0], [9, 9, 9]]]
    assert views["reward"].tolist() == [1.0, 2.0]


def test_python_values_that_do_not_fit_say_so():
    s = TableSpec.parse(SPEC)
    with pytest.raises(SpecMismatch, match=r"values from -1 to 300 do not fit in uint8 \(0..255\)"):
        s.pack({"obs": [[-1, 2, 3], [4, 5, 300]], "reward": 0.0})


def test_an_int64_array_for_a_uint8_field_says_how_to_convert():
    s = TableSpec.parse(SPEC)
    with pytest.raises(SpecMismatch,
                       match=r"its values fit: convert it first \(x.astype\(np.uint8\)\)"):
        s.pack({"obs": np.zeros((2, 3), np.int64), "reward": 0.0})


@pytest.mark.parametrize("data, n", [
    ({"obs": np.zeros((2, 3), np.uint8), "reward": 0.0}, 1),
    ({"obs": np.zeros((7, 2, 3), np.uint8), "reward": np.zeros(7)}, 7),
    ({"obs": [[[0] * 3] * 2] * 5, "reward": [0] * 5}, 5),
])
def test_count_tells_items_from_the_first_field(data, n):
    assert TableSpec.parse(SPEC).count(data) == n
    assert len(TableSpec.parse(SPEC).pack(data)) == n
