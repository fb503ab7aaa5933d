// Errors that cross the native boundary.
//
// Every failure in native code is thrown as UcxError, carrying the UCX status
// (or a distore-specific pseudo status below UCS_ERR_LAST) and the peer it
// concerns. module.cc translates it, in one place, into the Python exception
// class that distore_ucx.errors maps that status to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <ucs/type/status.h>

namespace distore {

// Pseudo statuses for checks made by distore itself, not by UCX. They live
// far below UCS_ERR_LAST so they never collide with a real UCX status.
constexpr int kStatusOutOfBounds = -1000;  // address range outside a remote region
constexpr int kStatusBadArgument = -1001;  // malformed batch arrays
constexpr int kStatusTorn = -1002;         // slot rewritten while it was copied (seqlock)
constexpr int kStatusStale = -1003;        // the slot holds another item than the one asked for
constexpr int kStatusNotMapped = -1004;    // the item's node is not mapped: read it another way
constexpr int kStatusCorrupt = -1005;      // bytes read back fail their checksum (disk tier)

class UcxError : public std::runtime_error {
 public:
  UcxError(int status, std::string message, std::string peer = {})
      : std::runtime_error(std::move(message)), status_(status), peer_(std::move(peer)) {}
  int status() const { return status_; }
  const std::string& peer() const { return peer_; }

 private:
  int status_;
  std::string peer_;
};

// CRC-32C of a byte range, used to seal packed remote keys: UCX trusts the
// bytes it unpacks, so a corrupt key must be caught before it gets there.
uint32_t crc32c(const void* data, size_t size);

// Name of a status, e.g. "UCS_ERR_UNREACHABLE".
std::string status_name(int status);

// Throws UcxError when status is an error; `what` says which call failed.
void check(ucs_status_t status, const std::string& what, const std::string& peer = {});

}  // namespace distore
