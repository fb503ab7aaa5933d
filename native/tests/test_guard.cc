// The remote-write guard (native/guard.h, tcp_guard.cc) in one process over
// UCX TCP: once installed (before any worker exists), a peer's software put
// (an endpoint with peer-failure handling) is dropped, and a TCP put (one
// without) outside the open windows ends its connection; a put into an open
// window lands. The guarded memory keeps its bytes. The guard patches this
// process's libucp and libuct, so these tests have an executable of their own.
#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "am_connections.h"
#include "check.h"
#include "guard.h"
#include "ucx_env.h"

using distore_test::Progress;
using distore_test::Ucx;
using distore_test::wait_for;

namespace {

constexpr size_t kRegion = 1 << 20;
constexpr uint8_t kKept = 0x11, kPut = 0xEE;

// Installs the guard once, before the first worker of the process.
void install() {
  CHECK_EQ(distore::refuse_remote_writes(), std::string());
  CHECK_EQ(distore::refuse_tcp_puts(), std::string());
}

// A node's region, registered for remote read only, and its packed key.
struct Region {
  ucp_context_h context;
  uint8_t* base;
  ucp_mem_h memh = nullptr;
  void* rkey = nullptr;
  size_t rkey_size = 0;
  explicit Region(ucp_context_h c) : context(c) {
    base = static_cast<uint8_t*>(
        mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::memset(base, kKept, kRegion);
    ucp_mem_map_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_PROT;
    p.address = base;
    p.length = kRegion;
    p.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
             UCP_MEM_MAP_PROT_REMOTE_READ;
    CHECK_EQ(ucp_mem_map(context, &p, &memh), UCS_OK);
    CHECK_EQ(ucp_rkey_pack(context, memh, &rkey, &rkey_size), UCS_OK);
  }
  ~Region() {
    ucp_rkey_buffer_release(rkey);
    ucp_mem_unmap(context, memh);
    munmap(base, kRegion);
  }
  size_t changed() const {
    size_t n = 0;
    for (size_t i = 0; i < kRegion; ++i) n += base[i] != kKept;
    return n;
  }
};

// A peer's endpoint to the node's worker (by address), with or without
// peer-failure handling, and the node's key unpacked on it.
struct Peer {
  ucp_worker_h worker;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h rkey = nullptr;
  std::atomic<bool> failed{false};
  Peer(ucp_worker_h w, ucp_worker_h node, const Region& region, bool error_handling) : worker(w) {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    CHECK_EQ(ucp_worker_get_address(node, &address, &length), UCS_OK);
    ucp_ep_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    p.address = address;
    if (error_handling) {
      p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = &distore_test::ignore_error;
      p.err_handler.arg = &failed;
    }
    const ucs_status_t s = ucp_ep_create(worker, &p, &ep);
    ucp_worker_release_address(node, address);
    CHECK_EQ(s, UCS_OK);
    CHECK_EQ(ucp_ep_rkey_unpack(ep, region.rkey, &rkey), UCS_OK);
  }
  ~Peer() { close(); }
  void close() {
    if (rkey != nullptr) ucp_rkey_destroy(rkey);
    if (ep != nullptr) distore::force_close(worker, ep, 1.0);
    rkey = nullptr;
    ep = nullptr;
  }
  // Puts `length` bytes of kPut at `address`; returns the request (or null).
  void* put(uint64_t address, size_t length) {
    static const std::vector<uint8_t> bytes(4096, kPut);
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    ucs_status_ptr_t r = ucp_put_nbx(ep, bytes.data(), length, address, rkey, &p);
    CHECK(!UCS_PTR_IS_ERR(r));
    return r;
  }
  // Ends a put the node never completes: a forced close fails it.
  void drop(void* request) {
    close();
    if (request == nullptr) return;
    wait_for([&] { return ucp_request_check_status(request) != UCS_INPROGRESS; }, 10.0, worker);
    ucp_request_free(request);
  }
};

}  // namespace

TEST(a_software_put_is_dropped_and_the_region_keeps_its_bytes) {
  install();
  Ucx node, peer;
  Region region(node.context());
  Progress ticks(node.worker());
  Peer writer(peer.worker(), node.worker(), region, true);
  const uint64_t before = distore::refused_writes();
  void* put = writer.put(reinterpret_cast<uint64_t>(region.base) + 4096, 256);
  CHECK(wait_for([&] { return distore::refused_writes() > before; }, 10.0, peer.worker()));
  CHECK_EQ(region.changed(), size_t{0});
  writer.drop(put);
  CHECK_EQ(region.changed(), size_t{0});
}

TEST(a_tcp_put_outside_the_windows_ends_its_connection) {
  install();
  Ucx node, peer;
  Region region(node.context());
  Progress ticks(node.worker());
  Peer writer(peer.worker(), node.worker(), region, false);
  const uint64_t before = distore::refused_tcp_puts();
  const uint64_t at = reinterpret_cast<uint64_t>(region.base) + 8192;
  void* put = writer.put(at, 256);
  CHECK(wait_for([&] { return distore::refused_tcp_puts() > before; }, 10.0, peer.worker()));
  const std::string last = distore::last_refused_tcp_put();
  char where[64];
  std::snprintf(where, sizeof(where), "a put of 256 bytes at 0x%llx",
                static_cast<unsigned long long>(at));
  CHECK(last.find(where) == 0);  // what, where, then from whom
  CHECK(last.find(" from ") != std::string::npos);
  CHECK_EQ(region.changed(), size_t{0});
  writer.drop(put);
}

TEST(a_tcp_put_into_an_open_window_lands_and_only_there) {
  install();
  Ucx node, peer;
  Region region(node.context());
  Progress ticks(node.worker());
  Peer writer(peer.worker(), node.worker(), region, false);
  const uint64_t window = reinterpret_cast<uint64_t>(region.base) + 65536;
  distore::open_put_window(window, 4096);
  const uint64_t accepted = distore::accepted_tcp_puts();
  void* put = writer.put(window + 1024, 512);
  CHECK(wait_for([&] { return distore::accepted_tcp_puts() > accepted; }, 10.0, peer.worker()));
  if (put != nullptr) {
    CHECK(wait_for([&] { return ucp_request_check_status(put) != UCS_INPROGRESS; }, 10.0,
                   peer.worker()));
    CHECK_EQ(ucp_request_check_status(put), UCS_OK);
    ucp_request_free(put);
  }
  // The bytes land on the node's progress thread; wait for all of them.
  CHECK(wait_for([&] { return region.changed() == 512; }, 10.0));
  for (size_t i = 0; i < 512; ++i) CHECK_EQ(region.base[65536 + 1024 + i], kPut);
  distore::close_put_window(window, 4096);
  const uint64_t refused = distore::refused_tcp_puts();
  put = writer.put(window + 1024, 16);  // the window is closed again: refused
  CHECK(wait_for([&] { return distore::refused_tcp_puts() > refused; }, 10.0, peer.worker()));
  writer.drop(put);
}
