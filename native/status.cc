#include "status.h"

#include "checksum.h"

namespace distore {

std::string status_name(int status) {
  switch (status) {
    case kStatusOutOfBounds: return "DISTORE_OUT_OF_BOUNDS";
    case kStatusBadArgument: return "DISTORE_BAD_ARGUMENT";
    case kStatusTorn: return "DISTORE_TORN_READ";
    case kStatusStale: return "DISTORE_STALE_SLOT";
    case kStatusCorrupt: return "DISTORE_CORRUPT_SLOT";
    case kStatusNotMapped: return "DISTORE_NOT_MAPPED";
#define DISTORE_STATUS(s) case s: return #s;
    DISTORE_STATUS(UCS_OK)
    DISTORE_STATUS(UCS_INPROGRESS)
    DISTORE_STATUS(UCS_ERR_NO_MESSAGE)
    DISTORE_STATUS(UCS_ERR_NO_RESOURCE)
    DISTORE_STATUS(UCS_ERR_IO_ERROR)
    DISTORE_STATUS(UCS_ERR_NO_MEMORY)
    DISTORE_STATUS(UCS_ERR_INVALID_PARAM)
    DISTORE_STATUS(UCS_ERR_UNREACHABLE)
    DISTORE_STATUS(UCS_ERR_INVALID_ADDR)
    DISTORE_STATUS(UCS_ERR_NOT_IMPLEMENTED)
    DISTORE_STATUS(UCS_ERR_MESSAGE_TRUNCATED)
    DISTORE_STATUS(UCS_ERR_NO_PROGRESS)
    DISTORE_STATUS(UCS_ERR_BUFFER_TOO_SMALL)
    DISTORE_STATUS(UCS_ERR_NO_ELEM)
    DISTORE_STATUS(UCS_ERR_SOME_CONNECTS_FAILED)
    DISTORE_STATUS(UCS_ERR_NO_DEVICE)
    DISTORE_STATUS(UCS_ERR_BUSY)
    DISTORE_STATUS(UCS_ERR_CANCELED)
    DISTORE_STATUS(UCS_ERR_SHMEM_SEGMENT)
    DISTORE_STATUS(UCS_ERR_ALREADY_EXISTS)
    DISTORE_STATUS(UCS_ERR_OUT_OF_RANGE)
    DISTORE_STATUS(UCS_ERR_TIMED_OUT)
    DISTORE_STATUS(UCS_ERR_EXCEEDS_LIMIT)
    DISTORE_STATUS(UCS_ERR_UNSUPPORTED)
    DISTORE_STATUS(UCS_ERR_REJECTED)
    DISTORE_STATUS(UCS_ERR_NOT_CONNECTED)
    DISTORE_STATUS(UCS_ERR_CONNECTION_RESET)
    DISTORE_STATUS(UCS_ERR_ENDPOINT_TIMEOUT)
#undef DISTORE_STATUS
    default: return "UCS_STATUS_" + std::to_string(status);
  }
}

uint32_t crc32c(const void* data, size_t size) { return crc32c_update(0, data, size); }

void check(ucs_status_t status, const std::string& what, const std::string& peer) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return;
  std::string msg = what + " failed: " + ucs_status_string(status);
  if (!peer.empty()) msg += " (peer " + peer + ")";
  throw UcxError(status, msg, peer);
}

}  // namespace distore
