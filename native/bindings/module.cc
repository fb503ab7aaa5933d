// The _native extension module: small, batch-shaped bindings, GIL released
// while UCX works; one bind_*.cc per concept (bindings.h). Every native
// failure becomes the exception class that distore_ucx.errors maps its
// status to (errors.from_native), in one place (bind_status.cc).
#include <cstdlib>

#include "bindings.h"

NB_MODULE(_native, m) {
  using namespace distore;
  m.doc() = "distore-ucx native core: UCX memory, remote keys and the batched gather.";
  // A batch the user still holds at interpreter exit (a torch tensor made by
  // DLPack from a ring slot) keeps its MemoryRegion alive, as it must; torch
  // finalises after this module, so nanobind would report that region as
  // "leaked" and blame our reference counting. Its leak report stays
  // available for debugging: DISTORE_NANOBIND_LEAK_WARNINGS=1.
  const char* leaks = std::getenv("DISTORE_NANOBIND_LEAK_WARNINGS");
  nanobind::set_leak_warnings(leaks != nullptr && leaks[0] == '1');
  bind_status(m);
  bind_memory(m);
  bind_remote_key(m);
  bind_gather(m);
  bind_mapped(m);
  bind_status_constants(m);
  bind_pull(m);
  bind_endpoint(m);
  bind_staging(m);  // staging.h: same-host writers' sealed staging buffers
  bind_disk(m);     // disk_io.h: batched slot I/O of the disk tier
  bind_am(m);       // am_insert.h: inserts carried by UCX active messages
  bind_am_sample(m);  // am_sample.h: samples carried by UCX active messages
  bind_slots(m);      // slot_table.h: a storage node's slot table, a batch a call
}
