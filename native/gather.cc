#include "gather.h"

#include <limits.h>
#include <sched.h>
#include <sys/uio.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "endpoint.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

namespace {

void validate(const std::vector<const RemoteKey*>& rkeys, const GatherItem* items, size_t n,
              const MemoryRegion& dest) {
  for (size_t i = 0; i < n; ++i) {
    const GatherItem& it = items[i];
    if (it.key_index >= rkeys.size() || rkeys[it.key_index] == nullptr) {
      throw UcxError(kStatusBadArgument, "item " + std::to_string(i) + ": remote key index " +
                                             std::to_string(it.key_index) + " out of range");
    }
    const RemoteKey& key = *rkeys[it.key_index];
    if (!key.contains(it.remote_address, it.length)) {
      throw UcxError(kStatusOutOfBounds,
                     "item " + std::to_string(i) + ": remote range [" +
                         std::to_string(it.remote_address) + ", +" + std::to_string(it.length) +
                         ") lies outside the peer's registered region",
                     key.peer());
    }
    if (it.length > dest.size() || it.dest_offset > dest.size() - it.length) {
      throw UcxError(kStatusOutOfBounds, "item " + std::to_string(i) +
                                             ": destination range exceeds the local buffer (" +
                                             std::to_string(dest.size()) + " bytes)");
    }
  }
}

// Reads the items `idx` of a same-host peer (process `pid`) with as few
// process_vm_readv calls as the kernel's iovec limit allows; a short read
// resumes at the first byte missed. A peer that has exited gives ESRCH:
// those items get UCS_ERR_CONNECTION_RESET, nothing aborts.
void read_cma(pid_t pid, char* base, const GatherItem* items, const std::vector<size_t>& idx,
              int32_t* statuses) {
  size_t i = 0;
  uint64_t done_in_first = 0;  // bytes of items[idx[i]] already read
  std::vector<iovec> local, remote;
  while (i < idx.size()) {
    local.clear();
    remote.clear();
    size_t j = i;
    for (; j < idx.size() && local.size() < IOV_MAX; ++j) {
      const GatherItem& it = items[idx[j]];
      const uint64_t skip = j == i ? done_in_first : 0;
      local.push_back({base + it.dest_offset + skip, it.length - skip});
      remote.push_back({reinterpret_cast<void*>(it.remote_address + skip), it.length - skip});
    }
    ssize_t got = process_vm_readv(pid, local.data(), local.size(), remote.data(),
                                   remote.size(), 0);
    if (got <= 0) {
      const int32_t s = (got < 0 && (errno == ESRCH || errno == EPERM))
                            ? UCS_ERR_CONNECTION_RESET
                            : UCS_ERR_IO_ERROR;
      for (size_t k = i; k < idx.size(); ++k) statuses[idx[k]] = s;
      return;
    }
    uint64_t left = static_cast<uint64_t>(got);
    while (i < j) {
      const uint64_t need = items[idx[i]].length - done_in_first;
      if (left < need) {
        done_in_first += left;
        break;
      }
      left -= need;
      statuses[idx[i++]] = UCS_OK;
      done_in_first = 0;
    }
  }
}

// Ends every read still pending on the endpoints of `keys`: a forced close
// completes them (with an error), which nothing else can do for an RMA read
// a hung peer never answers. Endpoints without error handling cannot be
// forced; their reads stay pending.
void force_close(const std::vector<const RemoteKey*>& keys, const GatherItem* items,
                 const std::vector<void*>& requests) {
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == nullptr) continue;
    Endpoint* owner = keys[items[i].key_index]->owner();
    if (owner != nullptr && owner->error_handling()) owner->close(true, 0.0);
  }
}

}  // namespace

void gather(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
            const GatherItem* items, size_t n, const MemoryRegion& dest, double timeout_s,
            int32_t* statuses, double stall_s) {
  validate(rkeys, items, n, dest);
  std::vector<void*> requests(n, nullptr);
  size_t pending = 0;

  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  param.memh = dest.memh();

  auto* base = reinterpret_cast<char*>(dest.address());
  std::vector<std::vector<size_t>> by_pid;  // items of same-host (CMA) keys, per key
  for (size_t i = 0; i < n; ++i) {
    const GatherItem& it = items[i];
    const RemoteKey& key = *rkeys[it.key_index];
    if (it.length == 0) {
      statuses[i] = UCS_OK;
      continue;
    }
    if (key.pid() > 0) {
      if (by_pid.size() < rkeys.size()) by_pid.resize(rkeys.size());
      by_pid[it.key_index].push_back(i);
      continue;
    }
    if (key.owner() != nullptr && !key.owner()->alive()) {
      statuses[i] = key.owner()->status();  // failed or force-closed: do not post
      continue;
    }
    ucs_status_ptr_t r = ucp_get_nbx(key.endpoint(), base + it.dest_offset, it.length,
                                     it.remote_address, key.rkey(), &param);
    if (r == nullptr) {
      statuses[i] = UCS_OK;  // completed inline
    } else if (UCS_PTR_IS_ERR(r)) {
      statuses[i] = UCS_PTR_STATUS(r);
    } else {
      requests[i] = r;
      statuses[i] = UCS_INPROGRESS;
      ++pending;
    }
  }

  // Same-host keys: read now, while the UCX reads are under way.
  for (size_t k = 0; k < by_pid.size(); ++k) {
    if (!by_pid[k].empty()) read_cma(rkeys[k]->pid(), base, items, by_pid[k], statuses);
  }

  // Progress ourselves: another thread (ucxx's) may be parked in epoll on the
  // same worker and only polling request status can hang. After a stretch of
  // fruitless progress we yield the core rather than spin it (idle_wait.h).
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  const auto stall = std::chrono::duration<double>(stall_s);
  auto last_done = clock::now();
  IdleWait wait;
  bool cancelled = false, forced = false;
  while (pending > 0) {
    unsigned events = ucp_worker_progress(worker);
    for (size_t i = 0; i < n; ++i) {
      if (requests[i] == nullptr) continue;
      ucs_status_t s = ucp_request_check_status(requests[i]);
      if (s == UCS_INPROGRESS) continue;
      statuses[i] = s;
      ucp_request_free(requests[i]);
      requests[i] = nullptr;
      --pending;
      events = 1;
      last_done = clock::now();
    }
    if (events != 0) {
      wait.reset();
      continue;
    }
    // Nothing moved: pause (a peer that answers over TCP needs the core we
    // would spin on); past the deadline only poll now and then.
    if ((wait.pause(cancelled) & 255) != 0 || forced) continue;
    const auto now = clock::now();
    if (!cancelled && now > deadline) {
      // UCX completes cancelled requests with UCS_ERR_CANCELED on later
      // progress, except RMA reads, which it cannot cancel: those finish when
      // the endpoint fails (peer-failure handling, keepalive) or never.
      for (size_t i = 0; i < n; ++i) {
        if (requests[i] != nullptr) ucp_request_cancel(worker, requests[i]);
      }
      cancelled = true;
    }
    if (now > deadline || (stall_s > 0 && now - last_done > stall)) {
      // No read finished for `stall_s`: the peer hangs (stopped, or the link
      // is cut). Force-close its endpoint; the caller drops it and resamples.
      force_close(rkeys, items, requests);
      forced = true;
    }
  }
}

void gather_dense(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
                  const uint32_t* key_index, const uint64_t* remote_address,
                  const uint64_t* rows, size_t n, const BatchLayout& layout,
                  const MemoryRegion& dest, const MemoryRegion* staging, double timeout_s,
                  int32_t* statuses, double stall_s, uint64_t slot_stride, uint64_t* reads) {
  layout.check(rows, n, dest.size());
  const auto& fields = layout.fields();
  const uint64_t read = layout.read_length();
  if (slot_stride != 0 && slot_stride < read) {
    throw UcxError(kStatusBadArgument, "gather_dense: a slot stride of " +
                                           std::to_string(slot_stride) + " bytes is shorter "
                                           "than the " + std::to_string(read) + " read of a slot");
  }
  // Same-host (CMA) keys scatter with one iovec per part; UCX keys read
  // whole slots into `staging` (one get each) when there is one.
  std::vector<size_t> whole, parted;
  for (size_t i = 0; i < n; ++i) {
    if (key_index[i] >= rkeys.size() || rkeys[key_index[i]] == nullptr) {
      throw UcxError(kStatusBadArgument, "item " + std::to_string(i) + ": remote key index " +
                                             std::to_string(key_index[i]) + " out of range");
    }
    const bool cma = rkeys[key_index[i]]->pid() > 0;
    (staging != nullptr && !cma ? whole : parted).push_back(i);
  }
  // Whole slot j lands at j * step of the staging region: with a stride,
  // spaced as in the arena, so a run of slots that follow each other there
  // (a slice's steps) is one stretch on both sides and one get.
  const uint64_t step = slot_stride != 0 ? slot_stride : read;
  const uint64_t staged = whole.empty() ? 0 : (whole.size() - 1) * step + read;
  if (!whole.empty() && staging->size() < staged) {
    throw UcxError(kStatusOutOfBounds, "gather_dense: the staging buffer holds " +
                                           std::to_string(staging->size()) + " bytes, " +
                                           std::to_string(staged) + " needed");
  }

  std::vector<GatherItem> parts;
  const size_t per = 1 + fields.size();
  parts.reserve(parted.size() * per);
  for (size_t i : parted) {
    parts.push_back(GatherItem{key_index[i], remote_address[i], BatchLayout::kHeader,
                               layout.header_at(rows[i])});
    for (size_t k = 0; k < fields.size(); ++k) {
      parts.push_back(GatherItem{key_index[i], remote_address[i] + fields[k].src,
                                 fields[k].length, layout.field_at(k, rows[i])});
    }
  }
  // One get per run: whole slot j joins the get of slot j - 1 when both are
  // of one key and slot j sits right after it in the arena.
  std::vector<GatherItem> slots;
  std::vector<size_t> first;  // per whole slot: its get
  slots.reserve(whole.size());
  first.reserve(whole.size());
  for (size_t j = 0; j < whole.size(); ++j) {
    const size_t i = whole[j];
    const bool joins = slot_stride != 0 && j > 0 && key_index[i] == key_index[whole[j - 1]] &&
                       remote_address[i] == remote_address[whole[j - 1]] + slot_stride;
    if (joins) {
      slots.back().length += slot_stride;  // the run's last slot ends at j * step + read
    } else {
      slots.push_back(GatherItem{key_index[i], remote_address[i], read, j * step});
    }
    first.push_back(slots.size() - 1);
  }
  if (reads != nullptr) *reads += slots.size() + parts.size();
  // Validate everything before posting anything.
  if (!slots.empty()) validate(rkeys, slots.data(), slots.size(), *staging);
  validate(rkeys, parts.data(), parts.size(), dest);

  std::vector<int32_t> got(slots.size());
  if (!slots.empty()) {
    gather(worker, rkeys, slots.data(), slots.size(), *staging, timeout_s, got.data(), stall_s);
    // Each slot was read whole, header with payload, as a host ring slot
    // used to hold it; now scatter it into the layout.
    auto* to = reinterpret_cast<uint8_t*>(dest.local_address());
    const auto* from = reinterpret_cast<const uint8_t*>(staging->local_address());
    for (size_t j = 0; j < whole.size(); ++j) {
      const size_t i = whole[j];
      statuses[i] = got[first[j]];
      if (statuses[i] != UCS_OK) continue;
      const uint8_t* slot = from + j * step;
      std::memcpy(to + layout.header_at(rows[i]), slot, BatchLayout::kHeader);
      for (size_t k = 0; k < fields.size(); ++k) {
        std::memcpy(to + layout.field_at(k, rows[i]), slot + fields[k].src, fields[k].length);
      }
    }
  }
  if (parts.empty()) return;
  got.assign(parts.size(), 0);
  gather(worker, rkeys, parts.data(), parts.size(), dest, timeout_s, got.data(), stall_s);
  for (size_t j = 0; j < parted.size(); ++j) {
    const size_t i = parted[j];
    statuses[i] = UCS_OK;
    for (size_t p = j * per; p < (j + 1) * per; ++p) {
      if (got[p] != UCS_OK) {
        statuses[i] = got[p];
        break;
      }
    }
  }
}

int32_t put(ucp_worker_h worker, const RemoteKey& key, uint64_t remote_address,
            const MemoryRegion& src, uint64_t length, double timeout_s) {
  if (key.endpoint() == nullptr) {
    throw UcxError(kStatusBadArgument, "put: this key has no UCX endpoint", key.peer());
  }
  if (!key.contains(remote_address, length) || length > src.size()) {
    throw UcxError(kStatusOutOfBounds, "put: range outside the remote or local region",
                   key.peer());
  }
  if (key.owner() != nullptr && !key.owner()->alive()) return key.owner()->status();
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  param.memh = src.memh();
  ucs_status_ptr_t r = ucp_put_nbx(key.endpoint(), reinterpret_cast<void*>(src.address()), length,
                                   remote_address, key.rkey(), &param);
  if (r == nullptr) {
    // Completed locally; flush to learn whether the peer accepted it.
    r = ucp_ep_flush_nbx(key.endpoint(), &param);
    if (r == nullptr) return UCS_OK;
  }
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  ucs_status_t s;
  bool ended = false;
  while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) {
    if (ucp_worker_progress(worker) == 0) sched_yield();
    if (!ended && clock::now() > deadline) {
      // A peer that refuses the write never completes it: end it.
      ucp_request_cancel(worker, r);
      if (key.owner() != nullptr && key.owner()->error_handling()) key.owner()->close(true, 0.0);
      ended = true;
    } else if (ended && clock::now() > deadline + std::chrono::duration<double>(timeout_s)) {
      // Not even cancelled (an endpoint without error handling cannot be
      // forced): UCX frees the request if it ever ends.
      s = UCS_ERR_TIMED_OUT;
      break;
    }
  }
  ucp_request_free(r);
  return s;
}

}  // namespace distore
