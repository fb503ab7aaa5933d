// Inserts by active message, the node's batched receive (am_insert.h,
// pull_am): a batch's items received straight into their slots, or through
// bounce chunks for runs, with the GIL released, until each has landed or
// failed (timed out, its writer gone, or its receive ended by force).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "am_insert.h"
#include "guard.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

namespace {

constexpr uint64_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)
using clock = std::chrono::steady_clock;

// Receives under way when their batch is discarded get this long to end by
// themselves (a dead writer's fail at once) before their connection is
// force-closed: a writer that only closed its control connection may have
// other batches in flight on the same UCX connection.
constexpr auto kDiscardGrace = std::chrono::seconds(1);
// How long a forced close gets to end the receives on its connection
// before they are left to UCX (it has always ended them when tested).
constexpr auto kAbortWait = std::chrono::seconds(5);

// One pull_am call, after the slots' headers were invalidated: the items'
// states and the receives under way, moved on by run() until every item is
// done. An item waits for its message; the first item of a message holds it
// until a bounce chunk is free (a run), or is being received; the run's
// other items are covered by it meanwhile; then each is done.
class AmPull {
 public:
  AmPull(uint8_t* base, const MemoryRegion& dest, AmInbox& inbox, uint64_t token,
         const PullItem* items, size_t n, double timeout_s, int32_t* statuses)
      : base_(base), inbox_(inbox), worker_(inbox.worker()), token_(token), items_(items),
        n_(n), statuses_(statuses), state_(n, kWaiting), requests_(n, nullptr), conns_(n, 0),
        runs_(n, 1), chunks_(n, nullptr), left_(n),
        deadline_(clock::now() + std::chrono::duration<double>(timeout_s)) {
    // Straight into a slot: the arena alias's registration; into a bounce
    // chunk (a run): UCX's own (its registration cache).
    std::memset(&to_slot_, 0, sizeof(to_slot_));
    to_slot_.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    to_slot_.memh = dest.memh();
    std::memset(&to_chunk_, 0, sizeof(to_chunk_));
  }

  // Progresses the worker until every item is done, or the receives left
  // are left to UCX.
  void run();

 private:
  enum : uint8_t { kWaiting, kHeld, kReceiving, kCovered, kDone };

  uint8_t* slot_of(size_t i) const { return base_ + items_[i].slot_offset + kHeader; }
  uint8_t* landing(size_t i) const { return chunks_[i] != nullptr ? chunks_[i] : slot_of(i); }
  uint64_t bytes_of(size_t i) const {  // of the message whose first item is i
    uint64_t b = 0;
    for (size_t j = i; j < i + runs_[i]; ++j) b += items_[j].length;
    return b;
  }
  bool step(size_t i);
  bool take(size_t i);
  bool poll(size_t i);
  void finish(size_t i, int32_t s, bool tainted = false);
  void scatter(size_t i, const uint8_t* from);
  void received(size_t i, int32_t s);
  void start(size_t i, AmInbox::Message& m);
  void drop_held(int32_t s, bool later);
  void fail_waiting(int32_t s);
  void leave_to_ucx(bool unaccepted_only, int32_t s);
  void on_discarded();
  void on_deadline();
  void force_close();

  uint8_t* const base_;
  AmInbox& inbox_;
  const ucp_worker_h worker_;
  const uint64_t token_;
  const PullItem* const items_;
  const size_t n_;
  int32_t* const statuses_;
  ucp_request_param_t to_slot_, to_chunk_;
  std::vector<uint8_t> state_;
  // Per message, at the index of its first item: the request, the
  // connection it is on, the items it carries, the chunk it lands in.
  std::vector<void*> requests_;
  std::vector<uint64_t> conns_;
  std::vector<uint32_t> runs_;
  std::vector<uint8_t*> chunks_;
  std::vector<AmInbox::Message> held_;  // messages of kHeld runs, by first item
  // receiving: messages under way; next: the first item perhaps not done.
  size_t left_, receiving_ = 0, next_ = 0;
  const decltype(clock::now() + std::chrono::duration<double>()) deadline_;
  // When receives still under way are ended by force (their connections
  // closed), and when that was done.
  clock::time_point force_at_ = clock::time_point::max();
  clock::time_point forced_at_ = clock::time_point::max();
  IdleWait wait_;
  unsigned idle_ = 0, checks_ = 0;
  bool late_ = false, discarded_ = false;
};

// Ends the message whose first item is i: each of its items gets status s.
// `tainted`: UCX may still write its chunk (a receive left to it).
void AmPull::finish(size_t i, int32_t s, bool tainted) {
  if (state_[i] == kReceiving) {
    --receiving_;
    close_put_window(reinterpret_cast<uint64_t>(landing(i)), bytes_of(i));
  }
  if (chunks_[i] != nullptr) {
    inbox_.chunk_pool().give(chunks_[i], tainted);
    chunks_[i] = nullptr;
  }
  for (size_t j = i; j < i + runs_[i]; ++j) {
    statuses_[j] = s;
    state_[j] = kDone;
    --left_;
  }
}

// A run's items from where they landed (`from`) into their slots.
void AmPull::scatter(size_t i, const uint8_t* from) {
  for (size_t j = i; j < i + runs_[i]; ++j) {
    std::memcpy(slot_of(j), from, items_[j].length);
    from += items_[j].length;
  }
}

// A receive ended: a run's items go from its chunk into their slots.
void AmPull::received(size_t i, int32_t s) {
  if (s == UCS_OK && chunks_[i] != nullptr) scatter(i, chunks_[i]);
  finish(i, s);
}

// Posts the receive of message m (items i .. i + runs_[i] - 1) into where
// it lands; the run's chunk, if any, is chunks_[i] already.
void AmPull::start(size_t i, AmInbox::Message& m) {
  // A rendezvous receive is the one place a peer's TCP put may land in
  // this process (guard.h): where the message lands (its slot, or its
  // chunk) is open to puts until finish() ends it.
  uint8_t* to = landing(i);
  open_put_window(reinterpret_cast<uint64_t>(to), m.length);  // == bytes_of(i)
  conns_[i] = m.conn;
  state_[i] = kReceiving;
  for (size_t j = i + 1; j < i + runs_[i]; ++j) state_[j] = kCovered;
  ++receiving_;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, m.desc, to, m.length,
                                            chunks_[i] != nullptr ? &to_chunk_ : &to_slot_);
  if (r == nullptr) {
    received(i, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    finish(i, UCS_PTR_STATUS(r));
  } else {
    requests_[i] = r;
  }
}

// Messages held for a chunk go back to UCX unreceived; their items fail.
// `later`: at the inbox's next expire (their writer may have just died,
// see discard); else now, before their connection may be force-closed.
void AmPull::drop_held(int32_t s, bool later) {
  for (size_t i = 0; i < n_; ++i) {
    if (state_[i] != kHeld) continue;
    if (later) {
      inbox_.release_later(std::move(held_[i]));
    } else {
      inbox_.release(held_[i]);
    }
    finish(i, s);
  }
}

// Items whose message has not come fail with s.
void AmPull::fail_waiting(int32_t s) {
  for (size_t i = 0; i < n_; ++i) {
    if (state_[i] == kWaiting) finish(i, s);
  }
}

// Receives UCX will not end (see the header): their requests go back to UCX.
void AmPull::leave_to_ucx(bool unaccepted_only, int32_t s) {
  size_t left_to_ucx = 0;
  for (size_t i = 0; i < n_; ++i) {
    if (state_[i] != kReceiving || (unaccepted_only && conns_[i] != 0)) continue;
    ucp_request_free(requests_[i]);  // UCX releases it if it ever ends
    requests_[i] = nullptr;
    left_to_ucx += conns_[i] != 0;
    finish(i, s, true);
  }
  if (left_to_ucx) inbox_.count_abandoned(left_to_ucx);
}

// Moves item i on if it can: a receive that ended, a held run that got a
// chunk, a message that arrived. True if something happened.
bool AmPull::step(size_t i) {
  switch (state_[i]) {
    case kReceiving:
      return poll(i);
    case kHeld:
      if ((chunks_[i] = inbox_.chunk_pool().take()) == nullptr) return false;
      start(i, held_[i]);
      return true;
    case kWaiting:
      return take(i);
    default:
      return false;
  }
}

// Whether the receive of the message whose first item is i ended.
bool AmPull::poll(size_t i) {
  const ucs_status_t s = ucp_request_check_status(requests_[i]);
  if (s == UCS_INPROGRESS) return false;
  ucp_request_free(requests_[i]);
  requests_[i] = nullptr;
  received(i, s);
  return true;
}

// Takes item i's message if it arrived: eager, its bytes are copied now;
// rendezvous, its receive starts (or waits for a chunk, a run).
bool AmPull::take(size_t i) {
  AmInbox::Message m;
  if (!inbox_.take(token_, static_cast<uint32_t>(i), &m)) return false;
  // The message's items: all still waiting, and its length theirs.
  size_t k = m.run, bytes = 0, waiting = 0;
  for (size_t j = i; j < std::min(n_, i + k); ++j) {
    bytes += items_[j].length;
    waiting += state_[j] == kWaiting;
  }
  if (i + k > n_ || waiting != k || m.length != bytes) {
    inbox_.release(m);
    // Its items fail (those no other message has taken): a writer that
    // sends such a run sends nothing else for them.
    for (size_t j = i; j < std::min(n_, i + k); ++j) {
      if (state_[j] == kWaiting) finish(j, UCS_ERR_MESSAGE_TRUNCATED);
    }
    return true;
  }
  runs_[i] = static_cast<uint32_t>(k);
  if (!m.rndv) {  // eager: the bytes are here already
    scatter(i, m.desc != nullptr ? static_cast<const uint8_t*>(m.desc) : m.bytes.data());
    inbox_.release(m);
    finish(i, UCS_OK);
  } else if (k == 1) {
    start(i, m);
  } else if ((chunks_[i] = inbox_.chunk_pool().take()) != nullptr) {
    start(i, m);
  } else {  // every chunk is out: held until one comes back
    if (held_.size() < n_) held_.resize(n_);
    held_[i] = std::move(m);
    state_[i] = kHeld;
    for (size_t j = i + 1; j < i + k; ++j) state_[j] = kCovered;
  }
  return true;
}

// The writer is gone (or the node stops): nothing more will come.
void AmPull::on_discarded() {
  discarded_ = true;
  drop_held(UCS_ERR_CANCELED, true);
  fail_waiting(UCS_ERR_CANCELED);
  // Receives from endpoints the inbox did not accept: nothing can end them.
  leave_to_ucx(true, UCS_ERR_CONNECTION_RESET);
  force_at_ = std::min(force_at_, clock::now() + kDiscardGrace);
}

// Items whose message never came (or waits for a chunk) fail now;
// receives under way are ended by force (force_close).
void AmPull::on_deadline() {
  late_ = true;
  drop_held(UCS_ERR_TIMED_OUT, false);
  fail_waiting(UCS_ERR_TIMED_OUT);
  force_at_ = std::min(force_at_, clock::now());
}

// The writer hangs, or left: close its connections by force, which ends
// their receives with an error (UCX purges the endpoint's requests) and
// closes their sockets, so nothing lands after.
void AmPull::force_close() {
  forced_at_ = clock::now();
  std::vector<uint64_t> aborted;
  for (size_t i = 0; i < n_; ++i) {
    if (state_[i] != kReceiving || conns_[i] == 0) continue;
    if (std::find(aborted.begin(), aborted.end(), conns_[i]) != aborted.end()) continue;
    aborted.push_back(conns_[i]);
    inbox_.abort(conns_[i]);
  }
}

void AmPull::run() {
  while (left_ > 0) {
    unsigned events = ucp_worker_progress(worker_);
    for (size_t i = next_; i < n_; ++i) {
      if (step(i)) events = 1;
    }
    while (next_ < n_ && state_[next_] == kDone) ++next_;
    if (left_ == 0) break;
    if (!discarded_ && (events != 0 ? (++checks_ & 63) == 0 : (idle_ & 15) == 0) &&
        inbox_.discarded(token_)) {
      on_discarded();
      events = 1;
    }
    if (!late_ && (idle_ & 255) == 0 && clock::now() > deadline_) on_deadline();
    if (receiving_ > 0 && forced_at_ == clock::time_point::max() && clock::now() >= force_at_) {
      force_close();
      events = 1;
    }
    if (receiving_ > 0 && forced_at_ != clock::time_point::max() &&
        clock::now() > forced_at_ + kAbortWait) {
      // Closed by force and still not ended (never seen): left to UCX; the
      // sockets they came on are closed.
      leave_to_ucx(false, UCS_ERR_CANCELED);
      break;
    }
    if (events != 0) {
      wait_.reset();
      idle_ = 0;
      continue;
    }
    // Nothing moved: pause (the writer's progress thread may need the core
    // we would spin on), as the gather does.
    idle_ = wait_.pause(late_ || discarded_);
  }
}

}  // namespace

void pull_am(const MemoryRegion& arena, const MemoryRegion& dest, AmInbox& inbox,
             uint64_t token, const PullItem* items, size_t n, double timeout_s,
             int32_t* statuses) {
  validate_pull(arena, 0, UINT64_MAX, items, n);
  if (dest.address() != arena.local_address() || dest.size() < arena.size()) {
    throw UcxError(kStatusBadArgument, "pull_am: dest is not the arena's writable alias");
  }
  auto* base = reinterpret_cast<uint8_t*>(arena.local_address());
  for (size_t i = 0; i < n; ++i) store_header(base, items[i].slot_offset, 0, 0);
  std::atomic_thread_fence(std::memory_order_release);
  AmPull(base, dest, inbox, token, items, n, timeout_s, statuses).run();
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i] == UCS_OK) {
      store_header(base, items[i].slot_offset, items[i].key, items[i].generation);
    }
  }
}

}  // namespace distore
