// Samples by active message, the learner's side (am_sample.h): the client,
// its data handler receiving each part straight into its rows, and the
// requests it keeps until they are sent (a fetch: am_sample_fetch.cc).
#include <cstring>
#include <random>

#include "am_sample.h"
#include "am_sample_batch.h"
#include "am_sample_util.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this file's own helpers

namespace {

void on_received(void*, ucs_status_t status, size_t, void* user_data) {
  auto* ref = static_cast<AmSampleClient::Batch::Ref*>(user_data);
  ref->client->received(ref->batch, ref->part, status);
}

}  // namespace

void AmSampleClient::received(Batch* b, size_t part, int32_t status) {
  std::lock_guard<std::mutex> lock(mu_);
  b->done_span(part, status);
}

AmSampleClient::AmSampleClient(Owner worker, uintptr_t worker_handle, unsigned request_id,
                               unsigned data_id, uint64_t client_id)
    : worker_(std::move(worker)),
      worker_h_(reinterpret_cast<ucp_worker_h>(worker_handle)),
      request_id_(request_id),
      data_id_(data_id),
      client_id_(client_id) {
  if (worker_h_ == nullptr) throw UcxError(kStatusBadArgument, "AmSampleClient: no worker");
  std::random_device rd;
  next_token_ = (uint64_t(rd()) << 32) ^ rd();
  set_am_handler(worker_h_, data_id, &AmSampleClient::on_data, this,
                 "registering the sample data handler");
  registered_ = true;
  // Without UCP_FEATURE_WAKEUP there is no event fd: fetch then paces
  // itself with IdleWait.
  if (ucp_worker_get_efd(worker_h_, &efd_) != UCS_OK) efd_ = -1;
}

AmSampleClient::~AmSampleClient() { close(); }

void AmSampleClient::close() {
  {
    std::unique_lock<std::mutex> lock(life_mu_);
    if (!registered_) return;
    registered_ = false;  // no new fetch starts
    idle_.wait(lock, [this] { return active_ == 0; });
  }
  set_am_handler(worker_h_, data_id_, nullptr, nullptr, "");
  std::lock_guard<std::mutex> lock(sends_mu_);
  reap_sends(true);
}

AmSampleClient::Stats AmSampleClient::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AmSampleClient::reap_sends(bool abandon) {
  for (size_t i = 0; i < sends_.size();) {
    PendingSend& s = sends_[i];
    if (ucp_request_check_status(s.request) == UCS_INPROGRESS && !abandon) {
      ++i;
      continue;
    }
    if (ucp_request_check_status(s.request) == UCS_INPROGRESS) {
      // Closing with a request still unsent to a node that reads nothing:
      // UCX may still read its buffer, which is left to it.
      new std::vector<uint8_t>(std::move(s.buffer));
    }
    ucp_request_free(s.request);
    sends_[i] = std::move(sends_.back());
    sends_.pop_back();
  }
}

ucs_status_t AmSampleClient::on_data(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmSampleClient*>(arg);
  AmSampleReply h;
  size_t carried = 0;  // slot headers after the reply header
  bool ok = header_length >= sizeof(h) &&
            (header_length - sizeof(h)) % sizeof(AmSampleSlotHeader) == 0;
  if (ok) {
    std::memcpy(&h, header, sizeof(h));
    carried = (header_length - sizeof(h)) / sizeof(AmSampleSlotHeader);
    ok = carried <= kAmSampleMaxRun && carried == ((h.flags & kAmSampleRefused) ? 0 : h.count);
  }
  if (!ok) {
    std::lock_guard<std::mutex> lock(self->mu_);
    ++self->stats_.malformed;
    return UCS_OK;  // dropped (a rendezvous sender's request ends)
  }
  AmSampleSlotHeader slots[kAmSampleMaxRun];
  std::memcpy(slots, static_cast<const uint8_t*>(header) + sizeof(h),
              carried * sizeof(AmSampleSlotHeader));
  return self->receive(h, slots, data, length, param);
}

ucs_status_t AmSampleClient::receive(const AmSampleReply& h, const AmSampleSlotHeader* slots,
                                     void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  std::unique_lock<std::mutex> lock(mu_);
  auto found = batches_.find(h.token);
  if (found == batches_.end()) {
    ++stats_.late;
    return UCS_OK;
  }
  Batch* b = found->second;
  ++b->events;
  if (h.flags & kAmSampleRefused) {
    ++stats_.refused;
    const auto s = static_cast<int32_t>(static_cast<int64_t>(h.status));
    for (size_t i = 0; i < b->n; ++i) {
      if (b->node[i] == h.index) b->fail_waiting(i, s == UCS_OK ? UCS_ERR_REJECTED : s);
    }
    return UCS_OK;
  }
  const size_t count = h.count;
  if (count == 0 || h.index >= b->n || count > b->n - h.index || h.part >= b->parts ||
      b->run[h.index + count - 1] != b->run[h.index]) {  // several items: one run only
    ++stats_.malformed;
    return UCS_OK;
  }
  const size_t first = h.index;
  const size_t head = first * b->parts + h.part;  // the first item's part
  for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
    if (b->state[at] != Batch::kWaiting) {
      ++stats_.late;  // a duplicate, or an item already failed
      return UCS_OK;
    }
  }
  const uint64_t want = b->header_only ? 0 : b->layout->fields()[h.part].length * count;
  b->span[head] = static_cast<uint32_t>(count);
  if (length != want) {
    ++stats_.malformed;
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
      b->done(at, UCS_ERR_MESSAGE_TRUNCATED);
    }
    return UCS_OK;
  }
  for (size_t k = 0; k < count; ++k) {
    const size_t item = first + k;
    if (!b->have_header[item]) {
      b->have_header[item] = 1;
      b->key[item] = slots[k].key;
      b->generation[item] = slots[k].generation;
    } else if (b->key[item] != slots[k].key || b->generation[item] != slots[k].generation) {
      if (b->status[item] == UCS_OK) b->status[item] = kStatusTorn;
    }
  }
  if (length == 0) {
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) b->done(at, UCS_OK);
    return UCS_OK;
  }
  // The run's rows are consecutive (fetch joined them): one stretch.
  uint8_t* dest = b->base + b->layout->field_at(h.part, b->rows[first]);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(dest, data, length);  // eager: UCX hands the bytes to this call only
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) b->done(at, UCS_OK);
    return UCS_OK;
  }
  // Claimed before the mutex is let go: fetch does not end the batch while
  // a part is being received.
  for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
    b->state[at] = Batch::kReceiving;
    ++b->receiving;
  }
  Batch::Ref* ref = &b->refs[head];
  ucp_mem_h memh = b->memh;
  lock.unlock();
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (memh != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  p.cb.recv_am = &on_received;
  p.user_data = ref;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_h_, data, dest, length, &p);
  lock.lock();
  if (r == nullptr) {
    b->done_span(head, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    b->done_span(head, UCS_PTR_STATUS(r));
  } else {
    b->requests[head] = r;  // completes through on_received; freed by fetch
  }
  // A receive under way keeps the descriptor; UCS_OK is what the API wants
  // once ucp_am_recv_data_nbx was called from the callback.
  return UCS_OK;
}

}  // namespace distore
