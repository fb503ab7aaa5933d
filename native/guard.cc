#include "guard.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include <ucs/type/status.h>

namespace distore {

namespace {

using AmCallback = ucs_status_t (*)(void* arg, void* data, size_t length, unsigned flags);

std::atomic<uint64_t> g_refused_writes{0};
std::atomic<uint64_t> g_refused_reads{0};
AmCallback g_get_req = nullptr;  // UCX's own GET handler, called for allowed reads

constexpr int kMaxRanges = 8;
std::atomic<int> g_ranges{0};
uint64_t g_base[kMaxRanges], g_size[kMaxRanges];
std::mutex g_ranges_mu;

ucs_status_t drop_write(void*, void*, size_t, unsigned) {
  g_refused_writes.fetch_add(1, std::memory_order_relaxed);
  return UCS_OK;  // the data is dropped; the writer never gets a completion
}

ucs_status_t guarded_get(void* arg, void* data, size_t length, unsigned flags) {
  // Every UCX GET request header starts with the address and the length.
  const int ranges = g_ranges.load(std::memory_order_acquire);
  if (ranges > 0) {
    uint64_t address = 0, size = 0;
    if (length < 16) {
      g_refused_reads.fetch_add(1, std::memory_order_relaxed);
      return UCS_OK;
    }
    std::memcpy(&address, data, 8);
    std::memcpy(&size, static_cast<char*>(data) + 8, 8);
    bool inside = false;
    for (int i = 0; i < ranges && !inside; ++i) {
      inside = address >= g_base[i] && size <= g_size[i] && address - g_base[i] <= g_size[i] - size;
    }
    if (!inside) {
      g_refused_reads.fetch_add(1, std::memory_order_relaxed);
      return UCS_OK;
    }
  }
  return g_get_req(arg, data, length, flags);
}

// The handler struct is {uint64_t features; callback cb; ...}: find the word
// holding `expected` in its first few words and swap in `ours`.
bool swap_callback(void* handler, AmCallback expected, AmCallback ours) {
  auto* words = static_cast<uintptr_t*>(handler);
  for (int i = 0; i < 5; ++i) {
    if (words[i] != reinterpret_cast<uintptr_t>(expected)) continue;
    const long page = sysconf(_SC_PAGESIZE);
    auto start = reinterpret_cast<uintptr_t>(&words[i]) & ~static_cast<uintptr_t>(page - 1);
    mprotect(reinterpret_cast<void*>(start), page * 2, PROT_READ | PROT_WRITE);
    __atomic_store_n(&words[i], reinterpret_cast<uintptr_t>(ours), __ATOMIC_RELEASE);
    return true;
  }
  return false;
}

}  // namespace

std::string refuse_remote_writes() {
  static std::mutex mu;
  static std::string result = "not tried";
  std::lock_guard<std::mutex> lock(mu);
  if (result.empty()) return result;
  void* put_h = dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_PUT");
  void* get_h = dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_GET_REQ");
  void* amo_h = dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_ATOMIC_REQ");
  auto put_cb = reinterpret_cast<AmCallback>(dlsym(RTLD_DEFAULT, "ucp_put_handler"));
  auto get_cb = reinterpret_cast<AmCallback>(dlsym(RTLD_DEFAULT, "ucp_get_req_handler"));
  auto amo_cb = reinterpret_cast<AmCallback>(dlsym(RTLD_DEFAULT, "ucp_atomic_req_handler"));
  if (put_h == nullptr || put_cb == nullptr) {
    return result = "this libucp exports no PUT handler to replace";
  }
  if (!swap_callback(put_h, put_cb, &drop_write)) {
    return result = "the PUT handler table of this libucp has an unexpected layout";
  }
  if (amo_h != nullptr && amo_cb != nullptr) swap_callback(amo_h, amo_cb, &drop_write);
  if (get_h != nullptr && get_cb != nullptr) {
    g_get_req = get_cb;
    swap_callback(get_h, get_cb, &guarded_get);
  }
  return result = "";
}

void allow_remote_reads(uint64_t base, uint64_t size) {
  std::lock_guard<std::mutex> lock(g_ranges_mu);
  const int n = g_ranges.load(std::memory_order_relaxed);
  if (n >= kMaxRanges || g_get_req == nullptr) return;
  g_base[n] = base;
  g_size[n] = size;
  g_ranges.store(n + 1, std::memory_order_release);
}

uint64_t refused_writes() { return g_refused_writes.load(std::memory_order_relaxed); }
uint64_t refused_reads() { return g_refused_reads.load(std::memory_order_relaxed); }

}  // namespace distore
