"""The compact control-plane structures of issue #16: the table core's key
index, its column-backed selectors and sum tree, the item store's
allocator and the ITEM_LOCATION records joined from the store and the core."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distore_ucx import _tables, errors
from distore_ucx.control.items import FREE, LIVE, RETIRED, ItemStore
from distore_ucx.control.tables import Table
from distore_ucx.protocol import ITEM_LOCATION
from distore_ucx.selectors import KINDS, Prioritized
from distore_ucx.spec import TableSpec

SPEC = TableSpec.parse(((8,), "uint8"))


def core(sampler="uniform", remover="fifo", capacity=1 << 30, max_times=0, seed=7):
    return _tables.TableCore(KINDS.index(sampler), 1.0, KINDS.index(remover), 1.0, capacity,
                             max_times, seed)


def i64(a):
    return np.asarray(a, np.int64)


def u64(a):
    return np.asarray(a, np.uint64)


# -- key index --------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "update"]),
                          st.lists(st.integers(0, 40), min_size=1, max_size=12)),
                min_size=1, max_size=40))
def test_key_index_matches_a_dict_under_inserts_removes_and_id_reuse(ops):
    """Keys drawn from a small range collide often; ids are reused LIFO as the
    item store reuses them; the index must agree with a dict at every step."""
    t = core()
    by_key: dict[int, int] = {}  # key -> id, latest insert wins
    key_of: dict[int, int] = {}  # live id -> key
    free: list[int] = []
    next_id = 0
    for op, keys in ops:
        if op == "insert":
            ids = []
            for _ in keys:
                if free:
                    ids.append(free.pop())
                else:
                    ids.append(next_id)
                    next_id += 1
            t.insert(i64(ids), u64(keys), np.ones(len(keys)))
            for i, k in zip(ids, keys):
                by_key[k] = i
                key_of[i] = k
        elif op == "remove":
            live = sorted(key_of)
            gone = [live[k % len(live)] for k in keys] if live else []
            gone = list(dict.fromkeys(gone))
            assert t.remove(i64(gone)) == len(gone)
            for i in gone:
                k = key_of.pop(i)
                if by_key.get(k) == i:
                    del by_key[k]
                free.append(i)
        else:
            expected = sum(1 for k in keys if k in by_key)
            assert t.update_priorities(u64(keys), np.full(len(keys), 2.0)) == expected
        probe = np.arange(0, 41, dtype=np.uint64)
        assert t.lookup(probe).tolist() == [by_key.get(k, -1) for k in range(41)]
        assert t.size == len(key_of)


def test_key_index_grows_and_shrinks_with_many_items():
    n = 200_000
    t = core(capacity=n)
    rng = np.random.default_rng(1)
    keys = rng.permutation(n).astype(np.uint64) * np.uint64(0x10001) + np.uint64(1 << 40)
    ids = np.arange(n, dtype=np.int64)
    for i in range(0, n, 4096):
        t.insert(ids[i:i + 4096], keys[i:i + 4096], np.ones(len(ids[i:i + 4096])))
    assert (t.lookup(keys) == ids).all()
    gone = ids[::2]
    assert t.remove(gone) == len(gone)
    found = t.lookup(keys)
    assert (found[::2] == -1).all() and (found[1::2] == ids[1::2]).all()
    # Reuse the removed ids for new keys: old keys stay unknown.
    fresh = keys[::2] + np.uint64(1)
    t.insert(gone, fresh, np.ones(len(gone)))
    assert (t.lookup(fresh) == gone).all()
    assert (t.lookup(keys[::2]) == -1).all()
    assert (t.lookup(keys[1::2]) == ids[1::2]).all()


def test_a_key_inserted_again_points_at_the_new_item_until_that_leaves():
    t = core()
    t.insert(i64([0]), u64([5]), np.ones(1))
    t.insert(i64([1]), u64([5]), np.ones(1))
    assert t.lookup(u64([5])).tolist() == [1]
    t.remove(i64([0]))  # the older item leaving keeps the newer one findable
    assert t.lookup(u64([5])).tolist() == [1]
    t.remove(i64([1]))
    assert t.lookup(u64([5])).tolist() == [-1]


def test_ids_beyond_32_bits_are_refused_clearly():
    t = core()
    with pytest.raises(errors.TableCoreError, match="32-bit"):
        t.insert(i64([1 << 32]), u64([1]), np.ones(1))
    with pytest.raises(errors.TableCoreError, match="2\\^64 - 1"):
        t.restore(i64([0]), u64([1]), np.ones(1), np.zeros(1, np.uint32),
                  u64([np.iinfo(np.uint64).max]))
    assert t.size == 0


# -- selectors on columns -----------------------------------------------------

def test_sum_tree_keeps_exact_probabilities_as_it_grows():
    """Ids spread over several powers of two: every growth copies the used
    part of the tree; probabilities stay p / total exactly."""
    t = core("prioritized")
    rng = np.random.default_rng(2)
    ids, prios = [], []
    for size in (1, 3, 60, 700, 5000):
        new = np.arange(len(ids), size, dtype=np.int64)
        p = rng.uniform(0.1, 3.0, len(new))
        t.insert(new, new.astype(np.uint64) + np.uint64(9), p)
        ids.extend(new.tolist())
        prios.extend(p.tolist())
        got = t.probabilities(i64(ids))
        want = np.array(prios) / np.sum(prios)
        assert np.allclose(got, want, rtol=1e-12, atol=0)


def test_all_zero_priorities_sample_only_members_when_they_are_sparse():
    """Reverb's uniform fallback, with 10 members left among 100,000 ids (the
    draw cannot find them by chance: it builds the member list)."""
    n = 100_000
    t = core("prioritized")
    ids = np.arange(n, dtype=np.int64)
    t.insert(ids, ids.astype(np.uint64), np.zeros(n))
    keep = np.arange(0, n, n // 10, dtype=np.int64)
    t.remove(np.setdiff1d(ids, keep))
    got, probs, _ = t.sample(20_000)
    assert set(got.tolist()) == set(keep.tolist())
    assert np.allclose(probs, 0.1)
    counts = np.bincount(np.searchsorted(keep, got), minlength=10)
    assert counts.min() > 1500  # uniform: 2000 each expected
    # a member added later is drawn too (the list is rebuilt)
    t.insert(i64([7]), u64([n + 7]), np.zeros(1))
    assert 7 in set(t.sample(5000)[0].tolist())


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["fifo", "lifo", "min_heap", "max_heap"]),
       st.lists(st.tuples(st.sampled_from(["insert", "remove", "update", "select"]),
                          st.integers(0, 1000)), min_size=1, max_size=80))
def test_heap_selectors_agree_with_a_sorted_reference(kind, ops):
    """The heaps read priorities and sequences from the core's columns: after
    any mix of inserts, removals and priority updates, the sampler's choice
    is the reference's first item."""
    t = core(sampler=kind, remover="fifo")
    items: dict[int, list] = {}  # id -> [priority, seq, key]
    next_id, seq = 0, 0
    for op, x in ops:
        if op == "insert":
            i = next_id
            next_id += 1
            t.insert(i64([i]), u64([i]), np.array([float(x % 7)]))
            items[i] = [float(x % 7), seq, i]
            seq += 1
        elif items and op == "remove":
            i = sorted(items)[x % len(items)]
            t.remove(i64([i]))
            del items[i]
        elif items and op == "update":
            i = sorted(items)[x % len(items)]
            t.update_priorities(u64([items[i][2]]), np.array([float(x % 5)]))
            items[i][0] = float(x % 5)
        if items and op == "select":
            order = {
                "fifo": lambda i: items[i][1],
                "lifo": lambda i: -items[i][1],
                "min_heap": lambda i: (items[i][0], items[i][1]),
                "max_heap": lambda i: (-items[i][0], items[i][1]),
            }[kind]
            want = min(items, key=order)
            assert t.probabilities(i64([want])).tolist() == [1.0]
            assert t.sample(1)[0].tolist() == [want]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fifo", "lifo"]),
       st.permutations(list(range(40))),
       st.lists(st.tuples(st.sampled_from(["insert", "remove", "select"]), st.integers(0, 1000)),
                min_size=1, max_size=300))
def test_fifo_and_lifo_follow_sequences_after_restores_removals_and_reused_ids(kind, order, ops):
    """FIFO/LIFO keep insertion-sequence order through a restore that puts
    items back out of order, removals anywhere, ids reused by newer items
    and the queue's compactions (hundreds of ops over few ids)."""
    t = core(sampler=kind, remover="fifo")
    seqs = {}  # id -> sequence
    ids = i64(order[:20])  # a checkpoint's items, in record order, not sequence order
    back = np.array([1000 + 7 * ((i * 13) % 20) for i in range(20)], np.uint64)
    t.restore(ids, ids.astype(np.uint64) + np.uint64(10_000), np.ones(20),
              np.zeros(20, np.uint32), back)
    seqs.update({int(i): int(q) for i, q in zip(ids, back)})
    seq = t.next_seq
    free = [i for i in range(40) if i not in seqs]
    key = 50_000
    for op, x in ops:
        if op == "insert" and free:
            i = free.pop(x % len(free))  # a freed id is reused by a newer item
            t.insert(i64([i]), u64([key]), np.ones(1))
            key += 1
            seqs[i] = seq
            seq += 1
        elif op == "remove" and seqs:
            i = sorted(seqs)[x % len(seqs)]
            t.remove(i64([i]))
            del seqs[i]
            free.append(i)
        if seqs:
            want = (min if kind == "fifo" else max)(seqs, key=seqs.get)
            assert t.sample(1)[0].tolist() == [want]
            assert t.probabilities(i64([want])).tolist() == [1.0]


def test_a_full_fifo_table_evicts_oldest_first_through_many_compactions():
    """20,000 inserts into a table of 100 (each evicts), with removals
    anywhere: the queue squeezes its holes out many times over and every
    eviction is still the oldest item left."""
    rng = np.random.default_rng(3)
    t = core(sampler="uniform", remover="fifo", capacity=100)
    live = {}  # id -> sequence
    free = list(range(200))
    for seq in range(20_000):
        if len(live) > 10 and rng.random() < 0.2:
            i = int(rng.choice(sorted(live)))
            t.remove(i64([i]))
            del live[i]
            free.append(i)
        i = free.pop(0)
        evicted = t.insert(i64([i]), u64([1_000_000 + seq]), np.ones(1)).tolist()
        if len(live) == 100:
            oldest = min(live, key=live.get)
            assert evicted == [oldest], seq
            del live[oldest]
            free.append(oldest)
        else:
            assert evicted == []
        live[i] = seq


# -- item store and the records of a table -------------------------------------

def test_item_store_hands_out_fresh_ids_in_order_and_reuses_released_ones_first():
    s = ItemStore(4, limit=10)
    assert s.alloc(3).tolist() == [0, 1, 2]
    s.release(np.array([1, 0], np.int64))
    assert s.alloc(4).tolist() == [0, 1, 3, 4]  # released (last first), then fresh
    assert s.capacity == 8  # doubled from 4
    assert s.alloc(4).tolist() == [5, 6, 7, 8]
    assert s.capacity == 10  # no further than the limit while it suffices
    s.alloc(2)
    assert s.capacity == 11  # past it: what is needed, or an eighth more
    assert (s.state == FREE).all()


def test_standalone_item_store_keeps_its_own_keys():
    s = ItemStore(8)
    recs = s.alloc(3)
    s.set_keys(recs, u64([7, 8, 9]))
    s.node[recs] = 2
    s.offset[recs] = u64([64, 128, 1 << 63])  # the top bit of offset is kept
    s.generation[recs] = 5
    loc = s.locations(recs[::-1])
    assert loc.dtype == ITEM_LOCATION
    assert loc["key"].tolist() == [9, 8, 7]
    assert loc["offset"].tolist() == [1 << 63, 128, 64]
    assert (loc["node"] == 2).all() and (loc["generation"] == 5).all()
    assert (loc["pad"] == 0).all()
    assert s.keys(recs).tolist() == [7, 8, 9] and s.keys(s.node == 2).tolist() == [7, 8, 9]


def test_table_locations_join_the_store_and_the_core():
    t = Table.make("t", 100, SPEC)
    keys = u64(range(1000, 1010))
    offsets = u64(range(0, 640, 64))
    offsets[3] |= np.uint64(1 << 63)  # a cold item's marker survives
    t.add(4, keys, offsets, keys + np.uint64(1), np.ones(10))
    recs = np.flatnonzero(t.store.state == LIVE)
    loc = t.locations(recs)
    assert loc.dtype == ITEM_LOCATION and loc.tobytes()[:4] == np.uint32(4).tobytes()
    assert loc["key"].tolist() == keys.tolist()
    assert loc["offset"].tolist() == offsets.tolist()
    assert loc["generation"].tolist() == (keys + np.uint64(1)).tolist()
    assert (loc["pad"] == 0).all() and (loc["node"] == 4).all()
    assert t.store.keys(recs).tolist() == keys.tolist()
    assert not hasattr(t.store, "key")  # the core holds them: no column to copy whole
    with pytest.raises(errors.TableCoreError, match="outside the item store"):
        t.locations(i64([t.store.capacity]))


def test_keys_of_items_evicted_while_leased_stay_readable():
    """An evicted item a learner still reads keeps its key (the checkpoint's
    retired list, a late sample reply) until its record is freed."""
    t = Table.make("t", 4, SPEC, sampler=Prioritized(1.0))
    t.add(1, u64([10, 11, 12, 13]), u64([0, 64, 128, 192]), u64([1, 1, 1, 1]), np.ones(4))
    recs = np.flatnonzero(t.store.state == LIVE)
    t.lease(recs)
    t.add(1, u64([20, 21]), u64([256, 320]), u64([2, 2]), np.ones(2))  # evicts 10, 11
    retired = np.flatnonzero(t.store.state == RETIRED)
    assert sorted(t.store.keys(retired).tolist()) == [10, 11]
    assert sorted(t.locations(retired)["key"].tolist()) == [10, 11]
    assert sorted(t.image().retired.tolist()) == [10, 11]
    assert t.core.lookup(u64([10, 11, 20])).tolist()[:2] == [-1, -1]
    freed = t.unlease(recs)
    assert sorted(freed.offsets.tolist()) == [0, 64]
    # the freed records are reused for new keys; the core tells them apart
    t.add(1, u64([30, 31]), u64([0, 64]), u64([3, 3]), np.ones(2))  # evicts 12, 13
    assert set(t.store.keys(t.store.state == LIVE).tolist()) == {20, 21, 30, 31}
    assert sorted(t.core.lookup(u64([30, 31])).tolist()) == sorted(retired.tolist())
    assert t.core.lookup(u64([10, 11, 12, 13])).tolist() == [-1] * 4


def test_the_core_reports_its_memory_by_structure():
    """About 61 bytes an item in the core at 10^6 items (key 8, priority 8,
    times 4, sequence 8, key index 5-11, sum tree 16, FIFO queue 8); huge
    pages may round each structure up by 2 MiB."""
    n = 1_000_000
    t = core("prioritized", capacity=n)
    ids = np.arange(n, dtype=np.int64)
    for i in range(0, n, 1 << 16):
        b = ids[i:i + (1 << 16)]
        t.insert(b, b.astype(np.uint64), np.ones(len(b)))
    usage = t.memory_usage()
    assert {"key", "priority", "times_sampled", "sequence", "key_index",
            "sampler.sum_tree", "remover.queue"} <= set(usage)
    per_item = sum(usage.values()) / n
    assert 55 <= per_item <= 85, usage
