"""A storage node's arena: space shared between tables, and given back."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from distore_ucx.errors import StorageFull
from distore_ucx.storage.arena import Arena
from distore_ucx.transport import UcxRuntime

SIZE = 4 << 20


@pytest.fixture(scope="module")
def runtime():
    with UcxRuntime(config={"TLS": "tcp"}) as rt:
        yield rt


@pytest.fixture
def arena(runtime):
    a = Arena(runtime, SIZE, hugepages=False, node_name="n1")
    yield a
    del a


def fill(arena: Arena, table: str, slot_size: int, batch: int) -> np.ndarray:
    """Allocate batches until the arena is full; every offset allocated."""
    got = []
    while True:
        try:
            got.append(arena.allocate(table, slot_size, batch))
        except StorageFull:
            return np.concatenate(got) if got else np.empty(0, np.uint64)


def check_disjoint(arena: Arena) -> None:
    """No byte belongs to two slots, or to a slot and a free extent."""
    spans = [(int(o), int(o) + t.slot_size) for t in arena.tables().values()
             for o in t.cols["offset"][: t.n]]
    spans += [(s, s + n) for s, n in arena.free_extents]
    spans.sort()
    for (_, end), (start, _) in pairwise(spans):
        assert end <= start
    assert all(0 <= s and e <= arena.bump <= arena.size for s, e in spans)


def test_a_drained_table_gives_its_space_to_another(arena):
    a = fill(arena, "a", 4096, 64)
    assert len(a) == SIZE // 4096 and arena.used_bytes == SIZE
    arena.commit("a", a, a, np.ones(len(a), np.uint64), np.ones(len(a)))
    arena.free("a", a[: len(a) // 2])
    with pytest.raises(StorageFull):  # half of a is still live: no room for b yet
        arena.allocate("b", 10_000, 1)
    arena.free("a", a[len(a) // 2:])
    assert arena.used_bytes == 0 and "a" not in arena.tables()
    assert arena.bump == 0 and arena.free_extents == []
    b = fill(arena, "b", 10_000, 1)  # another slot size takes all of it
    assert len(b) == SIZE // 10_000
    check_disjoint(arena)


def test_partly_freed_tables_reuse_their_own_slots(arena):
    a = arena.allocate("a", 1000, 10)
    arena.free("a", a[:3])
    again = arena.allocate("a", 1000, 5)
    assert set(a[:3].tolist()) <= set(again.tolist())
    assert arena.bump == 12 * 1000 and arena.used_bytes == 12 * 1000


def test_holes_between_tables_merge_and_lower_the_bump(arena):
    a1 = arena.allocate("a", 1000, 4)
    b1 = arena.allocate("b", 3000, 2)
    a2 = arena.allocate("a", 1000, 4)
    c = arena.allocate("c", 500, 2)
    arena.free("a", np.concatenate([a1, a2]))
    # a's two runs are extents now, split by b's slots; c holds the top.
    assert arena.free_extents == [(0, 4000), (10_000, 4000)]
    # A new table takes the extents first, lowest first, and stays ascending.
    d = arena.allocate("d", 2000, 3)
    assert d.tolist() == [0, 2000, 10_000]
    assert arena.free_extents == [(12_000, 2000)]
    check_disjoint(arena)
    arena.free("b", b1)
    arena.free("d", d)
    assert arena.free_extents == [(0, 14_000)]
    arena.free("c", c)  # the top goes: everything merges back into the bump region
    assert arena.free_extents == [] and arena.bump == 0 and arena.used_bytes == 0


def test_a_table_takes_only_extents_above_its_slots(arena):
    low = arena.allocate("x", 1000, 2)
    a = arena.allocate("a", 1000, 2)
    arena.free("x", low)  # an extent below a's slots
    more = arena.allocate("a", 1000, 1)
    assert more.tolist() == [4000]  # not 0: a's offsets must keep ascending
    assert arena.allocate("b", 1000, 2).tolist() == [0, 1000]
    assert (np.diff(np.concatenate([a, more]).astype(np.int64)) > 0).all()


def test_random_churn_keeps_slots_disjoint_and_counts_right(arena):
    rng = np.random.default_rng(7)
    sizes = {"a": 4096, "b": 12_288, "c": 1000}
    held = {t: [] for t in sizes}
    for _ in range(400):
        t = str(rng.choice(list(sizes)))
        if held[t] and rng.random() < 0.5:
            pick = rng.random(len(held[t])) < rng.random()
            arena.free(t, np.array(held[t], np.uint64)[pick])
            held[t] = [o for o, p in zip(held[t], pick) if not p]
        else:
            try:
                held[t] += arena.allocate(t, sizes[t], int(rng.integers(1, 40))).tolist()
            except StorageFull:
                pass
        assert arena.used_bytes == sum(len(held[t]) * sizes[t] for t in sizes)
        check_disjoint(arena)
    for t in sizes:
        arena.free(t, np.array(held[t], np.uint64))
    assert arena.used_bytes == 0 and arena.bump == 0 and arena.free_extents == []
