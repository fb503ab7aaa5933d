// Where a sampled batch lands in a learner's buffer: a structure of arrays.
//
// A storage node's slot keeps an item as header + payload (key, generation,
// then the fields packed in spec order). A learner wants each field as one
// dense [rows, *shape] array, so the readers (mapped.cc, gather.cc) scatter
// every item: its 16-byte header to row r of the header array, and field k's
// bytes to row r of field k's array. The layout is fixed per learner ring
// (spec.TableSpec.layout in Python); offsets are relative to a ring slot.
// Ownership and thread safety: a plain value, immutable once made.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "status.h"

namespace distore {

class BatchLayout {
 public:
  struct Field {
    uint64_t src;     // offset of the field's bytes in a slot (header included)
    uint64_t length;  // bytes of one item's field: the row stride of its array
    uint64_t dest;    // offset of the field's array in the destination
  };
  static constexpr uint64_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)

  // Checks that no two arrays overlap and that every field lies after the
  // slot header; throws UcxError(kStatusBadArgument) if not.
  BatchLayout(uint64_t rows, uint64_t header, std::vector<Field> fields)
      : rows_(rows), header_(header), fields_(std::move(fields)) {
    end_ = header_ + rows_ * kHeader;
    read_ = kHeader;
    std::vector<std::pair<uint64_t, uint64_t>> spans{{header_, end_}};
    for (const Field& f : fields_) {
      if (f.src < kHeader) {
        throw UcxError(kStatusBadArgument, "batch layout: a field overlaps the slot header");
      }
      spans.push_back({f.dest, f.dest + rows_ * f.length});
      end_ = std::max(end_, f.dest + rows_ * f.length);
      read_ = std::max(read_, f.src + f.length);
    }
    for (size_t i = 0; i < spans.size(); ++i) {
      for (size_t j = i + 1; j < spans.size(); ++j) {
        const bool empty = spans[i].first == spans[i].second || spans[j].first == spans[j].second;
        if (!empty && spans[i].first < spans[j].second && spans[j].first < spans[i].second) {
          throw UcxError(kStatusBadArgument, "batch layout: two arrays overlap");
        }
      }
    }
  }

  uint64_t rows() const { return rows_; }
  const std::vector<Field>& fields() const { return fields_; }
  // Bytes of a destination the layout needs, and of a slot a reader reads.
  uint64_t end() const { return end_; }
  uint64_t read_length() const { return read_; }
  uint64_t header_at(uint64_t row) const { return header_ + row * kHeader; }
  uint64_t field_at(size_t k, uint64_t row) const {
    return fields_[k].dest + row * fields_[k].length;
  }
  // Throws UcxError unless every row is below rows() and the layout fits
  // `dest_size` bytes.
  void check(const uint64_t* rows, size_t n, uint64_t dest_size) const {
    if (end_ > dest_size) {
      throw UcxError(kStatusOutOfBounds, "batch layout needs " + std::to_string(end_) +
                                             " bytes; the local buffer has " +
                                             std::to_string(dest_size));
    }
    for (size_t i = 0; i < n; ++i) {
      if (rows[i] >= rows_) {
        throw UcxError(kStatusOutOfBounds, "item " + std::to_string(i) + ": row " +
                                               std::to_string(rows[i]) + " of a batch of " +
                                               std::to_string(rows_));
      }
    }
  }

 private:
  uint64_t rows_, header_;
  std::vector<Field> fields_;
  uint64_t end_ = 0, read_ = 0;
};

}  // namespace distore
