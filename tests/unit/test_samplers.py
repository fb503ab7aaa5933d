"""Selectors in the native TableCore: exact probabilities, chi-square over
10^5 draws with fixed seeds, removers' eviction order, the sum tree."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distore_ucx import _tables, errors
from distore_ucx.selectors import KINDS

DRAWS = 100_000


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def core(sampler="uniform", alpha=1.0, remover="fifo", capacity=1000, max_times=0, seed=7):
    return _tables.TableCore(KINDS.index(sampler), alpha, KINDS.index(remover), 1.0, capacity,
                             max_times, seed)


def fill(t, priorities):
    n = len(priorities)
    ids = np.arange(n, dtype=np.int64)
    t.insert(ids, np.arange(100, 100 + n, dtype=np.uint64), np.asarray(priorities, np.float64))
    return ids


def draw(t, n=DRAWS):
    ids, probs, exhausted = t.sample(n)
    assert len(ids) == n and len(exhausted) == 0
    return ids, probs


def chi2(counts, expected_p):
    exp = expected_p * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("alpha", [1.0, 0.6, 0.0])
def test_prioritized_matches_exact_probabilities(alpha):
    rng = np.random.default_rng(1)
    prios = rng.uniform(0.1, 5.0, 50)
    t = core("prioritized", alpha)
    ids = fill(t, prios)
    w = prios**alpha
    exact = w / w.sum()
    assert np.allclose(t.probabilities(ids), exact, rtol=1e-12)
    got, probs = draw(t)
    assert np.allclose(probs, exact[got], rtol=1e-12)  # reported = exact
    counts = np.bincount(got, minlength=50)
    assert chi2(counts, exact) < chi2_critical(49)


def test_uniform_matches_exact_probabilities():
    t = core("uniform")
    fill(t, np.random.default_rng(2).uniform(0, 9, 40))  # priorities do not matter
    got, probs = draw(t)
    assert np.all(probs == 1 / 40)
    assert chi2(np.bincount(got, minlength=40), np.full(40, 1 / 40)) < chi2_critical(39)


def test_prioritized_with_all_zero_priorities_is_uniform():
    t = core("prioritized", 1.0)
    fill(t, np.zeros(20))
    got, probs = draw(t, 20_000)
    assert np.all(probs == 1 / 20)
    assert chi2(np.bincount(got, minlength=20), np.full(20, 1 / 20)) < chi2_critical(19)


def test_priority_updates_change_the_distribution():
    t = core("prioritized", 1.0)
    ids = fill(t, np.ones(10))
    keys = np.arange(100, 110, dtype=np.uint64)
    new = np.arange(1, 11, dtype=np.float64)
    assert t.update_priorities(keys, new) == 10
    assert t.update_priorities(np.array([999], np.uint64), np.array([1.0])) == 0
    exact = new / new.sum()
    assert np.allclose(t.probabilities(ids), exact)
    got, _ = draw(t)
    assert chi2(np.bincount(got, minlength=10), exact) < chi2_critical(9)


@pytest.mark.parametrize(
    "kind, expected",
    [("fifo", 0), ("lifo", 4), ("min_heap", 3), ("max_heap", 1)],
)
def test_deterministic_samplers(kind, expected):
    t = core(kind)
    fill(t, [3.0, 9.0, 5.0, 1.0, 5.0])
    got, probs = draw(t, 100)
    assert np.all(got == expected) and np.all(probs == 1.0)


def test_heap_ties_go_to_the_oldest_item():
    t = core("max_heap")
    fill(t, [1.0, 5.0, 5.0, 5.0])
    assert draw(t, 3)[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "kind, evicted",
    [("fifo", [0, 1]), ("lifo", [4, 5]), ("min_heap", [3, 0]), ("max_heap", [1, 5])],
)
def test_removers_evict_in_their_order(kind, evicted):
    # Reverb: an item arriving at capacity first evicts the remover's choice.
    t = core("uniform", 1.0, kind, capacity=5, seed=1)
    fill(t, [3.0, 9.0, 5.0, 1.0, 5.0])
    out = t.insert(np.array([5], np.int64), np.array([105], np.uint64), np.array([7.0]))
    out2 = t.insert(np.array([6], np.int64), np.array([106], np.uint64), np.array([0.5]))
    assert out.tolist() + out2.tolist() == evicted
    assert t.size == 5


def test_uniform_remover_evicts_uniformly():
    counts = np.zeros(10)
    for seed in range(2000):
        t = core("uniform", 1.0, "uniform", capacity=10, seed=seed)
        fill(t, np.ones(10))
        counts[t.insert(np.array([10], np.int64), np.array([1], np.uint64), np.ones(1))] += 1
    assert chi2(counts, np.full(10, 0.1)) < chi2_critical(9)


def test_max_times_sampled_removes_items_between_draws():
    t = core("fifo", max_times=3)
    fill(t, np.ones(2))
    assert t.remaining_uses == 6
    ids, _, exhausted = t.sample(10)  # only 6 uses exist
    assert ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert exhausted.tolist() == [0, 1]
    assert t.size == 0 and t.remaining_uses == 0


def test_remove_and_lookup():
    t = core("prioritized")
    fill(t, np.ones(5))
    assert t.remove(np.array([1, 3, 3, 42], np.int64)) == 2
    assert t.lookup(np.array([100, 101, 104, 7], np.uint64)).tolist() == [0, -1, 4, -1]
    got, probs = draw(t, 3000)
    assert set(got.tolist()) == {0, 2, 4} and np.allclose(probs, 1 / 3)
    with pytest.raises(errors.TableCoreError, match="already in the table"):
        t.insert(np.array([0], np.int64), np.array([5], np.uint64), np.ones(1))


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 300),
    updates=st.lists(
        st.tuples(st.integers(0, 299), st.floats(0, 1e6, allow_nan=False, allow_infinity=False,
                                                 allow_subnormal=False)),
        min_size=1,
        max_size=400,
    ),
)
def test_sum_tree_matches_a_float64_reference(size, updates):
    tree = _tables.SumTree(size)
    ref = np.zeros(tree.capacity)
    idx = np.array([i % size for i, _ in updates], np.int64)
    vals = np.array([v for _, v in updates], np.float64)
    for chunk in np.array_split(np.arange(len(idx)), 4):  # several batches
        tree.set(idx[chunk], vals[chunk])
        ref[idx[chunk]] = vals[chunk]  # last write wins, as in the tree
    assert math.isclose(tree.total, ref.sum(), rel_tol=1e-9, abs_tol=1e-9)
    positive = ref[ref > 0]
    assert tree.min_positive == (positive.min() if positive.size else 0.0)  # the min tree
    assert np.array_equal(tree.get(np.arange(size, dtype=np.int64)), ref[:size])
    if ref.sum() > 0:
        prefixes = np.random.default_rng(size).uniform(0, ref.sum(), 64)
        expect = np.searchsorted(np.cumsum(ref), prefixes, side="right")
        got = tree.find(prefixes)
        # Floating-point ties at bucket edges may land on a zero-weight
        # neighbour in neither; the leaf found must hold weight.
        assert np.all(ref[got] > 0)
        assert np.mean(got == expect) > 0.95


def test_min_tree_follows_updates_removals_and_growth():
    tree = _tables.SumTree(8)
    assert tree.min_positive == 0.0  # nothing positive yet
    tree.set(np.array([3, 5], np.int64), np.array([2.0, 0.5]))
    assert tree.min_positive == 0.5
    tree.set(np.array([5], np.int64), np.array([0.0]))  # a removed item is no minimum
    assert tree.min_positive == 2.0
    t = core("prioritized", capacity=1000)
    total = 0.0
    for i in range(600):  # the tree grows from one level to four, keeping the minimum
        t.insert(np.array([i], np.int64), np.array([100 + i], np.uint64),
                 np.array([1000.0 - i]))
        total += 1000.0 - i
        assert math.isclose(t.min_probability, (1000.0 - i) / total, rel_tol=1e-12)


@pytest.mark.parametrize("sampler,alpha", [("prioritized", 0.6), ("prioritized", 1.0),
                                           ("uniform", 1.0), ("fifo", 1.0)])
def test_min_probability_is_the_least_likely_items(sampler, alpha):
    # Importance weights (P(i) / P_min)^-beta normalise by it (TorchRL's formula).
    t = core(sampler, alpha, capacity=30)
    assert t.min_probability == 0.0  # empty
    prios = np.random.default_rng(3).uniform(0.1, 5.0, 40)
    ids = fill(t, prios)  # the first 10 are evicted at capacity 30
    live = ids[10:]
    expect = t.probabilities(live).min() if sampler != "fifo" else 1.0
    assert math.isclose(t.min_probability, expect, rel_tol=1e-12)
    if sampler == "prioritized":
        assert math.isclose(t.min_probability, prios[10:].min() ** alpha
                            / (prios[10:] ** alpha).sum(), rel_tol=1e-12)
        t.update_priorities(np.array([100 + 20], np.uint64), np.array([1e-3]))
        assert math.isclose(t.min_probability, t.probabilities(np.array([20]))[0],
                            rel_tol=1e-12)
        t.update_priorities(np.arange(110, 140, dtype=np.uint64), np.zeros(30))
        assert math.isclose(t.min_probability, 1 / 30)  # all 0: uniform, as sampled


def test_sum_tree_rejects_bad_weights():
    tree = _tables.SumTree(4)
    with pytest.raises(errors.TableCoreError):
        tree.set(np.array([9], np.int64), np.array([1.0]))
    with pytest.raises(errors.TableCoreError):
        tree.set(np.array([0], np.int64), np.array([-1.0]))


def test_the_native_core_takes_selector_kinds_from_the_one_list():
    # selectors.KINDS is the one list of names; the core takes indices into it.
    assert _tables.SELECTOR_KINDS == len(KINDS)
    with pytest.raises(errors.TableCoreError, match="KINDS"):
        _tables.TableCore(len(KINDS), 1.0, 0, 1.0, 10, 0, 1)
    with pytest.raises(errors.TableCoreError, match="capacity"):
        core(capacity=0)


def test_the_table_core_loads_no_ucx(tmp_path):
    import subprocess
    import sys

    probe = ("import sys\nfrom distore_ucx.control.tables import Table\n"
             "t = Table.make('t', 10, ((4,), 'uint8'))\n"
             "assert not [m for m in sys.modules if m.startswith(('ucxx', 'libucx'))]\n"
             "assert 'libucp' not in open('/proc/self/maps').read()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # the installed package, not the checkout
    assert done.returncode == 0, done.stderr
