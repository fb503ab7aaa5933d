// A peer's remote key, unpacked on one endpoint (ucp_ep_rkey_unpack).
//
// Ownership: holds the Python object that owns the ucp_ep_h (and through it
// the worker and context), so teardown is always rkey, then endpoint. It
// also records the remote region's base and size so every read can be bounds
// checked before it is posted. Thread safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <ucp/api/ucp.h>

namespace distore {

class RemoteKey {
 public:
  RemoteKey(nanobind::object endpoint, uintptr_t endpoint_handle, nanobind::bytes packed,
            uint64_t remote_base, uint64_t remote_size, std::string peer);
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;

  ucp_ep_h endpoint() const { return ep_; }
  ucp_rkey_h rkey() const { return rkey_; }
  uint64_t remote_base() const { return base_; }
  uint64_t remote_size() const { return size_; }
  const std::string& peer() const { return peer_; }
  bool contains(uint64_t address, uint64_t length) const {
    return address >= base_ && length <= size_ && address - base_ <= size_ - length;
  }

 private:
  nanobind::object endpoint_;
  ucp_ep_h ep_;
  ucp_rkey_h rkey_ = nullptr;
  uint64_t base_;
  uint64_t size_;
  std::string peer_;
};

}  // namespace distore
