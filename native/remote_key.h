// A peer's remote key, unpacked on one endpoint (ucp_ep_rkey_unpack), or a
// same-host peer read with process_vm_readv (`pid` set, no endpoint: UCX's
// CMA transport has no peer-failure handling and aborts the reading
// process when the peer died; our own read makes that an error status).
//
// Ownership: holds the owner (owner.h) of the ucp_ep_h: the Python object
// (and through it the worker and context), so teardown is always rkey, then
// endpoint. It also records the remote region's base and size so every read
// can be bounds checked before it is posted. Thread safety: immutable after
// construction.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include <ucp/api/ucp.h>

#include "owner.h"

namespace distore {

class Endpoint;

class RemoteKey {
 public:
  // `endpoint`: the owner of `endpoint_handle` (a ucp_ep_h), and `ours` the
  // Endpoint it is if it is one of ours (then a read that hangs can be ended
  // by force-closing it), else null. With `pid` > 0 there may be no
  // endpoint (handle 0) and reads use process_vm_readv. `packed`: the
  // sealed key (MemoryRegion::pack_rkey), read during the call only.
  RemoteKey(Owner endpoint, uintptr_t endpoint_handle, Endpoint* ours, std::string_view packed,
            uint64_t remote_base, uint64_t remote_size, std::string peer, pid_t pid = 0);
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;

  ucp_ep_h endpoint() const { return ep_; }
  Endpoint* owner() const { return owner_; }  // null unless `endpoint` is our Endpoint
  pid_t pid() const { return pid_; }         // > 0: read with process_vm_readv
  ucp_rkey_h rkey() const { return rkey_; }
  uint64_t remote_base() const { return base_; }
  uint64_t remote_size() const { return size_; }
  const std::string& peer() const { return peer_; }
  bool contains(uint64_t address, uint64_t length) const {
    return address >= base_ && length <= size_ && address - base_ <= size_ - length;
  }

 private:
  Owner endpoint_;
  ucp_ep_h ep_;
  Endpoint* owner_ = nullptr;
  pid_t pid_ = 0;
  ucp_rkey_h rkey_ = nullptr;
  uint64_t base_;
  uint64_t size_;
  std::string peer_;
};

}  // namespace distore
