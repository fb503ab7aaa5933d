// The table core and its selectors (Reverb's): exact probabilities and
// chi-square over 10^5 draws with fixed seeds, the removers' eviction
// order, max_times_sampled, priority updates, restores and refusals.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "check.h"
#include "selector.h"
#include "table_core.h"

using distore::SelectorKind;
using distore::TableCore;
using distore::TableError;
using distore_test::chi2;
using distore_test::chi2_critical;

namespace {

constexpr size_t kDraws = 100000;

TableCore core(SelectorKind sampler, double alpha = 1.0, SelectorKind remover = SelectorKind::kFifo,
               uint64_t capacity = 1000, uint32_t max_times = 0, uint64_t seed = 7) {
  return TableCore(sampler, alpha, remover, 1.0, capacity, max_times, seed);
}

// Items 0..n-1 with keys 100.. and the given priorities; returns what was evicted.
std::vector<int64_t> fill(TableCore& t, const std::vector<double>& priorities, int64_t first = 0) {
  std::vector<int64_t> ids;
  std::vector<uint64_t> keys;
  for (size_t i = 0; i < priorities.size(); ++i) {
    ids.push_back(first + static_cast<int64_t>(i));
    keys.push_back(100 + first + i);
  }
  std::vector<int64_t> evicted;
  t.insert(ids.data(), keys.data(), priorities.data(), ids.size(), &evicted);
  return evicted;
}

struct Draws {
  std::vector<int64_t> ids, exhausted;
  std::vector<double> probabilities;
};
Draws draw(TableCore& t, size_t n = kDraws) {
  Draws d;
  t.sample(n, &d.ids, &d.probabilities, &d.exhausted);
  return d;
}

std::vector<double> counts(const std::vector<int64_t>& ids, size_t n) {
  std::vector<double> c(n, 0.0);
  for (int64_t id : ids) c.at(static_cast<size_t>(id)) += 1;
  return c;
}

std::vector<double> uniform_priorities(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> p(n);
  for (auto& x : p) x = u(rng);
  return p;
}

}  // namespace

TEST(prioritized_draws_match_exact_probabilities) {
  for (double alpha : {1.0, 0.6, 0.0}) {
    const auto prios = uniform_priorities(50, 1, 0.1, 5.0);
    auto t = core(SelectorKind::kPrioritized, alpha);
    fill(t, prios);
    std::vector<double> exact(50);
    double total = 0.0;
    for (size_t i = 0; i < 50; ++i) total += exact[i] = std::pow(prios[i], alpha);
    for (auto& p : exact) p /= total;
    for (int64_t i = 0; i < 50; ++i) CHECK_NEAR(t.probability(i), exact[i], 1e-12);
    const Draws d = draw(t);
    CHECK_EQ(d.ids.size(), kDraws);
    for (size_t k = 0; k < kDraws; ++k) CHECK_NEAR(d.probabilities[k], exact[d.ids[k]], 1e-12);
    CHECK(chi2(counts(d.ids, 50), exact) < chi2_critical(49));
  }
}

TEST(uniform_draws_are_uniform_whatever_the_priorities) {
  auto t = core(SelectorKind::kUniform);
  fill(t, uniform_priorities(40, 2, 0.0, 9.0));
  const Draws d = draw(t);
  for (double p : d.probabilities) CHECK_EQ(p, 1.0 / 40);
  CHECK(chi2(counts(d.ids, 40), std::vector<double>(40, 1.0 / 40)) < chi2_critical(39));
}

TEST(prioritized_with_all_zero_priorities_is_uniform) {
  auto t = core(SelectorKind::kPrioritized);
  fill(t, std::vector<double>(20, 0.0));
  const Draws d = draw(t, 20000);
  for (double p : d.probabilities) CHECK_EQ(p, 1.0 / 20);
  CHECK(chi2(counts(d.ids, 20), std::vector<double>(20, 1.0 / 20)) < chi2_critical(19));
}

TEST(all_zero_weights_over_sparse_ids_draw_only_members) {
  // Three members among 200000 ids: rejection over the ids misses, the
  // selector falls back to a list of its members.
  auto t = core(SelectorKind::kPrioritized, 1.0, SelectorKind::kFifo, 10);
  const int64_t ids[] = {5, 100000, 199999};
  const uint64_t keys[] = {1, 2, 3};
  const double zero[] = {0.0, 0.0, 0.0};
  std::vector<int64_t> evicted;
  t.insert(ids, keys, zero, 3, &evicted);
  const Draws d = draw(t, 30000);
  std::vector<double> c(3, 0.0);
  for (int64_t id : d.ids) {
    const size_t k = id == 5 ? 0 : id == 100000 ? 1 : id == 199999 ? 2 : 3;
    CHECK(k < 3);  // a member, never another id
    c[k] += 1;
  }
  CHECK(chi2(c, {1.0 / 3, 1.0 / 3, 1.0 / 3}) < chi2_critical(2));
}

TEST(priority_updates_change_the_distribution) {
  auto t = core(SelectorKind::kPrioritized);
  fill(t, std::vector<double>(10, 1.0));
  std::vector<uint64_t> keys;
  std::vector<double> fresh;
  for (int i = 0; i < 10; ++i) {
    keys.push_back(100 + i);
    fresh.push_back(i + 1.0);
  }
  CHECK_EQ(t.update_priorities(keys.data(), fresh.data(), 10), size_t{10});
  const uint64_t unknown = 999;
  CHECK_EQ(t.update_priorities(&unknown, fresh.data(), 1), size_t{0});
  std::vector<double> exact(10);
  for (int i = 0; i < 10; ++i) exact[i] = (i + 1.0) / 55.0;
  for (int i = 0; i < 10; ++i) CHECK_NEAR(t.probability(i), exact[i], 1e-12);
  CHECK_EQ(t.priority(4), 5.0);
  CHECK(chi2(counts(draw(t).ids, 10), exact) < chi2_critical(9));
}

TEST(deterministic_samplers_and_heap_ties) {
  const std::vector<double> prios = {3.0, 9.0, 5.0, 1.0, 5.0};
  const std::pair<SelectorKind, int64_t> cases[] = {{SelectorKind::kFifo, 0},
                                                     {SelectorKind::kLifo, 4},
                                                     {SelectorKind::kMinHeap, 3},
                                                     {SelectorKind::kMaxHeap, 1}};
  for (const auto& [kind, expected] : cases) {
    auto t = core(kind);
    fill(t, prios);
    const Draws d = draw(t, 100);
    for (size_t k = 0; k < 100; ++k) {
      CHECK_EQ(d.ids[k], expected);
      CHECK_EQ(d.probabilities[k], 1.0);
    }
    CHECK_EQ(t.times_sampled(expected), uint32_t{100});
  }
  auto t = core(SelectorKind::kMaxHeap);
  fill(t, {1.0, 5.0, 5.0, 5.0});
  CHECK_EQ(draw(t, 3).ids, (std::vector<int64_t>{1, 1, 1}));  // ties: the oldest
}

TEST(removers_evict_in_their_order) {
  // Reverb: an item arriving at capacity first evicts the remover's choice.
  const std::pair<SelectorKind, std::vector<int64_t>> cases[] = {
      {SelectorKind::kFifo, {0, 1}},
      {SelectorKind::kLifo, {4, 5}},
      {SelectorKind::kMinHeap, {3, 0}},
      {SelectorKind::kMaxHeap, {1, 5}}};
  for (const auto& [kind, evicted] : cases) {
    auto t = core(SelectorKind::kUniform, 1.0, kind, 5, 0, 1);
    fill(t, {3.0, 9.0, 5.0, 1.0, 5.0});
    auto out = fill(t, {7.0}, 5);
    const auto out2 = fill(t, {0.5}, 6);
    out.insert(out.end(), out2.begin(), out2.end());
    CHECK_EQ(out, evicted);
    CHECK_EQ(t.size(), size_t{5});
    for (int64_t id : evicted) CHECK(!t.contains(id));
  }
}

TEST(uniform_remover_evicts_uniformly) {
  std::vector<double> c(10, 0.0);
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    auto t = core(SelectorKind::kUniform, 1.0, SelectorKind::kUniform, 10, 0, seed);
    fill(t, std::vector<double>(10, 1.0));
    const auto out = fill(t, {1.0}, 10);
    CHECK_EQ(out.size(), size_t{1});
    c[out[0]] += 1;
  }
  CHECK(chi2(c, std::vector<double>(10, 0.1)) < chi2_critical(9));
}

TEST(a_batch_larger_than_capacity_keeps_the_newest) {
  auto t = core(SelectorKind::kUniform, 1.0, SelectorKind::kFifo, 5);
  const auto evicted = fill(t, std::vector<double>(12, 1.0));
  CHECK_EQ(evicted, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  for (int64_t id = 7; id < 12; ++id) CHECK(t.contains(id));
  CHECK_EQ(t.record_key(0), uint64_t{100});  // kept after the item left
  CHECK_EQ(t.record_key(1000), uint64_t{0});
}

TEST(max_times_sampled_removes_items_between_draws) {
  auto t = core(SelectorKind::kFifo, 1.0, SelectorKind::kFifo, 1000, 3);
  fill(t, {1.0, 1.0});
  CHECK_EQ(t.remaining_uses(), uint64_t{6});
  const Draws d = draw(t, 10);  // only 6 uses exist
  CHECK_EQ(d.ids, (std::vector<int64_t>{0, 0, 0, 1, 1, 1}));
  CHECK_EQ(d.exhausted, (std::vector<int64_t>{0, 1}));
  CHECK_EQ(t.size(), size_t{0});
  CHECK_EQ(t.remaining_uses(), uint64_t{0});
}

TEST(remove_lookup_and_refused_ids) {
  auto t = core(SelectorKind::kPrioritized);
  fill(t, std::vector<double>(5, 1.0));
  const int64_t gone[] = {1, 3, 3, 42, -1};
  CHECK_EQ(t.remove(gone, 5), size_t{2});
  const uint64_t keys[] = {100, 101, 104, 7};
  int64_t ids[4];
  t.lookup(keys, 4, ids);
  CHECK_EQ(std::vector<int64_t>(ids, ids + 4), (std::vector<int64_t>{0, -1, 4, -1}));
  const Draws d = draw(t, 3000);
  CHECK_EQ(std::set<int64_t>(d.ids.begin(), d.ids.end()), (std::set<int64_t>{0, 2, 4}));
  for (double p : d.probabilities) CHECK_NEAR(p, 1.0 / 3, 1e-12);
  CHECK_THROWS(fill(t, {1.0}, 0), TableError, "already in the table");
  CHECK_THROWS(fill(t, {1.0}, -2), TableError, "is negative");
  CHECK_THROWS(fill(t, {1.0}, int64_t{1} << 32), TableError, "record ids are 32-bit");
  CHECK_EQ(t.size(), size_t{3});  // a refused batch adds nothing
}

TEST(restore_keeps_order_and_uses_and_sequences_later_inserts_after) {
  auto t = core(SelectorKind::kFifo, 1.0, SelectorKind::kFifo, 4, 5);
  const int64_t ids[] = {0, 1, 2};
  const uint64_t keys[] = {10, 11, 12};
  const double prios[] = {1.0, 1.0, 1.0};
  const uint32_t times[] = {1, 4, 0};
  const uint64_t seqs[] = {70, 50, 60};  // checkpoint order is not sequence order
  std::vector<int64_t> evicted;
  t.restore(ids, keys, prios, times, seqs, 3, &evicted);
  CHECK_EQ(t.next_seq(), uint64_t{71});
  CHECK_EQ(t.remaining_uses(), uint64_t{4 + 1 + 5});
  CHECK_EQ(t.sequence(1), uint64_t{50});
  fill(t, {1.0}, 3);  // sequenced after every restored item
  CHECK_EQ(t.sequence(3), uint64_t{71});
  fill(t, {1.0}, 4);  // at capacity 4: the oldest sequence (id 1) goes
  CHECK(!t.contains(1) && t.contains(0) && t.contains(2));
  const Draws d = draw(t, 1);  // FIFO sampler: id 2 (seq 60) is the oldest now
  CHECK_EQ(d.ids, (std::vector<int64_t>{2}));
  const uint32_t used_up[] = {5};
  const uint64_t seq = 1, top = std::numeric_limits<uint64_t>::max();
  const int64_t id9 = 9;
  CHECK_THROWS(t.restore(&id9, keys, prios, used_up, &seq, 1, &evicted), TableError,
               "cannot be in a table with max_times_sampled 5");
  CHECK_THROWS(t.restore(&id9, keys, prios, times, &top, 1, &evicted), TableError,
               "sequence number 2^64 - 1");
  CHECK(!t.contains(9));
}

TEST(min_probability_is_the_least_likely_items) {
  auto t = core(SelectorKind::kPrioritized, 0.6, SelectorKind::kFifo, 30);
  CHECK_EQ(t.min_probability(), 0.0);  // empty
  const auto prios = uniform_priorities(40, 3, 0.1, 5.0);
  fill(t, prios);  // the first 10 are evicted at capacity 30
  double least = 1.0, total = 0.0;
  for (size_t i = 10; i < 40; ++i) {
    least = std::min(least, t.probability(i));
    total += std::pow(prios[i], 0.6);
  }
  CHECK_NEAR(t.min_probability(), least, 1e-12);
  double smallest = prios[10];
  for (size_t i = 10; i < 40; ++i) smallest = std::min(smallest, prios[i]);
  CHECK_NEAR(t.min_probability(), std::pow(smallest, 0.6) / total, 1e-12);
  std::vector<uint64_t> keys;
  for (uint64_t k = 110; k < 140; ++k) keys.push_back(k);
  const std::vector<double> zeros(30, 0.0);
  t.update_priorities(keys.data(), zeros.data(), 30);
  CHECK_NEAR(t.min_probability(), 1.0 / 30, 1e-12);  // all 0: uniform, as sampled
  auto fifo = core(SelectorKind::kFifo);
  fill(fifo, {1.0, 2.0});
  CHECK_EQ(fifo.min_probability(), 1.0);
}

TEST(selector_kinds_come_from_the_one_list_and_bad_settings_are_refused) {
  CHECK(distore::selector_kind(distore::kNoSelector) == SelectorKind::kNone);
  CHECK(distore::selector_kind(1) == SelectorKind::kPrioritized);
  CHECK_THROWS(distore::selector_kind(distore::kSelectorKinds), TableError, "KINDS");
  CHECK_THROWS(distore::selector_kind(-2), TableError, "KINDS");
  CHECK_THROWS(core(SelectorKind::kUniform, 1.0, SelectorKind::kFifo, 0), TableError, "capacity");
  auto t = core(SelectorKind::kNone);
  fill(t, {1.0, 1.0});  // the remover still works
  CHECK_EQ(t.probability(0), 0.0);
  Draws d;
  CHECK_THROWS(t.sample(1, &d.ids, &d.probabilities, &d.exhausted), TableError, "no sampler");
}

TEST(resident_bytes_name_every_structure) {
  auto t = core(SelectorKind::kPrioritized, 1.0, SelectorKind::kMinHeap, 100000);
  fill(t, std::vector<double>(50000, 1.0));
  std::set<std::string> names;
  size_t total = 0;
  for (const auto& [name, bytes] : t.resident_bytes()) {
    names.insert(name);
    total += bytes;
  }
  for (const char* name : {"key", "priority", "times_sampled", "sequence", "key_index",
                           "sampler.sum_tree", "sampler.members", "remover.heap"}) {
    CHECK(names.count(name) == 1);
  }
  // Columns, index and both selectors: tens of bytes an item, not kilobytes.
  CHECK(total >= 50000 * 28);
  CHECK(total <= 50000 * 120 + (size_t{16} << 20));
}
