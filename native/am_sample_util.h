// What both sides of the active-message samples (am_sample.h) share:
// registering a handler, a send's completion that only frees its request,
// and the clock. Internal to the am_sample_*.cc files.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <cstring>

#include "status.h"

namespace distore {
namespace am_sample_detail {

using clock = std::chrono::steady_clock;

// Registers `cb` (nullptr: unregisters) for AM `id` on `worker`, whole
// messages only; throws UcxError naming `what` if UCX refuses.
inline void set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb,
                           void* arg, const char* what) {
  ucp_am_handler_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;  // eager data assembled; not kept past the callback
  param.cb = cb;
  param.arg = arg;
  const ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &param);
  if (cb != nullptr) check(s, what);
}

// A send callback that frees its request and nothing else.
inline void free_request(void* request, ucs_status_t, void*) { ucp_request_free(request); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now().time_since_epoch())
      .count();
}

}  // namespace am_sample_detail
}  // namespace distore
