// Samples by active message, the learner's side (am_sample.h): one batch
// being fetched, as the data handler (am_sample_client.cc) and the fetch
// waiting for it (am_sample_fetch.cc) share it. Internal to those two.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ucp/api/ucp.h>

#include "am_sample.h"
#include "layout.h"

namespace distore {

struct AmSampleClient::Batch {
  enum : uint8_t { kWaiting, kReceiving, kDone };
  struct Ref {
    AmSampleClient* client;
    Batch* batch;
    size_t part;
  };
  uint64_t token = 0;
  size_t n = 0, parts = 0;
  bool header_only = false;
  const BatchLayout* layout = nullptr;
  uint8_t* base = nullptr;
  ucp_mem_h memh = nullptr;
  const uint64_t* rows = nullptr;
  const uint32_t* node = nullptr;
  std::vector<uint8_t> state;   // per part
  std::vector<void*> requests;  // per part: a receive's request, freed by fetch
  std::vector<Ref> refs;        // per part: a receive's user data
  std::vector<uint32_t> span;   // per part: items a receive starting there carries
  std::vector<uint32_t> run;    // per item: the first item of its run (joined items)
  std::vector<int32_t> status;  // per item
  std::vector<uint64_t> key, generation;
  std::vector<uint8_t> have_header;
  size_t left = 0;       // parts not done
  size_t receiving = 0;  // parts in kReceiving
  unsigned events = 0;   // things that happened since fetch last looked

  // Under the client's mutex.
  void done(size_t part, int32_t s) {
    const size_t item = part / parts;
    if (state[part] == kReceiving) --receiving;
    state[part] = kDone;
    --left;
    ++events;
    if (s != UCS_OK && status[item] == UCS_OK) status[item] = s;
  }
  void fail_waiting(size_t item, int32_t s) {
    for (size_t k = item * parts; k < (item + 1) * parts; ++k) {
      if (state[k] == kWaiting) done(k, s);
    }
  }
  // The receive into `part` (and the same part of the span - 1 items after
  // it) ended.
  void done_span(size_t part, int32_t s) {
    for (size_t k = 0, at = part; k < span[part]; ++k, at += parts) {
      if (state[at] == kReceiving) done(at, s);
    }
  }
};

}  // namespace distore
