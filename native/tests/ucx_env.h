// UCX for the C++ tests that need it: a context and a worker over TCP
// (loopback), a thread that progresses a worker, endpoints to a listener or
// a worker address, and waiting for a condition with a deadline.
//
// Ownership: Ucx owns its context and worker (worker destroyed first);
// Progress owns its thread (joined on destruction). Thread safety: workers
// are UCS_THREAD_MODE_MULTI, so a test may call into one a Progress thread
// progresses.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include <ucp/api/ucp.h>

namespace distore_test {

class Ucx {
 public:
  Ucx() {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) throw std::runtime_error("config");
    ucp_config_modify(config, "TLS", "tcp");
    ucp_config_modify(config, "ADAPTIVE_PROGRESS", "n");
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
    const ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) throw std::runtime_error(std::string("ucp_init: ") + ucs_status_string(s));
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI;
    if (ucp_worker_create(context_, &wp, &worker_) != UCS_OK) {
      ucp_cleanup(context_);
      throw std::runtime_error("ucp_worker_create");
    }
  }
  ~Ucx() {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  Ucx(const Ucx&) = delete;
  Ucx& operator=(const Ucx&) = delete;
  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
};

// Progresses `worker` on a thread of its own until destroyed (yields the
// core when there is nothing to do: the tests share 2 cores).
class Progress {
 public:
  explicit Progress(ucp_worker_h worker)
      : thread_([this, worker] {
          while (!stop_.load()) {
            if (ucp_worker_progress(worker) == 0) {
              std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
          }
        }) {}
  ~Progress() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Polls `done` (progressing `worker`, if given) until it holds or `seconds`
// pass; returns whether it held.
template <typename Done>
bool wait_for(Done done, double seconds, ucp_worker_h worker = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    if (worker == nullptr || ucp_worker_progress(worker) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return true;
}

inline void ignore_error(void* flag, ucp_ep_h, ucs_status_t) {
  if (flag != nullptr) static_cast<std::atomic<bool>*>(flag)->store(true);
}

// An endpoint to the listener on 127.0.0.1:`port`, with peer-failure
// handling; `failed` (optional) is set when UCX reports the connection gone.
inline ucp_ep_h connect_to(ucp_worker_h worker, uint16_t port,
                           std::atomic<bool>* failed = nullptr) {
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ucp_ep_params_t p;
  std::memset(&p, 0, sizeof(p));
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  p.sockaddr.addrlen = sizeof(addr);
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &ignore_error;
  p.err_handler.arg = failed;
  ucp_ep_h ep = nullptr;
  const ucs_status_t s = ucp_ep_create(worker, &p, &ep);
  if (s != UCS_OK) throw std::runtime_error(std::string("ucp_ep_create: ") + ucs_status_string(s));
  return ep;
}

}  // namespace distore_test
