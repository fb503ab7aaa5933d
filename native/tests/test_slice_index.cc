// The slice index (native/slice_index.h): its valid starts against a
// brute-force reference under random interleaved adds and removes, strict
// and with short slices; draws, expand, refusals, forgotten episodes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "slice_index.h"
#include "table_error.h"

using distore::SliceIndex;
using distore::TableError;

namespace {

constexpr int64_t kMaxId = 4294967294;  // 2^32 - 2

struct Step {
  int64_t id;
  uint64_t episode;
  uint32_t position;
  double priority;
  bool last;
};

void add(SliceIndex& index, const std::vector<Step>& steps) {
  std::vector<int64_t> ids;
  std::vector<uint64_t> eps;
  std::vector<uint32_t> pos;
  std::vector<double> prios;
  std::vector<uint8_t> last;
  for (const Step& s : steps) {
    ids.push_back(s.id);
    eps.push_back(s.episode);
    pos.push_back(s.position);
    prios.push_back(s.priority);
    last.push_back(s.last);
  }
  index.add(ids.data(), eps.data(), pos.data(), prios.data(), steps.size(), last.data());
}

std::vector<int64_t> expand(const SliceIndex& index, const std::vector<int64_t>& starts,
                            std::vector<uint32_t>* lengths = nullptr) {
  std::vector<int64_t> out(starts.size() * index.slice_len());
  if (lengths != nullptr) lengths->resize(starts.size());
  index.expand(starts.data(), starts.size(), out.data(), lengths ? lengths->data() : nullptr);
  return out;
}

std::vector<double> probabilities(const SliceIndex& index, const std::vector<int64_t>& ids) {
  std::vector<double> out(ids.size());
  index.probabilities(ids.data(), ids.size(), out.data());
  return out;
}

// The steps, and the valid starts by their definition.
struct Reference {
  uint64_t T, P;
  bool prioritized;
  double alpha;
  int pad;  // 0 strict, 1 short slices at any end, 2 short episodes (what is left)
  std::map<int64_t, Step> steps;
  std::map<std::pair<uint64_t, uint64_t>, int64_t> at;

  void add(const std::vector<Step>& batch) {
    for (const Step& s : batch) {
      steps[s.id] = s;
      at[{s.episode, s.position}] = s.id;
    }
  }
  void remove(int64_t id) {
    const Step& s = steps.at(id);
    at.erase({s.episode, s.position});
    steps.erase(id);
  }
  // The ids of the present steps from `id` on, at most T.
  std::vector<int64_t> run(int64_t id) const {
    const Step& s = steps.at(id);
    std::vector<int64_t> out;
    for (uint64_t p = s.position; out.size() < T; ++p) {
      const auto it = at.find({s.episode, p});
      if (it == at.end()) break;
      out.push_back(it->second);
    }
    return out;
  }
  uint64_t first(uint64_t episode) const {
    return at.lower_bound({episode, 0})->first.second;
  }
  bool valid(int64_t id) const {
    const Step& s = steps.at(id);
    if (s.position % P != 0) return false;
    const auto r = run(id);
    if (r.size() == T) return true;
    return pad != 0 && steps.at(r.back()).last && (pad == 1 || s.position == first(s.episode));
  }
  std::vector<int64_t> slice(int64_t id) const {
    auto r = run(id);
    const int64_t end = r.back();
    r.resize(T, end);
    return r;
  }
  std::vector<int64_t> starts() const {
    std::vector<int64_t> out;
    for (const auto& kv : steps) {
      if (valid(kv.first)) out.push_back(kv.first);
    }
    return out;
  }
  std::vector<double> probabilities(const std::vector<int64_t>& ids) const {
    std::map<int64_t, double> w;
    double total = 0.0;
    for (int64_t i : starts()) {
      total += w[i] = prioritized ? std::pow(steps.at(i).priority, alpha) : 1.0;
    }
    std::vector<double> out;
    for (int64_t i : ids) {
      const auto it = w.find(i);
      out.push_back(it == w.end() ? 0.0 : total > 0 ? it->second / total : 1.0 / w.size());
    }
    return out;
  }
};

void check(const SliceIndex& index, const Reference& ref, const std::vector<int64_t>& universe) {
  const auto starts = ref.starts();
  std::set<uint64_t> episodes;
  for (const auto& kv : ref.steps) episodes.insert(kv.second.episode);
  CHECK_EQ(index.steps(), ref.steps.size());
  CHECK_EQ(index.episode_count(), episodes.size());
  CHECK_EQ(index.valid_starts(), starts.size());
  const auto got = probabilities(index, universe), want = ref.probabilities(universe);
  double least = 0.0;
  for (size_t k = 0; k < universe.size(); ++k) {
    CHECK_EQ(got[k] > 0, want[k] > 0);
    if (want[k] > 0) CHECK_NEAR(got[k], want[k], 1e-9);
    if (want[k] > 0 && (least == 0.0 || want[k] < least)) least = want[k];
  }
  CHECK_NEAR(index.min_probability(), least, 1e-9);
  std::vector<uint32_t> lengths;
  const auto slices = expand(index, starts, &lengths);
  for (size_t k = 0; k < starts.size(); ++k) {
    const auto want_slice = ref.slice(starts[k]);
    CHECK_EQ(std::vector<int64_t>(slices.begin() + k * ref.T, slices.begin() + (k + 1) * ref.T),
             want_slice);
    CHECK_EQ(lengths[k], ref.run(starts[k]).size());
  }
  for (const auto& [id, s] : ref.steps) {
    uint32_t pos;
    uint64_t ep;
    index.positions(&id, 1, &pos);
    index.episodes(&id, 1, &ep);
    CHECK_EQ(pos, s.position);
    CHECK_EQ(ep, s.episode);
  }
}

}  // namespace

TEST(valid_starts_match_a_brute_force_reference) {
  // Episodes of random lengths (1 to 30; most with their last step flagged)
  // arrive in shuffled batches, lose steps in any order (holes, FIFO from
  // the front, whole episodes), get some back under new ids, and change
  // priorities; the index agrees with the definition after every batch.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {1, 3}, {3, 1}, {4, 2},
                                                {5, 5}, {8, 3}, {40, 1}};
  std::vector<int64_t> universe;
  for (int64_t i = 0; i < 400; ++i) universe.push_back(i);
  for (const auto& [T, P] : shapes) {
    for (bool prioritized : {false, true}) {
      for (int pad = 0; pad <= 2; ++pad) {
        std::mt19937_64 rng(T * 100 + P + 7 * prioritized + 1000 * pad);
        auto below = [&](uint64_t n) { return rng() % n; };
        SliceIndex index(T, P, prioritized, 0.6, 3, pad);
        Reference ref{uint64_t(T), uint64_t(P), prioritized, 0.6, pad, {}, {}};
        std::vector<int64_t> free(universe.rbegin(), universe.rend());
        std::vector<Step> pending;  // (episode, position, last) not added yet
        uint64_t next_episode = 1000000000000;  // episode ids are any uint64
        size_t most_starts = 0;
        for (int op_count = 0; op_count < 300; ++op_count) {
          const uint64_t op = below(7);
          if (op == 0 || pending.empty()) {
            const uint64_t length = 1 + below(30), base = below(3) == 2 ? 1000000 : 0;
            const bool ends = below(10) < 8;  // else an episode still going
            for (uint64_t p = 0; p < length; ++p) {
              const bool last = ends && p == length - 1;
              pending.push_back({-1, next_episode, uint32_t(base + p), 0.0, last});
            }
            next_episode += 1 + below(1000);
          } else if (op <= 2) {  // a batch out of order, across episodes
            std::vector<Step> batch;
            const size_t k = std::min({pending.size(), size_t(1 + below(24)), free.size()});
            for (size_t j = 0; j < k; ++j) {
              const size_t at = below(pending.size());
              Step s = pending[at];
              pending.erase(pending.begin() + at);
              s.id = free.back();
              free.pop_back();
              s.priority = below(10) == 0 ? 0.0 : 0.1 + 3.9 * (below(1000) / 1000.0);
              batch.push_back(s);
            }
            add(index, batch);
            ref.add(batch);
          } else if (!ref.steps.empty()) {
            std::vector<int64_t> gone;
            for (const auto& kv : ref.steps) gone.push_back(kv.first);
            if (op == 3) {  // any few: holes (some come back later)
              std::shuffle(gone.begin(), gone.end(), rng);
              gone.resize(std::min<size_t>(gone.size(), 6));
            } else if (op == 4) {  // the oldest positions (FIFO)
              std::sort(gone.begin(), gone.end(), [&](int64_t a, int64_t b) {
                return ref.steps[a].position < ref.steps[b].position;
              });
              gone.resize(std::min<size_t>(gone.size(), 5));
            } else if (op == 5) {  // a whole episode
              const uint64_t e = ref.steps[gone[below(gone.size())]].episode;
              gone.erase(std::remove_if(gone.begin(), gone.end(),
                                        [&](int64_t i) { return ref.steps[i].episode != e; }),
                         gone.end());
            } else {  // new priorities, also of steps that are not starts
              std::shuffle(gone.begin(), gone.end(), rng);
              gone.resize(std::min<size_t>(gone.size(), 8));
              std::vector<double> prios;
              for (int64_t i : gone) prios.push_back(ref.steps[i].priority = below(3000) / 1000.0);
              gone.push_back(-1);  // not a step: skipped
              prios.push_back(1.0);
              CHECK_EQ(index.set_priorities(gone.data(), prios.data(), gone.size()),
                       gone.size() - 1);
              check(index, ref, universe);
              continue;
            }
            std::vector<int64_t> asked = gone;
            asked.push_back(-1);  // unknown ids are skipped
            asked.push_back(kMaxId + 5);
            asked.insert(asked.end(), gone.begin(), gone.end());  // and twice
            CHECK_EQ(index.remove(asked.data(), asked.size()), gone.size());
            for (int64_t i : gone) {
              if (op == 3 && below(2) == 0) pending.push_back(ref.steps[i]);
              ref.remove(i);
              free.push_back(i);
            }
          }
          check(index, ref, universe);
          most_starts = std::max(most_starts, index.valid_starts());
        }
        // T = 40 is longer than every episode: never a strict start.
        CHECK(T == 40 ? (pad ? most_starts > 0 : most_starts == 0) : most_starts > 5);
      }
    }
  }
}

TEST(holes_heal_and_episodes_arrive_backwards) {
  SliceIndex index(3, 1, false, 1.0, 0);
  for (int n = 0; n < 6; ++n) {  // positions 5, 4, ... 0: each completes one start
    add(index, {{5 - n, 9, uint32_t(5 - n), 1.0, false}});
    CHECK_EQ(index.valid_starts(), size_t(std::max(0, n - 1)));
  }
  const int64_t hole = 2;
  CHECK_EQ(index.remove(&hole, 1), size_t{1});  // starts 0, 1, 2 go
  CHECK_EQ(probabilities(index, {0, 1, 2, 3, 4, 5}), (std::vector<double>{0, 0, 0, 1, 0, 0}));
  add(index, {{7, 9, 2, 1.0, false}});  // the hole heals under another id
  CHECK_EQ(index.valid_starts(), size_t{4});
  CHECK_EQ(expand(index, {0, 1, 7}), (std::vector<int64_t>{0, 1, 7, 1, 7, 3, 7, 3, 4}));
}

TEST(the_ends_of_the_id_position_and_episode_ranges) {
  SliceIndex index(3, 1, false, 1.0, 0);
  const uint64_t big = UINT64_MAX;
  const uint32_t top = UINT32_MAX;  // the last position: no step after it
  add(index, {{kMaxId, big, top, 1.0, false}, {0, big, top - 1, 1.0, false},
              {7, big, top - 2, 1.0, false}, {8, 0, 0, 1.0, false}});
  CHECK_EQ(index.valid_starts(), size_t{1});
  CHECK_EQ(index.episode_count(), size_t{2});
  CHECK_EQ(expand(index, {7}), (std::vector<int64_t>{7, 0, kMaxId}));
}

TEST(refusals_say_what_happened_and_change_nothing) {
  SliceIndex index(2, 1, false, 1.0, 0);
  add(index, {{0, 1, 0, 1.0, false}, {1, 1, 1, 1.0, false}});
  const std::pair<std::vector<Step>, std::string> refused[] = {
      {{{2, 1, 2, 1.0, false}, {3, 1, 1, 1.0, false}}, "(episode 1, position 1) is present"},
      {{{2, 1, 2, 1.0, false}, {2, 1, 3, 1.0, false}}, "record id 2 appears twice"},
      {{{2, 1, 2, 1.0, false}, {1, 5, 0, 1.0, false}}, "record id 1 is a step already"},
      {{{-1, 1, 2, 1.0, false}}, "record id -1 is outside 0..4294967294"},
      {{{kMaxId + 1, 1, 2, 1.0, false}}, "record id 4294967295 is outside"},
      {{{2, 1, 2, std::nan(""), false}}, "priorities are finite and >= 0"},
      {{{2, 1, 2, -1.0, false}}, "priorities are finite and >= 0"},
      {{{2, 1, 2, INFINITY, false}}, "priorities are finite and >= 0"},
      {{{2, 1, uint32_t{1} << 31, 1.0, false}}, "more than 2^30 apart"}};
  for (const auto& [steps, message] : refused) {
    CHECK_THROWS(add(index, steps), TableError, message);
    CHECK_EQ(index.steps(), size_t{2});
    CHECK_EQ(index.valid_starts(), size_t{1});
    CHECK_EQ(index.episode_count(), size_t{1});
    CHECK_EQ(probabilities(index, {0, 1, 2, 3}), (std::vector<double>{1, 0, 0, 0}));
  }
  const double bad = -2.0;
  const int64_t zero = 0;
  CHECK_THROWS(index.set_priorities(&zero, &bad, 1), TableError, "priorities are finite");
  CHECK_THROWS(expand(index, {1}), TableError, "(episode 1, position 1) is not a valid start");
  CHECK_THROWS(expand(index, {9}), TableError, "record id 9 is not a step");
  uint32_t pos;
  const int64_t gone = -3;
  CHECK_THROWS(index.positions(&gone, 1, &pos), TableError, "record id -3 is not a step");
  CHECK_EQ(probabilities(index, {-5, int64_t{1} << 40, 9}), (std::vector<double>{0, 0, 0}));
  CHECK_THROWS(SliceIndex(0, 1, false, 1.0, 0), TableError, "slice_len 0 is not in 1..2^30");
  CHECK_THROWS(SliceIndex(int64_t{1} << 31, 1, false, 1.0, 0), TableError, "slice_len 2147483648");
  CHECK_THROWS(SliceIndex(2, 0, false, 1.0, 0), TableError, "period 0 is not in 1..2^30");
  CHECK_THROWS(SliceIndex(2, 1, true, -1.0, 0), TableError, "alpha");
  CHECK_THROWS(SliceIndex(2, 1, true, std::nan(""), 0), TableError, "alpha");
  CHECK_THROWS(SliceIndex(2, 1, true, 1.0, 0, 3), TableError, "pad 3");
}

TEST(sampling_with_no_valid_start_returns_nothing) {
  SliceIndex index(5, 1, false, 1.0, 0);
  int64_t starts[8];
  double probs[8];
  CHECK_EQ(index.sample(8, starts, probs), size_t{0});
  CHECK_EQ(index.min_probability(), 0.0);
  std::vector<Step> steps;
  for (uint32_t p = 0; p < 4; ++p) steps.push_back({p, 1, p, 1.0, false});
  add(index, steps);  // one step short of a slice
  CHECK_EQ(index.sample(8, starts, probs), size_t{0});
  add(index, {{4, 1, 4, 1.0, false}});
  CHECK_EQ(index.sample(8, starts, probs), size_t{8});
  CHECK_EQ(std::vector<int64_t>(starts, starts + 8), std::vector<int64_t>(8, 0));
}

TEST(prioritized_draws_follow_the_start_steps_priorities) {
  SliceIndex index(3, 1, true, 0.6, 2);
  Reference ref{3, 1, true, 0.6, 0, {}, {}};
  std::vector<Step> steps;
  std::mt19937_64 rng(6);
  std::uniform_real_distribution<double> prio(0.1, 5.0);
  for (uint64_t e = 0; e < 3; ++e) {
    for (uint32_t p = 0; p < 8 + 4 * e; ++p) {
      steps.push_back({int64_t(e * 20 + p), e, p, prio(rng), false});
    }
  }
  add(index, steps);
  ref.add(steps);
  const int64_t holes[] = {5, 26};
  index.remove(holes, 2);
  ref.remove(5);
  ref.remove(26);
  const auto starts = ref.starts();
  const auto exact = ref.probabilities(starts);
  std::map<int64_t, size_t> where;
  for (size_t k = 0; k < starts.size(); ++k) where[starts[k]] = k;
  std::vector<int64_t> got(100000);
  std::vector<double> probs(got.size());
  CHECK_EQ(index.sample(got.size(), got.data(), probs.data()), got.size());
  std::vector<double> counts(starts.size(), 0.0);
  for (size_t k = 0; k < got.size(); ++k) {
    CHECK(where.count(got[k]) == 1);  // never a start that is not valid
    CHECK_NEAR(probs[k], exact[where[got[k]]], 1e-12);
    counts[where[got[k]]] += 1;
  }
  CHECK(distore_test::chi2(counts, exact) < distore_test::chi2_critical(starts.size() - 1.0));
}

TEST(short_episodes_start_what_is_left_of_an_episode_whose_head_left) {
  // pad 2 (TorchRL's strict_length=False): T = 8 over an episode of 10
  // steps gives full slices only; once its first 4 steps leave, what is
  // left (6 steps) is one short slice from its first present step.
  SliceIndex index(8, 1, false, 1.0, 1, 2);
  std::vector<Step> steps;
  for (uint32_t p = 0; p < 10; ++p) steps.push_back({p, 7, p, 1.0, p == 9});
  add(index, steps);
  CHECK_EQ(index.valid_starts(), size_t{3});  // 0, 1, 2: full
  const int64_t head[] = {0, 1, 2, 3};
  index.remove(head, 4);
  CHECK_EQ(index.valid_starts(), size_t{1});
  std::vector<uint32_t> lengths;
  CHECK_EQ(expand(index, {4}, &lengths), (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 9, 9}));
  CHECK_EQ(lengths, (std::vector<uint32_t>{6}));
  add(index, {{13, 7, 2, 1.0, false}});  // below the first, with a gap: no start
  CHECK_EQ(index.valid_starts(), size_t{0});
  add(index, {{14, 7, 3, 1.0, false}});  // 2..9: a full slice from 2
  CHECK_EQ(index.valid_starts(), size_t{1});
  CHECK_EQ(expand(index, {13}, &lengths), (std::vector<int64_t>{13, 14, 4, 5, 6, 7, 8, 9}));
}

TEST(episodes_without_steps_are_forgotten_and_their_windows_freed) {
  SliceIndex index(4, 1, true, 1.0, 0);
  std::vector<Step> steps;
  for (uint64_t e = 0; e < 20; ++e) {
    for (uint32_t p = 0; p < 50; ++p) steps.push_back({int64_t(e * 50 + p), e, p, 1.0, false});
  }
  add(index, steps);
  auto windows = [&] {
    for (const auto& [name, bytes] : index.resident_bytes()) {
      if (name == "windows") return bytes;
    }
    return size_t{0};
  };
  CHECK_EQ(index.episode_count(), size_t{20});
  CHECK(windows() > 20 * 200);
  std::vector<int64_t> all;
  for (int64_t i = 0; i < 1000; ++i) all.push_back(i);
  CHECK_EQ(index.remove(all.data(), 500), size_t{500});  // ten whole episodes
  CHECK_EQ(index.episode_count(), size_t{10});
  index.remove(all.data(), all.size());
  CHECK_EQ(index.steps() + index.valid_starts() + index.episode_count(), size_t{0});
  CHECK_EQ(windows(), size_t{0});
  add(index, {{3, 12345, 0, 1.0, false}});  // slots are reused
  uint64_t ep;
  const int64_t three = 3;
  index.episodes(&three, 1, &ep);
  CHECK_EQ(ep, uint64_t{12345});
}
