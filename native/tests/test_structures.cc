// The table core's building blocks, each against a plain reference: Column,
// the 8-ary sum tree with its min tree, the indexed heap, the key index and
// the sequence queue.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "check.h"
#include "column.h"
#include "heap.h"
#include "key_index.h"
#include "seq_queue.h"
#include "sum_tree.h"

using distore::Column;

TEST(column_grows_zeroed_keeping_its_values) {
  Column<uint64_t> c(10);
  CHECK_EQ(c.size(), size_t{10});
  for (size_t i = 0; i < 10; ++i) CHECK_EQ(c[i], uint64_t{0});
  for (size_t i = 0; i < 10; ++i) c[i] = i * 7 + 1;
  c.grow(11);  // doubles: the untouched part costs nothing
  CHECK_EQ(c.size(), size_t{20});
  c.grow_to(100000);  // past one page: mremap, maybe to another address
  CHECK_EQ(c.size(), size_t{100000});
  for (size_t i = 0; i < 10; ++i) CHECK_EQ(c[i], i * 7 + 1);
  for (size_t i = 10; i < 100000; i += 997) CHECK_EQ(c[i], uint64_t{0});
  c.grow(5);  // never shrinks
  CHECK_EQ(c.size(), size_t{100000});
  Column<uint64_t> moved(std::move(c));
  CHECK_EQ(c.size(), size_t{0});
  CHECK(c.data() == nullptr);
  CHECK_EQ(moved[9], uint64_t{64});
}

TEST(column_pages_cost_memory_only_once_written) {
  Column<uint8_t> c(size_t{64} << 20);
  CHECK_EQ(c.resident_bytes(), size_t{0});
  c[0] = 1;
  c[(size_t{64} << 20) - 1] = 1;
  const size_t resident = c.resident_bytes();
  // Two pages written (transparent huge pages may make each 2 MiB).
  CHECK(resident >= 2 * 4096);
  CHECK(resident <= size_t{4} << 20);
  CHECK_EQ(Column<double>().resident_bytes(), size_t{0});
}

TEST(sum_tree_matches_a_reference_under_random_updates) {
  std::mt19937_64 rng(5);
  for (size_t size : {1, 7, 8, 9, 64, 65, 300, 5000}) {
    distore::SumTree tree(size);
    CHECK(tree.capacity() >= size && tree.capacity() % 8 == 0);
    std::vector<double> ref(tree.capacity(), 0.0);
    std::uniform_int_distribution<size_t> pick(0, size - 1);
    std::uniform_real_distribution<double> weight(0.0, 1000.0);
    for (int k = 0; k < 400; ++k) {
      const size_t i = pick(rng);
      const double w = k % 5 == 0 ? 0.0 : weight(rng);  // some leaves go back to 0
      tree.set(i, w);
      ref[i] = w;
    }
    const double total = std::accumulate(ref.begin(), ref.end(), 0.0);
    CHECK_NEAR(tree.total(), total, 1e-12);
    double least = 0.0;
    for (double w : ref) {
      if (w > 0 && (least == 0.0 || w < least)) least = w;
    }
    CHECK_EQ(tree.min_positive(), least);
    for (size_t i = 0; i < size; ++i) CHECK_EQ(tree.get(i), ref[i]);
    if (total == 0.0) continue;
    // find: the leaf where the running sum first exceeds the prefix.
    std::vector<double> cum(ref.size());
    std::partial_sum(ref.begin(), ref.end(), cum.begin());
    std::uniform_real_distribution<double> prefix(0.0, total);
    std::vector<double> prefixes(100);
    for (auto& p : prefixes) p = prefix(rng);
    std::vector<int64_t> many(prefixes.size());
    tree.find_many(prefixes.data(), prefixes.size(), many.data());
    size_t agree = 0;
    for (size_t j = 0; j < prefixes.size(); ++j) {
      const size_t got = tree.find(prefixes[j]);
      CHECK_EQ(static_cast<int64_t>(got), many[j]);
      CHECK(ref[got] > 0.0);  // never a leaf of weight 0
      const size_t expect = std::upper_bound(cum.begin(), cum.end(), prefixes[j]) - cum.begin();
      agree += got == expect;
    }
    CHECK(agree >= 95);  // rounding at bucket edges may differ
  }
}

TEST(sum_tree_never_finds_a_zero_leaf_at_bucket_edges) {
  distore::SumTree tree(64);
  for (size_t i = 0; i < 64; i += 3) tree.set(i, 1.0);  // zeros between
  const double total = tree.total();
  CHECK_EQ(total, 22.0);
  for (double p = 0.0; p < total; p += 1.0) {  // exact edges
    const size_t leaf = tree.find(p);
    CHECK_EQ(leaf % 3, size_t{0});
    CHECK_EQ(leaf, static_cast<size_t>(p) * 3);
  }
  // Rounding can leave a prefix at the total: still a leaf with weight.
  CHECK(tree.get(tree.find(total)) > 0.0);
  CHECK(tree.get(tree.find(std::nextafter(total, 0.0))) > 0.0);
}

TEST(sum_tree_keeps_sums_and_minimum_when_it_grows) {
  distore::SumTree tree(8);
  CHECK_EQ(tree.min_positive(), 0.0);
  tree.set(3, 2.0);
  tree.set(5, 0.5);
  CHECK_EQ(tree.min_positive(), 0.5);
  tree.set(5, 0.0);  // a removed item is no minimum
  CHECK_EQ(tree.min_positive(), 2.0);
  double total = 2.0;
  for (size_t i = 8; i < 5000; ++i) {  // from one level to five, a resize at a time
    if (i >= tree.capacity()) tree.resize(i + 1);
    tree.set(i, 10000.0 - i);
    total += 10000.0 - i;
    CHECK_NEAR(tree.total(), total, 1e-12);
    CHECK_EQ(tree.min_positive(), std::min(2.0, 10000.0 - i));
  }
  CHECK_EQ(tree.get(3), 2.0);
  CHECK_EQ(tree.used(), size_t{5000});
  CHECK_EQ(tree.find(1.0), size_t{3});
}

namespace {

// The table core's columns for the heap and the queue: priority, seq + 1.
struct Columns {
  Column<double> priority;
  Column<uint64_t> seq1;
  void write(int64_t id, double p, uint64_t seq) {
    priority.grow(id + 1);
    seq1.grow(id + 1);
    priority[id] = p;
    seq1[id] = seq + 1;
  }
};

}  // namespace

TEST(heap_top_follows_a_reference_order_under_churn) {
  for (int kind = 0; kind < 4; ++kind) {  // min, max by priority; oldest, newest
    const bool max_heap = kind == 1 || kind == 3, by_seq = kind >= 2;
    Columns cols;
    distore::IndexedHeap heap(max_heap, by_seq, &cols.priority, &cols.seq1);
    // Reference: (key, seq) ordered so that begin() is the top.
    auto order = [&](int64_t id) {
      const double p = by_seq ? 0.0 : cols.priority[id];
      const double s = static_cast<double>(cols.seq1[id]);
      return std::make_pair(max_heap ? -p : p, (by_seq && max_heap) ? -s : s);
    };
    std::set<std::pair<std::pair<double, double>, int64_t>> ref;
    std::mt19937_64 rng(kind);
    std::uniform_int_distribution<int> prio(0, 20);  // ties happen
    uint64_t seq = 0;
    int64_t next_id = 0;
    std::vector<int64_t> live;
    for (int k = 0; k < 3000; ++k) {
      const int op = static_cast<int>(rng() % 4);
      if (op <= 1 || live.empty()) {
        cols.write(next_id, prio(rng), seq++);
        heap.push(next_id);
        ref.insert({order(next_id), next_id});
        live.push_back(next_id++);
      } else if (op == 2) {
        const size_t j = rng() % live.size();
        const int64_t id = live[j];
        ref.erase({order(id), id});
        heap.remove(id);
        CHECK(!heap.contains(id));
        live.erase(live.begin() + j);
      } else {
        const int64_t id = live[rng() % live.size()];
        ref.erase({order(id), id});
        cols.priority[id] = prio(rng);
        heap.update(id);
        ref.insert({order(id), id});
      }
      CHECK_EQ(heap.size(), ref.size());
      if (!ref.empty()) CHECK_EQ(heap.top(), ref.begin()->second);
    }
  }
}

TEST(key_index_agrees_with_a_map_under_churn_and_reused_ids) {
  Column<uint64_t> keys;
  distore::KeyIndex index;
  std::unordered_map<uint64_t, uint32_t> ref;  // key -> id
  std::vector<uint32_t> free_ids;
  uint32_t next_id = 0;
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<uint64_t> key_of(1, 3000);  // keys come back
  for (int k = 0; k < 40000; ++k) {
    const uint64_t key = key_of(rng);
    if (rng() % 3 != 0) {
      uint32_t id = next_id;
      if (!free_ids.empty()) {
        id = free_ids.back();
        free_ids.pop_back();
      } else {
        ++next_id;
      }
      keys.grow(id + 1);
      keys[id] = key;
      index.put(key, id, keys);  // a key present maps to its new id
      ref[key] = id;
    } else if (ref.count(key)) {
      const uint32_t id = ref[key];
      index.erase(key, id, keys);
      ref.erase(key);
      free_ids.push_back(id);
    }
    CHECK_EQ(index.size(), ref.size());
  }
  CHECK(index.slots() * 3 >= index.size() * 4);  // load at most 3/4
  for (uint64_t key = 0; key <= 3001; ++key) {
    const auto it = ref.find(key);
    CHECK_EQ(index.find(key, keys), it == ref.end() ? int64_t{-1} : int64_t{it->second});
  }
}

TEST(key_index_erase_of_a_stale_id_keeps_the_key) {
  Column<uint64_t> keys(4);
  distore::KeyIndex index;
  keys[0] = 42;
  index.put(42, 0, keys);
  keys[1] = 42;
  index.put(42, 1, keys);  // inserted again under another id: replaces
  CHECK_EQ(index.size(), size_t{1});
  index.erase(42, 0, keys);  // the old id leaving does not take the key
  CHECK_EQ(index.find(42, keys), int64_t{1});
  index.erase(42, 1, keys);
  CHECK_EQ(index.find(42, keys), int64_t{-1});
  CHECK_EQ(index.size(), size_t{0});
}

TEST(sequence_queue_tops_follow_sequences_under_churn_and_restores) {
  for (bool lifo : {false, true}) {
    Columns cols;
    distore::SequenceQueue q(lifo, &cols.seq1);
    std::map<uint64_t, int64_t> ref;  // seq -> id
    std::mt19937_64 rng(lifo);
    uint64_t seq = 1000;
    int64_t next_id = 0;
    for (int k = 0; k < 20000; ++k) {
      const int op = static_cast<int>(rng() % 8);
      if (op < 3 || ref.empty()) {
        // A restore pushes old sequences (below every live one), in any order.
        const uint64_t s = op == 0 && k % 50 == 0 ? rng() % 1000 : seq++;
        if (ref.count(s)) continue;
        cols.write(next_id, 0.0, s);
        q.push(next_id);
        ref[s] = next_id++;
      } else if (op < 6) {  // the top leaves (a full FIFO table evicting)
        const int64_t top = lifo ? ref.rbegin()->second : ref.begin()->second;
        CHECK_EQ(q.top(), top);
        q.remove(top);
        ref.erase(cols.seq1[top] - 1);
      } else {  // any id leaves: a hole
        auto it = ref.begin();
        std::advance(it, rng() % ref.size());
        q.remove(it->second);
        CHECK(!q.contains(it->second));
        ref.erase(it);
      }
      CHECK_EQ(q.size(), ref.size());
      if (!ref.empty()) CHECK_EQ(q.top(), lifo ? ref.rbegin()->second : ref.begin()->second);
    }
    // Holes are squeezed out: the queue holds under 1.75x the live ids + a grow step.
    CHECK(q.resident_bytes() < (size_t{1} << 20));
  }
}
