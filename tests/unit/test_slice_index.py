"""The control plane's slice index (native/slice_index.h): its valid starts
against a brute-force reference under random interleaved adds and removes,
chi-square of uniform and prioritized draws over 10^5 draws with fixed
seeds, expand, refusals, and memory a step."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from distore_ucx import _tables, errors

DRAWS = 100_000
MAX_ID = 2**32 - 2


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, expected_p):
    exp = expected_p * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def add(index, steps, last=None):
    """steps: [(id, episode, position, priority)]; last: a flag per step (it
    ends its episode), or None."""
    ids, eps, pos, prios = zip(*steps) if steps else ((), (), (), ())
    index.add(np.asarray(ids, np.int64), np.asarray(eps, np.uint64),
              np.asarray(pos, np.uint32), np.asarray(prios, np.float64),
              None if last is None else np.asarray(last, np.uint8))


def i64(a):
    return np.asarray(a, np.int64)


class Reference:
    """The steps as a dict and the valid starts by their definition."""

    def __init__(self, slice_len, period, prioritized, alpha, pad=0):
        self.T, self.P, self.prioritized, self.alpha = slice_len, period, prioritized, alpha
        self.pad = pad  # 0 strict, 1 short slices at any end, 2 short episodes (what is left)
        self.steps: dict[int, tuple[int, int]] = {}  # id -> (episode, position)
        self.at: dict[tuple[int, int], int] = {}  # (episode, position) -> id
        self.priority: dict[int, float] = {}
        self.last: set[int] = set()  # ids of steps that end their episode

    def add(self, steps, last=None):
        for k, (i, e, p, w) in enumerate(steps):
            self.steps[i] = (e, p)
            self.at[e, p] = i
            self.priority[i] = w
            self.last.discard(i)
            if last is not None and last[k]:
                self.last.add(i)

    def remove(self, ids):
        for i in ids:
            if i in self.steps:
                del self.at[self.steps.pop(i)]

    def run(self, i):
        """The ids of the present steps from i on, at most T."""
        e, p = self.steps[i]
        out = []
        while len(out) < self.T and (e, p + len(out)) in self.at:
            out.append(self.at[e, p + len(out)])
        return out

    def valid(self, i):
        p, run = self.steps[i][1], self.run(i)
        if p % self.P:
            return False
        if len(run) == self.T:
            return True
        return bool(self.pad) and run[-1] in self.last and (self.pad == 1 or p == self.first(i))

    def first(self, i):
        """The lowest position present in step i's episode."""
        e = self.steps[i][0]
        return min(q for f, q in self.steps.values() if f == e)

    def slice(self, i):
        run = self.run(i)
        return run + [run[-1]] * (self.T - len(run))

    def starts(self):
        return sorted(i for i in self.steps if self.valid(i))

    def probabilities(self, ids):
        starts = self.starts()
        out = np.zeros(len(ids))
        if not starts:
            return out
        w = {i: (self.priority[i] ** self.alpha if self.prioritized else 1.0) for i in starts}
        total = sum(w.values())
        for k, i in enumerate(ids):
            if i in w:
                out[k] = w[i] / total if total > 0 else 1 / len(starts)
        return out


def check(index, ref, universe):
    starts = ref.starts()
    assert index.steps == len(ref.steps)
    assert index.episodes == len({e for e, _ in ref.steps.values()})
    assert index.valid_starts == len(starts)
    got = index.probability(i64(universe))
    assert np.allclose(got, ref.probabilities(universe), rtol=1e-9, atol=0)
    assert np.array_equal(np.flatnonzero(got > 0), np.flatnonzero(ref.probabilities(universe)))
    if starts:
        assert index.expand(i64(starts)).reshape(-1, ref.T).tolist() == [
            ref.slice(i) for i in starts]
        ids, lengths = index.expand_lengths(i64(starts))
        assert ids.reshape(-1, ref.T).tolist() == [ref.slice(i) for i in starts]
        assert lengths.tolist() == [len(ref.run(i)) for i in starts]
        # expand refuses an id that is not a start: the two sets are equal
        p = ref.probabilities(starts)
        assert math.isclose(index.min_probability, p[p > 0].min(), rel_tol=1e-9)
    else:
        assert index.min_probability == 0.0
    present = sorted(ref.steps)
    assert index.position(i64(present)).tolist() == [ref.steps[i][1] for i in present]
    assert index.episode(i64(present)).tolist() == [ref.steps[i][0] for i in present]


@pytest.mark.parametrize("slice_len, period", [(1, 1), (1, 3), (3, 1), (4, 2), (5, 5),
                                               (8, 3), (40, 1)])
@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("pad", [0, 1, 2])
def test_valid_starts_match_a_brute_force_reference(slice_len, period, prioritized, pad):
    """Several episodes of random lengths (1 to 30: some shorter than the
    slice; most with their last step flagged) arrive in shuffled batches,
    lose steps in any order (holes, FIFO from the front, whole episodes),
    get some back under new ids, and change priorities; the index must agree
    with the definition after every batch, strict or with short slices."""
    rng = np.random.default_rng(slice_len * 100 + period + 7 * prioritized + 1000 * pad)
    alpha = 0.6
    index = _tables.SliceIndex(slice_len, period, prioritized, alpha, seed=3, pad=pad)
    ref = Reference(slice_len, period, prioritized, alpha, pad)
    free = list(range(400))[::-1]  # ids reused after removal, as the item store does
    pending = []  # (episode, position) not yet added
    next_episode = 10**12  # episode ids are any uint64
    universe = list(range(400))
    most_starts = 0
    for _ in range(300):
        op = rng.choice(["begin", "add", "add", "remove", "fifo", "drop", "priority"])
        if op == "begin" or not pending:
            length = int(rng.integers(1, 31))
            base = int(rng.choice([0, 0, 10**6]))  # a long episode's later window
            ends = rng.random() < 0.8  # else an episode still going
            pending += [(next_episode, base + p, ends and p == length - 1)
                        for p in range(length)]
            next_episode += int(rng.integers(1, 1000))
        elif op == "add":
            k = min(len(pending), int(rng.integers(1, 25)), len(free))
            picks = sorted(rng.choice(len(pending), k, replace=False).tolist(), reverse=True)
            batch = [pending.pop(j) for j in picks]  # out of order, across episodes
            steps = [(free.pop(), e, p, float(rng.choice([0.0, rng.uniform(0.1, 4.0)],
                                                          p=[0.1, 0.9])))
                     for e, p, _ in batch]
            last = [x for _, _, x in batch]
            add(index, steps, last)
            ref.add(steps, last)
        elif op == "remove" and ref.steps:
            gone = rng.choice(sorted(ref.steps), min(len(ref.steps), 6), replace=False).tolist()
            removed = {i: (*ref.steps[i], i in ref.last) for i in gone}
            unknown = [i for i in range(400) if i not in ref.steps][:1] + [-1, MAX_ID + 5]
            assert index.remove(i64(gone + unknown + gone)) == len(gone)  # unknown: skipped
            ref.remove(gone)
            for i in gone:
                if rng.random() < 0.5:  # a removed step may come back later (a hole heals)
                    pending.append(removed[i])
            free += gone
        elif op == "fifo" and ref.steps:
            oldest = sorted(ref.steps, key=lambda i: ref.steps[i][1])[:5]
            assert index.remove(i64(oldest)) == len(oldest)
            ref.remove(oldest)
            free += oldest
        elif op == "drop" and ref.steps:
            e = ref.steps[int(rng.choice(sorted(ref.steps)))][0]
            ids = [i for i, (ee, _) in ref.steps.items() if ee == e]
            assert index.remove(i64(ids)) == len(ids)
            ref.remove(ids)
            free += ids
        elif op == "priority" and ref.steps:
            ids = rng.choice(sorted(ref.steps), min(len(ref.steps), 8), replace=False).tolist()
            prios = rng.uniform(0.0, 3.0, len(ids)).tolist()
            assert index.set_priorities(i64(ids + [399 if 399 not in ref.steps else -1]),
                                        np.array(prios + [1.0])) == len(ids)
            for i, w in zip(ids, prios):
                ref.priority[i] = w
        check(index, ref, universe)
        most_starts = max(most_starts, index.valid_starts)
    # T = 40 is longer than every episode (30 steps at most): never a
    # strict start; short slices: those of the ended episodes
    if slice_len == 40:
        assert (most_starts > 0) if pad else (most_starts == 0)
    else:
        assert most_starts > 5


def test_holes_heal_and_episodes_arrive_backwards():
    index = _tables.SliceIndex(3)
    # positions 5, 4, ... 0 of one episode, one at a time: each completes one start
    for n, p in enumerate(range(5, -1, -1)):
        add(index, [(p, 9, p, 1.0)])
        assert index.valid_starts == max(0, n - 1)
    assert index.remove(i64([2])) == 1  # a hole: starts 0, 1, 2 go
    assert sorted(np.flatnonzero(index.probability(i64(range(6)))).tolist()) == [3]
    add(index, [(7, 9, 2, 1.0)])  # the hole heals under another id
    assert index.valid_starts == 4
    assert index.expand(i64([0, 1, 7])).tolist() == [0, 1, 7, 1, 7, 3, 7, 3, 4]


def test_the_ends_of_the_id_position_and_episode_ranges():
    index = _tables.SliceIndex(3)
    top = 2**32 - 1  # the last position: no step after it
    add(index, [(MAX_ID, 2**64 - 1, top, 1.0), (0, 2**64 - 1, top - 1, 1.0),
                (7, 2**64 - 1, top - 2, 1.0), (8, 0, 0, 1.0)])
    assert index.valid_starts == 1 and index.episodes == 2
    assert index.expand(i64([7])).tolist() == [7, 0, MAX_ID]
    assert index.episode(i64([MAX_ID, 8])).tolist() == [2**64 - 1, 0]
    assert index.position(i64([MAX_ID])).tolist() == [top]


def test_uniform_draws_are_uniform_over_valid_starts():
    index = _tables.SliceIndex(4, 2, seed=11)
    ref = Reference(4, 2, False, 1.0)
    rng = np.random.default_rng(5)
    steps, i = [], 0
    for e in range(6):
        for p in range(int(rng.integers(3, 25))):
            steps.append((i, e, p, float(rng.uniform(0.1, 5))))  # priorities do not matter
            i += 1
    order = rng.permutation(len(steps))
    add(index, [steps[k] for k in order])
    ref.add(steps)
    holes = rng.choice(len(steps), 8, replace=False).tolist()
    index.remove(i64(holes))
    ref.remove(holes)
    starts = ref.starts()
    assert len(starts) > 10 and index.valid_starts == len(starts)
    got, probs = index.sample(DRAWS)
    assert len(got) == DRAWS and np.all(probs == 1 / len(starts))
    assert set(got.tolist()) <= set(starts)
    counts = np.array([np.count_nonzero(got == s) for s in starts])
    assert chi2(counts, np.full(len(starts), 1 / len(starts))) < chi2_critical(len(starts) - 1)


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_prioritized_draws_follow_the_start_steps_priorities(alpha):
    index = _tables.SliceIndex(3, 1, prioritized=True, alpha=alpha, seed=2)
    ref = Reference(3, 1, True, alpha)
    rng = np.random.default_rng(int(alpha * 10))
    steps = [(e * 20 + p, e, p, float(rng.uniform(0.1, 5.0))) for e in range(3)
             for p in range(int(rng.integers(8, 20)))]
    add(index, steps)
    ref.add(steps)
    index.remove(i64([5, 26]))  # holes: starts 3..5 and 24..26 go
    ref.remove([5, 26])
    # new priorities, also on steps that are not starts (no effect on draws)
    ids = [s[0] for s in steps[::3] if s[0] in ref.steps]
    new = rng.uniform(0.1, 5.0, len(ids))
    assert index.set_priorities(i64(ids), new) == len(ids)
    for i, w in zip(ids, new):
        ref.priority[i] = float(w)
    starts = ref.starts()
    exact = ref.probabilities(starts)
    assert np.allclose(index.probability(i64(starts)), exact, rtol=1e-12)
    assert math.isclose(index.min_probability, exact.min(), rel_tol=1e-12)
    got, probs = index.sample(DRAWS)
    where = {s: k for k, s in enumerate(starts)}
    k = np.array([where[s] for s in got.tolist()])  # KeyError: drew a start that is not valid
    assert np.allclose(probs, exact[k], rtol=1e-12)
    counts = np.bincount(k, minlength=len(starts))
    assert chi2(counts, exact) < chi2_critical(len(starts) - 1)


def test_prioritized_with_all_zero_priorities_draws_uniformly():
    # As the table core's selector does (and Reverb): no weight, no preference.
    index = _tables.SliceIndex(2, prioritized=True, seed=4)
    add(index, [(p, 1, p, 0.0) for p in range(11)])
    got, probs = index.sample(20_000)
    assert np.all(probs == 1 / 10) and index.min_probability == 1 / 10
    assert chi2(np.bincount(got, minlength=10), np.full(10, 1 / 10)) < chi2_critical(9)


def test_sampling_with_no_valid_start_returns_nothing():
    index = _tables.SliceIndex(5)
    starts, probs = index.sample(8)
    assert starts.dtype == np.int64 and probs.dtype == np.float64
    assert len(starts) == len(probs) == 0 and index.min_probability == 0.0
    add(index, [(p, 1, p, 1.0) for p in range(4)])  # one step short of a slice
    assert len(index.sample(8)[0]) == 0
    add(index, [(4, 1, 4, 1.0)])
    assert index.sample(8)[0].tolist() == [0] * 8
    assert len(index.sample(0)[0]) == 0


def test_expand_returns_each_slice_in_position_order():
    index = _tables.SliceIndex(5, seed=1)
    rng = np.random.default_rng(8)
    ids = rng.permutation(np.arange(1000, 1060))  # ids need not follow positions
    steps = [(int(ids[e * 20 + p]), 77 + e, p, 1.0) for e in range(3) for p in range(20)]
    add(index, [steps[k] for k in rng.permutation(len(steps))])
    starts, _ = index.sample(500)
    slices = index.expand(starts).reshape(-1, 5)
    assert slices.dtype == np.int64 and slices.shape == (500, 5)
    assert np.array_equal(slices[:, 0], starts)
    for row in slices[:50]:
        eps = index.episode(row)
        pos = index.position(row).astype(np.int64)
        assert np.all(eps == eps[0]) and np.array_equal(np.diff(pos), np.ones(4))
    assert len(index.expand(i64([]))) == 0


def test_refusals_say_what_happened_and_change_nothing():
    index = _tables.SliceIndex(2)
    add(index, [(0, 1, 0, 1.0), (1, 1, 1, 1.0)])
    refused = [
        ([(2, 1, 2, 1.0), (3, 1, 1, 1.0)], r"\(episode 1, position 1\) is present already"),
        ([(2, 1, 2, 1.0), (3, 1, 2, 1.0)], r"\(episode 1, position 2\) is present already"),
        ([(2, 1, 2, 1.0), (2, 1, 3, 1.0)], "record id 2 appears twice in the batch"),
        ([(2, 1, 2, 1.0), (1, 5, 0, 1.0)], r"record id 1 is a step already \(episode 1"),
        ([(-1, 1, 2, 1.0)], "record id -1 is outside 0..4294967294"),
        ([(MAX_ID + 1, 1, 2, 1.0)], "record id 4294967295 is outside"),
        ([(2, 1, 2, float("nan"))], "priorities are finite and >= 0"),
        ([(2, 1, 2, -1.0)], "priorities are finite and >= 0"),
        ([(2, 1, 2, float("inf"))], "priorities are finite and >= 0"),
        ([(2, 1, 2**31, 1.0)], "more than 2\\^30 apart"),
    ]
    for steps, message in refused:
        with pytest.raises(errors.TableCoreError, match=message):
            add(index, steps)
        assert index.steps == 2 and index.valid_starts == 1 and index.episodes == 1
        assert index.probability(i64([0, 1, 2, 3])).tolist() == [1.0, 0, 0, 0]
    add(index, [(MAX_ID, 1, 2, 1.0)])  # the largest id is fine
    assert index.expand(i64([1])).tolist() == [1, MAX_ID]
    with pytest.raises(errors.TableCoreError, match="ids has 2 entries and positions 1"):
        index.add(i64([5, 6]), np.zeros(2, np.uint64), np.zeros(1, np.uint32), np.ones(2))
    with pytest.raises(errors.TableCoreError, match="priorities are finite"):
        index.set_priorities(i64([0]), np.array([-2.0]))
    with pytest.raises(errors.TableCoreError, match=r"\(episode 1, position 2\) is not a valid "
                                                    "start now"):
        index.expand(i64([0, MAX_ID]))
    with pytest.raises(errors.TableCoreError, match="record id 9 is not a step"):
        index.expand(i64([9]))
    for read in (index.position, index.episode):
        with pytest.raises(errors.TableCoreError, match="record id -3 is not a step"):
            read(i64([0, -3]))
    with pytest.raises(errors.TableCoreError, match="n >= 0"):
        index.sample(-1)
    assert index.probability(i64([-5, 2**40, 9])).tolist() == [0, 0, 0]


@pytest.mark.parametrize("args, message", [((0,), "slice_len 0 is not in 1..2\\^30"),
                                           ((-4,), "slice_len -4"),
                                           ((2**31,), "slice_len 2147483648"),
                                           ((2, 0), "period 0 is not in 1..2\\^30"),
                                           ((2, 1, True, -1.0), "alpha"),
                                           ((2, 1, True, float("nan")), "alpha")])
def test_bad_parameters_are_refused(args, message):
    with pytest.raises(errors.TableCoreError, match=message):
        _tables.SliceIndex(*args)


def test_parameters_and_defaults():
    index = _tables.SliceIndex(7)
    assert (index.slice_len, index.period, index.prioritized) == (7, 1, False)
    index = _tables.SliceIndex(slice_len=3, period=2, prioritized=True, alpha=0.5, seed=9)
    assert (index.slice_len, index.period, index.prioritized) == (3, 2, True)


def test_episodes_without_steps_are_forgotten():
    index = _tables.SliceIndex(4, prioritized=True)
    add(index, [(e * 50 + p, e, p, 1.0) for e in range(20) for p in range(50)])
    assert index.episodes == 20 and index.memory_usage()["windows"] > 20 * 200
    index.remove(i64(range(500)))  # ten whole episodes
    assert index.episodes == 10
    index.remove(i64(range(1000)))
    assert index.episodes == index.steps == index.valid_starts == 0
    assert index.memory_usage()["windows"] == 0
    add(index, [(3, 12345, 0, 1.0)])  # slots are reused
    assert index.episodes == 1 and index.episode(i64([3])).tolist() == [12345]


def test_windows_follow_the_span_not_the_positions():
    """A continuing episode far from position 0 whose oldest steps leave as
    new ones come (FIFO): its window stays the size of what is present."""
    index = _tables.SliceIndex(16, prioritized=True)
    present = 1000
    pos = 3_000_000_000  # positions are uint32
    for step in range(40):
        ids = np.arange(step * 500, (step + 1) * 500, dtype=np.int64) % 4000
        index.add(ids, np.full(500, 5, np.uint64),
                  np.arange(pos + step * 500, pos + (step + 1) * 500, dtype=np.uint32),
                  np.ones(500))
        if index.steps > present:
            old = np.arange(step * 500 - present, (step + 1) * 500 - present) % 4000
            index.remove(old.astype(np.int64))
        assert index.memory_usage()["windows"] <= 4 * 4 * present + 64
        assert index.valid_starts == index.steps - 15
    # the window wrapped around its ring many times; every slice is still whole
    starts, _ = index.sample(200)
    pos_of = index.position(index.expand(starts)).reshape(-1, 16).astype(np.int64)
    assert np.all(np.diff(pos_of, axis=1) == 1)
    live = [k % 4000 for k in range(19_000, 20_000)]  # position pos + k: id k % 4000
    index.remove(i64(live[200:800]))  # a hole of 600 steps in the middle
    assert index.valid_starts == 2 * (200 - 15)
    index.remove(i64(live[:200]))  # the front leaves: the window shrinks to what is left
    assert index.valid_starts == 200 - 15
    assert index.memory_usage()["windows"] <= 4 * 4 * 200 + 64


@pytest.mark.parametrize("length, slice_len, bound", [(100, 40, 50), (1, 1, 100)])
def test_memory_per_step_at_a_million_steps(length, slice_len, bound):
    """DESIGN.md: the control plane holds about 100 bytes a stored step, all
    structures included; measured at 10^6 steps in episodes of 100 steps, and
    of one step (the worst case: an episode's own records on every step)."""
    n = 1_000_000
    for prioritized in (False, True):
        index = _tables.SliceIndex(slice_len, 1, prioritized)
        # 1000 writers at once, each on its episode (id = episode * length +
        # position): a batch holds 10 steps of each of 1000 episodes.
        order = np.arange(n, dtype=np.int64)
        if length == 100:
            order = order.reshape(-1, 1000, 10, 10).transpose(0, 2, 1, 3).reshape(-1)
        for lo in range(0, n, 100_000):
            chunk = order[lo:lo + 100_000]
            index.add(chunk, (chunk // length).astype(np.uint64),
                      (chunk % length).astype(np.uint32), np.ones(len(chunk)))
        assert index.steps == n and index.episodes == n // length
        assert index.valid_starts == n // length * (length - slice_len + 1)
        usage = index.memory_usage()
        per_step = sum(usage.values()) / n
        print(f"episodes of {length}, prioritized={prioritized}: {per_step:.1f} bytes a step",
              usage)
        assert per_step < bound, usage


def test_a_second_thread_inside_the_index_is_refused_not_raced():
    """Calls release the GIL and the index has no locks (one caller thread):
    a call while another thread is inside it is an error, and the first call
    completes unharmed."""
    index = _tables.SliceIndex(8)
    n = 1_000_000
    for attempt in range(10):  # until the probe lands inside an add (almost always the first)
        ids = np.arange(attempt * n, (attempt + 1) * n, dtype=np.int64)
        adding = threading.Thread(target=index.add, args=(
            ids, np.full(n, attempt, np.uint64), np.arange(n, dtype=np.uint32), np.ones(n)))
        refused = None
        adding.start()
        while adding.is_alive() and refused is None:
            try:
                index.probability(i64([0]))
            except errors.TableCoreError as e:
                refused = str(e)
        adding.join()
        assert index.steps == (attempt + 1) * n
        if refused is not None:
            assert "another thread is inside this index" in refused
            return
    pytest.fail("no call landed inside another thread's add in 10 tries")


def test_short_episodes_start_what_is_left_of_an_episode_whose_head_left():
    # pad 2 (TorchRL's strict_length=False): an episode of 10 steps with
    # T = 8 gives full slices only; once its first 4 steps are evicted,
    # what is left (6 steps) is shorter than T and is one short slice from
    # its first present step, as TorchRL samples a trajectory its storage
    # holds part of. A step arriving below it moves the start there.
    index = _tables.SliceIndex(8, pad=2, seed=1)
    add(index, [(i, 7, i, 1.0) for i in range(10)], last=[0] * 9 + [1])
    assert index.valid_starts == 3  # 0, 1, 2: full
    index.remove(i64([0, 1, 2, 3]))
    assert index.valid_starts == 1
    ids, lengths = index.expand_lengths(i64([4]))
    assert ids.tolist() == [4, 5, 6, 7, 8, 9, 9, 9] and lengths.tolist() == [6]
    index.remove(i64([4]))
    assert index.valid_starts == 1 and index.expand_lengths(i64([5]))[1].tolist() == [5]
    with pytest.raises(errors.TableCoreError):
        index.expand(i64([4]))  # gone
    add(index, [(13, 7, 3, 1.0)])  # position 3 again, below the first: a gap at 4
    # 3's run (one step) does not reach the end: no start; 5 is not first.
    assert index.valid_starts == 0
    add(index, [(14, 7, 4, 1.0)])  # 3..9: 7 steps, one short slice from 3
    assert index.valid_starts == 1 and index.expand_lengths(i64([13]))[1].tolist() == [7]
