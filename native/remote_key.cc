#include "remote_key.h"

#include <cstring>
#include <string>

#include "endpoint.h"
#include "memory.h"
#include "status.h"

namespace distore {

RemoteKey::RemoteKey(Owner endpoint, uintptr_t endpoint_handle, Endpoint* ours,
                     std::string_view packed, uint64_t remote_base, uint64_t remote_size,
                     std::string peer, pid_t pid)
    : endpoint_(std::move(endpoint)),
      ep_(reinterpret_cast<ucp_ep_h>(endpoint_handle)),
      owner_(ours),
      pid_(pid),
      base_(remote_base),
      size_(remote_size),
      peer_(std::move(peer)) {
  if (ep_ == nullptr && pid_ <= 0) {
    throw UcxError(kStatusBadArgument, "null endpoint handle", peer_);
  }
  if (packed.size() == 0) throw UcxError(UCS_ERR_INVALID_PARAM, "empty remote key", peer_);
  const char* p = packed.data();
  uint32_t magic = 0, n = 0, crc = 0;
  if (packed.size() >= kRkeyHeader) {
    std::memcpy(&magic, p, 4);
    std::memcpy(&n, p + 4, 4);
    std::memcpy(&crc, p + 8, 4);
  }
  if (packed.size() < kRkeyHeader || magic != kRkeyMagic || n != packed.size() - kRkeyHeader ||
      crc != crc32c(p + kRkeyHeader, n)) {
    throw UcxError(UCS_ERR_INVALID_PARAM,
                   "remote key rejected: not a sealed distore key or corrupt (" +
                       std::to_string(packed.size()) + " bytes); ask the node for a fresh one",
                   peer_);
  }
  if (ep_ != nullptr) {
    check(ucp_ep_rkey_unpack(ep_, p + kRkeyHeader, &rkey_), "ucp_ep_rkey_unpack", peer_);
  }
}

RemoteKey::~RemoteKey() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
}

}  // namespace distore
