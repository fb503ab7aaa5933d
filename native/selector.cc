#include "selector.h"

#include <cmath>
#include <string>

#include "table_error.h"

namespace distore {

SelectorKind selector_kind(int index) {
  if (index == kNoSelector) return SelectorKind::kNone;
  if (index < 0 || index >= kSelectorKinds) {
    throw TableError("selector kind " + std::to_string(index) +
                     " is not an index of distore_ucx.selectors.KINDS (0.." +
                     std::to_string(kSelectorKinds - 1) + ")");
  }
  return static_cast<SelectorKind>(index);
}

// -- Selector ---------------------------------------------------------------

Selector::Selector(SelectorKind kind, double alpha, const Column<double>* priority,
                   const Column<uint64_t>* seq1)
    : kind_(kind),
      alpha_(alpha),
      queue_(kind == SelectorKind::kLifo, seq1),
      heap_(kind == SelectorKind::kLifo || kind == SelectorKind::kMaxHeap,
            kind == SelectorKind::kFifo || kind == SelectorKind::kLifo, priority, seq1) {}

double Selector::weight(double priority) const {
  if (alpha_ == 1.0) return priority;
  if (alpha_ == 0.0) return 1.0;
  return std::pow(priority, alpha_);
}

void Selector::insert(int64_t id, double priority) {
  ++size_;
  const size_t i = static_cast<size_t>(id);
  switch (kind_) {
    case SelectorKind::kUniform:
      pos_.grow(i + 1);
      items_.grow(size_);
      pos_[i] = static_cast<uint32_t>(size_ - 1);
      items_[size_ - 1] = static_cast<uint32_t>(id);
      break;
    case SelectorKind::kPrioritized:
      members_.grow((i >> 6) + 1);
      members_[i >> 6] |= uint64_t{1} << (i & 63);
      member_list_valid_ = false;
      if (i >= tree_.capacity()) tree_.resize(i + 1);
      tree_.set(i, weight(priority));
      break;
    case SelectorKind::kNone:
      break;
    default:
      // FIFO/LIFO by sequence, min/max heap by priority (the core's columns).
      if (by_sequence()) {
        queue_.push(id);
      } else {
        heap_.push(id);
      }
  }
}

void Selector::remove(int64_t id) {
  --size_;
  const size_t i = static_cast<size_t>(id);
  switch (kind_) {
    case SelectorKind::kUniform: {
      const uint32_t p = pos_[i];
      const uint32_t last = items_[size_];
      items_[p] = last;
      pos_[last] = p;
      break;
    }
    case SelectorKind::kPrioritized:
      members_[i >> 6] &= ~(uint64_t{1} << (i & 63));
      member_list_valid_ = false;
      tree_.set(i, 0.0);
      break;
    case SelectorKind::kNone:
      break;
    default:
      if (by_sequence()) {
        queue_.remove(id);
      } else {
        heap_.remove(id);
      }
  }
}

void Selector::update(int64_t id, double priority) {
  if (kind_ == SelectorKind::kPrioritized) {
    tree_.set(static_cast<size_t>(id), weight(priority));
  } else if (kind_ == SelectorKind::kMinHeap || kind_ == SelectorKind::kMaxHeap) {
    heap_.update(id);
  }
}

int64_t Selector::uniform_member(std::mt19937_64& rng) {
  // Rejection over the ids in use; a list of the members only when they
  // are too sparse for that (the draw is uniform either way).
  std::uniform_int_distribution<size_t> any(0, tree_.used() - 1);
  for (int tries = 0; tries < 64; ++tries) {
    const size_t id = any(rng);
    if (member(id)) return static_cast<int64_t>(id);
  }
  if (!member_list_valid_) {
    member_list_.clear();
    for (size_t w = 0; w < members_.size(); ++w) {
      for (uint64_t bits = members_[w]; bits != 0; bits &= bits - 1) {
        member_list_.push_back(static_cast<uint32_t>(w * 64 + __builtin_ctzll(bits)));
      }
    }
    member_list_valid_ = true;
  }
  std::uniform_int_distribution<size_t> u(0, member_list_.size() - 1);
  return member_list_[u(rng)];
}

int64_t Selector::select(std::mt19937_64& rng, double* probability) {
  switch (kind_) {
    case SelectorKind::kNone:
      throw TableError("this table core has no sampler (a table of slices draws from its "
                       "SliceIndex): sample its slices, not its items");
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) {
        std::uniform_real_distribution<double> u(0.0, total);
        const int64_t id = static_cast<int64_t>(tree_.find(u(rng)));
        *probability = tree_.get(static_cast<size_t>(id)) / total;
        return id;
      }
      // every weight is 0: uniform, as Reverb does
      *probability = 1.0 / static_cast<double>(size_);
      return uniform_member(rng);
    }
    case SelectorKind::kUniform: {
      std::uniform_int_distribution<size_t> u(0, size_ - 1);
      *probability = 1.0 / static_cast<double>(size_);
      return items_[u(rng)];
    }
    default:
      *probability = 1.0;
      return by_sequence() ? queue_.top() : heap_.top();
  }
}

void Selector::select_many(std::mt19937_64& rng, size_t n, int64_t* ids, double* probabilities) {
  if (kind_ == SelectorKind::kNone && n > 0) {
    double unused;
    select(rng, &unused);  // refuses
  }
  if (kind_ == SelectorKind::kUniform) {
    // The same draws as n select() calls; the list reads overlap.
    std::uniform_int_distribution<size_t> u(0, size_ - 1);
    const double p = 1.0 / static_cast<double>(size_);
    for (size_t i = 0; i < n; ++i) {
      ids[i] = static_cast<int64_t>(u(rng));
      __builtin_prefetch(&items_[static_cast<size_t>(ids[i])]);
    }
    for (size_t i = 0; i < n; ++i) {
      ids[i] = items_[static_cast<size_t>(ids[i])];
      probabilities[i] = p;
    }
    return;
  }
  const double total = tree_.total();
  if (kind_ != SelectorKind::kPrioritized || total <= 0.0) {
    for (size_t i = 0; i < n; ++i) ids[i] = select(rng, &probabilities[i]);
    return;
  }
  std::uniform_real_distribution<double> u(0.0, total);
  std::vector<double> prefixes(n);
  for (auto& p : prefixes) p = u(rng);
  tree_.find_many(prefixes.data(), n, ids);
  for (size_t i = 0; i < n; ++i) probabilities[i] = tree_.get(static_cast<size_t>(ids[i])) / total;
}

double Selector::probability(int64_t id) const {
  switch (kind_) {
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) return tree_.get(static_cast<size_t>(id)) / total;
      return size_ == 0 ? 0.0 : 1.0 / static_cast<double>(size_);
    }
    case SelectorKind::kUniform:
      return size_ == 0 ? 0.0 : 1.0 / static_cast<double>(size_);
    case SelectorKind::kNone:
      return 0.0;
    default:
      if (by_sequence()) return (!queue_.empty() && queue_.top() == id) ? 1.0 : 0.0;
      return (!heap_.empty() && heap_.top() == id) ? 1.0 : 0.0;
  }
}

double Selector::min_probability() const {
  if (size_ == 0) return 0.0;
  switch (kind_) {
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) return tree_.min_positive() / total;
      return 1.0 / static_cast<double>(size_);  // all weights 0: uniform
    }
    case SelectorKind::kUniform:
      return 1.0 / static_cast<double>(size_);
    case SelectorKind::kNone:
      return 0.0;
    default:
      return 1.0;
  }
}

void Selector::resident_bytes(const char* prefix,
                              std::vector<std::pair<std::string, size_t>>* out) const {
  const std::string p(prefix);
  switch (kind_) {
    case SelectorKind::kUniform:
      out->emplace_back(p + ".list", items_.resident_bytes() + pos_.resident_bytes());
      break;
    case SelectorKind::kPrioritized:
      out->emplace_back(p + ".sum_tree", tree_.resident_bytes());
      out->emplace_back(p + ".members", members_.resident_bytes() +
                                            member_list_.capacity() * sizeof(uint32_t));
      break;
    case SelectorKind::kNone:
      break;
    default:
      if (by_sequence()) {
        out->emplace_back(p + ".queue", queue_.resident_bytes());
      } else {
        out->emplace_back(p + ".heap", heap_.resident_bytes());
      }
  }
}

}  // namespace distore
