// A storage node's slot table calls (slot_table.h) against a plain model:
// random carves, reuses, acknowledgements and frees (repeated, LIVE-only,
// of slots never carved) keep the same states, free stack and offsets.
#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "check.h"
#include "slot_table.h"

using namespace distore;

TEST(slot_numbers_find_carved_offsets_and_refuse_others) {
  const std::vector<uint64_t> carved = {0, 4096, 16384, 20480};  // other tables' slots between
  std::vector<int64_t> idx(3);
  const std::vector<uint64_t> ok = {20480, 0, 16384};
  CHECK(slot_numbers(carved.data(), carved.size(), ok.data(), ok.size(), idx.data()));
  CHECK_EQ(idx, (std::vector<int64_t>{3, 0, 2}));
  for (uint64_t bad : {uint64_t{8192}, uint64_t{2048}, uint64_t{24576}, ~uint64_t{0}}) {
    CHECK(!slot_numbers(carved.data(), carved.size(), &bad, 1, idx.data()));
  }
  const uint64_t last = 20480;  // beyond the first n: not a slot yet
  CHECK(!slot_numbers(carved.data(), 3, &last, 1, idx.data()));
  CHECK(slot_numbers(carved.data(), 0, nullptr, 0, idx.data()));
}

TEST(random_operations_match_a_plain_model) {
  std::mt19937_64 rng(7);
  const uint64_t slot = 4096;
  std::vector<uint64_t> carved;
  std::vector<uint8_t> state;
  std::vector<int64_t> stack;  // the native free stack (capacity grown as slots.py does)
  size_t nfree = 0;
  std::vector<uint8_t> model_state;
  std::vector<int64_t> model_stack;
  uint64_t next = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op == 0 || carved.empty()) {  // carve 1-4 fresh slots, sometimes with a gap
      next += (rng() % 4 == 0) ? slot * (1 + rng() % 3) : 0;
      for (int j = 0, m = 1 + static_cast<int>(rng() % 4); j < m; ++j, next += slot) {
        carved.push_back(next);
        state.push_back(kSlotAllocated);
        model_state.push_back(kSlotAllocated);
      }
    } else if (op == 1) {  // reuse up to 5, then acknowledge some of what is allocated
      const size_t k = std::min<size_t>(rng() % 6, nfree);
      std::vector<uint64_t> got(k);
      slot_reuse(stack.data(), nfree, k, state.data(), carved.data(), got.data());
      nfree -= k;
      std::vector<uint64_t> want;
      for (size_t i = model_stack.size() - k; i < model_stack.size(); ++i) {
        model_state[model_stack[i]] = kSlotAllocated;
        want.push_back(carved[model_stack[i]]);
      }
      model_stack.resize(model_stack.size() - k);
      CHECK_EQ(got, want);
      for (size_t s = 0; s < carved.size(); ++s) {
        if (state[s] == kSlotAllocated && rng() % 2) state[s] = model_state[s] = kSlotLive;
      }
    } else {  // free a few offsets: repeats, any state, and now and then one never carved
      const bool live_only = rng() % 2;
      std::vector<uint64_t> offsets;
      for (int j = 0, m = static_cast<int>(rng() % 6); j < m; ++j) {
        offsets.push_back(carved[rng() % carved.size()]);
        if (rng() % 3 == 0) offsets.push_back(offsets.back());
      }
      const bool bad = rng() % 50 == 0;
      if (bad) offsets.push_back(next + slot / 2);
      stack.resize(std::max(stack.size(), nfree + offsets.size()));
      std::vector<int64_t> scratch(offsets.size());
      const auto before = state;
      const long freed = slot_release(carved.data(), carved.size(), state.data(), offsets.data(),
                                      offsets.size(), live_only, stack.data(), nfree,
                                      scratch.data());
      if (bad) {
        CHECK_EQ(freed, -1L);
        CHECK(state == before);  // refused whole: nothing changed
        continue;
      }
      std::set<int64_t> model_freed;
      for (uint64_t off : offsets) {
        const int64_t s = std::lower_bound(carved.begin(), carved.end(), off) - carved.begin();
        if (live_only ? model_state[s] == kSlotLive : model_state[s] != kSlotFree) {
          model_freed.insert(s);
        }
      }
      for (int64_t s : model_freed) {  // ascending, once each
        model_state[s] = kSlotFree;
        model_stack.push_back(s);
      }
      CHECK_EQ(freed, static_cast<long>(model_freed.size()));
      nfree += static_cast<size_t>(freed);
    }
    CHECK(state == model_state);
    CHECK_EQ(nfree, model_stack.size());
    CHECK(std::equal(model_stack.begin(), model_stack.end(), stack.begin()));
  }
}

TEST(carved_slots_ascend_above_the_last_or_are_refused_whole) {
  std::vector<uint64_t> carved(8, 0);
  std::vector<uint8_t> state(8, kSlotFree);
  const std::vector<uint64_t> first = {0, 4096, 12288};
  CHECK(slot_carve(carved.data(), state.data(), 0, 4096, first.data(), first.size()));
  CHECK_EQ(std::vector<uint64_t>(carved.begin(), carved.begin() + 3), first);
  CHECK_EQ(std::vector<uint8_t>(state.begin(), state.begin() + 3),
           (std::vector<uint8_t>(3, kSlotAllocated)));
  const auto before_carved = carved;
  const auto before_state = state;
  for (const std::vector<uint64_t>& bad : {std::vector<uint64_t>{12288},  // the last slot again
                                           std::vector<uint64_t>{14336},  // inside it
                                           std::vector<uint64_t>{20480, 16384},  // descending
                                           std::vector<uint64_t>{16384, 16384}}) {
    CHECK(!slot_carve(carved.data(), state.data(), 3, 4096, bad.data(), bad.size()));
    CHECK(carved == before_carved);
    CHECK(state == before_state);
  }
  const std::vector<uint64_t> next = {16384, 40960};  // other tables' slots between: fine
  CHECK(slot_carve(carved.data(), state.data(), 3, 4096, next.data(), next.size()));
  CHECK_EQ(carved[4], uint64_t{40960});
}
