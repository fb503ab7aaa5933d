#include "selector.h"

#include <cmath>
#include <string>

#include "table_error.h"

namespace distore {

SelectorKind selector_kind(int index) {
  if (index < 0 || index >= kSelectorKinds) {
    throw TableError("selector kind " + std::to_string(index) +
                     " is not an index of distore_ucx.control.selectors.KINDS (0.." +
                     std::to_string(kSelectorKinds - 1) + ")");
  }
  return static_cast<SelectorKind>(index);
}

// -- Selector ---------------------------------------------------------------

Selector::Selector(SelectorKind kind, double alpha)
    : kind_(kind),
      alpha_(alpha),
      heap_(kind == SelectorKind::kLifo || kind == SelectorKind::kMaxHeap) {}

double Selector::weight(double priority) const {
  if (alpha_ == 1.0) return priority;
  if (alpha_ == 0.0) return 1.0;
  return std::pow(priority, alpha_);
}

void Selector::grow(int64_t id) {
  if (static_cast<size_t>(id) >= pos_.size()) pos_.resize(static_cast<size_t>(id) * 2 + 1, -1);
}

void Selector::insert(int64_t id, double priority, uint64_t seq) {
  ++size_;
  switch (kind_) {
    case SelectorKind::kUniform:
    case SelectorKind::kPrioritized:
      grow(id);
      pos_[id] = static_cast<int64_t>(items_.size());
      items_.push_back(id);
      if (kind_ == SelectorKind::kPrioritized) {
        if (static_cast<size_t>(id) >= tree_.capacity()) tree_.resize(static_cast<size_t>(id) + 1);
        tree_.set(static_cast<size_t>(id), weight(priority));
      }
      break;
    case SelectorKind::kFifo:
    case SelectorKind::kLifo:
      // Keyed by sequence: oldest on top of the min-heap (FIFO), newest on
      // top of the max-heap (LIFO). Exact while seq < 2^53.
      heap_.push(id, static_cast<double>(seq), seq);
      break;
    case SelectorKind::kMinHeap:
    case SelectorKind::kMaxHeap:
      heap_.push(id, priority, seq);
      break;
  }
}

void Selector::remove(int64_t id) {
  --size_;
  switch (kind_) {
    case SelectorKind::kUniform:
    case SelectorKind::kPrioritized: {
      int64_t p = pos_[id];
      int64_t last = items_.back();
      items_[p] = last;
      pos_[last] = p;
      items_.pop_back();
      pos_[id] = -1;
      if (kind_ == SelectorKind::kPrioritized) tree_.set(static_cast<size_t>(id), 0.0);
      break;
    }
    default:
      heap_.remove(id);
  }
}

void Selector::update(int64_t id, double priority) {
  if (kind_ == SelectorKind::kPrioritized) {
    tree_.set(static_cast<size_t>(id), weight(priority));
  } else if (kind_ == SelectorKind::kMinHeap || kind_ == SelectorKind::kMaxHeap) {
    heap_.update(id, priority);
  }
}

int64_t Selector::select(std::mt19937_64& rng, double* probability) {
  switch (kind_) {
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) {
        std::uniform_real_distribution<double> u(0.0, total);
        const int64_t id = static_cast<int64_t>(tree_.find(u(rng)));
        *probability = tree_.get(static_cast<size_t>(id)) / total;
        return id;
      }
      [[fallthrough]];  // every weight is 0: uniform, as Reverb does
    }
    case SelectorKind::kUniform: {
      std::uniform_int_distribution<size_t> u(0, items_.size() - 1);
      *probability = 1.0 / static_cast<double>(items_.size());
      return items_[u(rng)];
    }
    default:
      *probability = 1.0;
      return heap_.top();
  }
}

void Selector::select_many(std::mt19937_64& rng, size_t n, int64_t* ids, double* probabilities) {
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
      [[fallthrough]];
    }
    case SelectorKind::kUniform:
      return items_.empty() ? 0.0 : 1.0 / static_cast<double>(items_.size());
    default:
      return (!heap_.empty() && heap_.top() == id) ? 1.0 : 0.0;
  }
}

}  // namespace distore
