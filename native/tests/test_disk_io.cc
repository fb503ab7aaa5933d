// The disk tier's slot I/O (native/disk_io.h) on a file in the temporary
// directory: slots written sealed and read back with new headers, stale and
// corrupt slots failing alone, runs read together, an end of file an error.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "disk_io.h"
#include "status.h"

using distore::kDiskAlign;
using distore::kDiskTrailer;

namespace {

constexpr size_t kSlot = 20000;  // 16-byte header + payload
constexpr size_t kStride = (kSlot + kDiskTrailer + kDiskAlign - 1) / kDiskAlign * kDiskAlign;
constexpr size_t kSlots = 8;

// Aligned memory as the tier's O_DIRECT buffers need.
struct Aligned {
  uint8_t* p = nullptr;
  explicit Aligned(size_t n) {
    if (posix_memalign(reinterpret_cast<void**>(&p), kDiskAlign, n) != 0) throw std::bad_alloc();
    std::memset(p, 0xEE, n);
  }
  ~Aligned() { std::free(p); }
};

// A tier file of kSlots slots written from a random arena, one run on disk.
struct OnDisk {
  std::string path;
  int fd = -1;
  std::vector<uint8_t> arena = std::vector<uint8_t>(kSlots * kSlot);
  std::vector<uint64_t> disk, keys, gens;
  OnDisk() {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp && *tmp ? tmp : "/tmp") + "/distore-tier-XXXXXX";
    fd = mkstemp(path.data());
    if (fd < 0) throw std::runtime_error("mkstemp " + path);
    std::mt19937_64 rng(11);
    for (auto& b : arena) b = static_cast<uint8_t>(rng());
    std::vector<uint64_t> src;
    for (size_t i = 0; i < kSlots; ++i) {
      src.push_back(i * kSlot);
      disk.push_back(kDiskAlign + i * kStride);  // after a header block, back to back
      keys.push_back(i + 1);
      gens.push_back(i + 71);
    }
    std::vector<int32_t> statuses(kSlots, -1);
    distore::disk_write_slots(fd, arena.data(), src.data(), kSlot, disk.data(), kStride,
                              keys.data(), gens.data(), kSlots, 3, true, statuses.data());
    for (int32_t s : statuses) CHECK_EQ(s, 0);
  }
  ~OnDisk() {
    close(fd);
    unlink(path.c_str());
  }
  // The payload slot i must read back (its header is new).
  const uint8_t* payload(size_t i) const { return arena.data() + i * kSlot + 16; }
  void flip(uint64_t offset) {
    uint8_t b;
    CHECK_EQ(pread(fd, &b, 1, offset), ssize_t{1});
    b ^= 0x10;
    CHECK_EQ(pwrite(fd, &b, 1, offset), ssize_t{1});
  }
};

std::vector<uint64_t> back_to_back(size_t n, uint64_t first = 0) {
  std::vector<uint64_t> at;
  for (size_t i = 0; i < n; ++i) at.push_back(first + i * kStride);
  return at;
}

// Checks slot i landed whole at `to` with its header (keys[i], gens[i]).
void check_slot(const OnDisk& d, size_t i, const uint8_t* to) {
  uint64_t header[2];
  std::memcpy(header, to, 16);
  CHECK_EQ(header[0], d.keys[i]);
  CHECK_EQ(header[1], d.gens[i]);
  CHECK(std::memcmp(to + 16, d.payload(i), kSlot - 16) == 0);
  CHECK(distore::disk_slot_sealed(to, kStride));
}

}  // namespace

TEST(slots_written_read_back_whole_with_their_new_headers) {
  OnDisk d;
  CHECK_EQ(kStride, size_t{20480});
  Aligned dest(kSlots * kStride);
  const auto at = back_to_back(kSlots);
  std::vector<int32_t> statuses(kSlots, -1);
  distore::disk_read_slots(d.fd, d.disk.data(), kStride, dest.p, at.data(), d.keys.data(),
                           d.gens.data(), kSlots, 4, true, statuses.data());
  for (size_t i = 0; i < kSlots; ++i) {
    CHECK_EQ(statuses[i], 0);
    check_slot(d, i, dest.p + at[i]);
  }
}

TEST(a_stale_or_corrupt_slot_fails_alone_with_its_header_zeroed) {
  OnDisk d;
  d.flip(d.disk[2] + 5000);  // a bit in slot 2's payload
  auto gens = d.gens;
  gens[5] += 1;  // slot 5 asked for with another generation
  Aligned dest(kSlots * kStride);
  const auto at = back_to_back(kSlots);
  for (bool verify : {true, false}) {
    std::vector<int32_t> statuses(kSlots, -1);
    distore::disk_read_slots(d.fd, d.disk.data(), kStride, dest.p, at.data(), d.keys.data(),
                             gens.data(), kSlots, 2, verify, statuses.data());
    for (size_t i = 0; i < kSlots; ++i) {
      const int32_t want = i == 5 ? distore::kStatusStale
                                  : (i == 2 && verify) ? distore::kStatusCorrupt : 0;
      CHECK_EQ(statuses[i], want);
      const uint8_t zeros[16] = {};
      if (want != 0) CHECK(std::memcmp(dest.p + at[i], zeros, 16) == 0);  // no reader takes it
      if (want == 0 && i != 2) check_slot(d, i, dest.p + at[i]);
    }
  }
  CHECK(!distore::disk_slot_sealed(dest.p + at[2], kStride));
  std::vector<uint8_t> blank(kStride, 0);  // never written: never verifies
  CHECK(!distore::disk_slot_sealed(blank.data(), kStride));
}

TEST(a_disk_reader_reads_a_run_with_one_read_into_contiguous_slots) {
  OnDisk d;
  for (size_t chunk : {size_t{0}, size_t{16} << 10}) {
    distore::DiskReader reader(3, chunk);
    CHECK_EQ(reader.threads(), size_t{3});
    Aligned dest(kSlots * kStride + kDiskAlign);
    const auto at = back_to_back(kSlots, kDiskAlign);
    std::vector<int32_t> statuses(kSlots, -1);
    reader.read(d.fd, d.disk.data(), kStride, dest.p, at.data(), d.keys.data(), d.gens.data(),
                kSlots, statuses.data());
    for (size_t i = 0; i < kSlots; ++i) {
      CHECK_EQ(statuses[i], 0);
      check_slot(d, i, dest.p + at[i]);
    }
    // One pread without a chunk; through 16 KiB of bounce memory, a read a chunk.
    const uint64_t whole = kSlots * kStride;
    CHECK_EQ(reader.reads(), chunk == 0 ? uint64_t{1} : (whole + chunk - 1) / chunk);
  }
}

TEST(a_disk_reader_scatters_a_run_and_fails_a_corrupt_slot_alone) {
  OnDisk d;
  d.flip(d.disk[6] + kSlot + 3);  // in slot 6's zero padding: the trailer covers it
  distore::DiskReader reader(2, 0);
  Aligned dest(2 * kSlots * kStride);
  std::vector<uint64_t> at;  // every other stride: the run needs a preadv
  for (size_t i = 0; i < kSlots; ++i) at.push_back((kSlots - 1 - i) * 2 * kStride);
  std::vector<int32_t> statuses(kSlots, -1);
  reader.read(d.fd, d.disk.data(), kStride, dest.p, at.data(), d.keys.data(), d.gens.data(),
              kSlots, statuses.data());
  CHECK_EQ(reader.reads(), uint64_t{1});
  for (size_t i = 0; i < kSlots; ++i) {
    CHECK_EQ(statuses[i], i == 6 ? distore::kStatusCorrupt : 0);
    if (i != 6) check_slot(d, i, dest.p + at[i]);
  }
}

TEST(a_slot_past_the_end_of_the_file_is_an_io_error) {
  OnDisk d;
  distore::DiskReader reader(2, 0);
  Aligned dest(2 * kStride);
  const uint64_t disk[] = {d.disk[0], d.disk[kSlots - 1] + kStride};  // the second: no bytes
  const uint64_t at[] = {0, kStride};
  int32_t statuses[2] = {-1, -1};
  reader.read(d.fd, disk, kStride, dest.p, at, d.keys.data(), d.gens.data(), 2, statuses);
  CHECK_EQ(statuses[0], 0);
  CHECK_EQ(statuses[1], EIO);
  CHECK_THROWS(distore::DiskReader(1, 1000), std::invalid_argument, "multiple of 4096");
}

TEST(a_failed_write_is_a_status_per_slot) {
  OnDisk d;
  const int read_only = open(d.path.c_str(), O_RDONLY);
  const uint64_t src[] = {0}, disk[] = {0}, key[] = {1}, gen[] = {1};
  int32_t status = -1;
  distore::disk_write_slots(read_only, d.arena.data(), src, kSlot, disk, kStride, key, gen, 1, 1,
                            false, &status);
  close(read_only);
  CHECK_EQ(status, EBADF);
}
