#include "remote_key.h"

#include "status.h"

namespace nb = nanobind;

namespace distore {

RemoteKey::RemoteKey(nb::object endpoint, uintptr_t endpoint_handle, nb::bytes packed,
                     uint64_t remote_base, uint64_t remote_size, std::string peer)
    : endpoint_(std::move(endpoint)),
      ep_(reinterpret_cast<ucp_ep_h>(endpoint_handle)),
      base_(remote_base),
      size_(remote_size),
      peer_(std::move(peer)) {
  if (ep_ == nullptr) throw UcxError(kStatusBadArgument, "null endpoint handle", peer_);
  if (packed.size() == 0) throw UcxError(UCS_ERR_INVALID_PARAM, "empty remote key", peer_);
  check(ucp_ep_rkey_unpack(ep_, packed.c_str(), &rkey_), "ucp_ep_rkey_unpack", peer_);
}

RemoteKey::~RemoteKey() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
}

}  // namespace distore
