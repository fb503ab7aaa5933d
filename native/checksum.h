// CRC-32C (Castagnoli) of byte ranges, at memory speed where the CPU has an
// instruction for it (SSE4.2 on x86-64, the CRC extension on AArch64), by
// slicing-by-8 tables elsewhere. Used to seal what leaves the process's
// control and comes back (remote keys, disk-tier slots).
//
// Thread safety: pure functions; the tables are built once, thread-safely.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distore {

// CRC-32C of `size` bytes, continuing from `crc` (0 for a new one): the
// standard value, as iSCSI and ext4 compute it.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t size);

}  // namespace distore
