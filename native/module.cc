// The _native extension module: small, batch-shaped bindings, GIL released
// while UCX works; one bind_*.cc per concept (bindings.h). Every native
// failure becomes the exception class that distore_ucx.errors maps its
// status to (errors.from_native), in one place (bind_status.cc).
#include "bindings.h"
#include "staging.h"

NB_MODULE(_native, m) {
  using namespace distore;
  m.doc() = "distore-ucx native core: UCX memory, remote keys and the batched gather.";
  bind_status(m);
  bind_memory(m);
  bind_remote_key(m);
  bind_gather(m);
  bind_mapped(m);
  bind_status_constants(m);
  bind_pull(m);
  bind_endpoint(m);
  bind_staging(m);  // staging.cc: same-host writers' sealed staging buffers
  bind_disk(m);     // disk_io.cc: batched slot I/O of the disk tier
}
