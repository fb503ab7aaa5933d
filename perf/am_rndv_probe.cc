// A standalone probe of UCX active-message rendezvous, against the UCX of
// the libucx wheel: how fast rendezvous sends are over each kind of
// endpoint, and what a receiver sees when its sender is SIGKILLed
// mid-rendezvous. perf/am_rndv_kills.py drives it; docs/performance.md
// has what it found.
//
// Build (the wheel's UCX; no rpath, so LD_LIBRARY_PATH at run time):
//   UCX=$(python -c 'import libucx,os;print(os.path.dirname(libucx.__file__))')
//   g++ -O2 -std=c++17 -I$UCX/include perf/am_rndv_probe.cc -o am_rndv_probe -L$UCX/lib -lucp -lucs
//
// Receiver: am_rndv_probe recv PORT_OR_ADDRFILE SIZE SLOTS
//   "listen:PORT" takes connections on a UCX listener (sockaddr endpoints,
//   which have a connection-manager lane) with peer-failure handling;
//   "addr:FILE" writes its worker address to FILE for senders to connect
//   to. Receives each message into one of SLOTS registered slots of SIZE
//   bytes (its memory handle passed, as the storage node does), checks the
//   content of every receive that completed without error, and prints one
//   JSON line of counters on SIGUSR1; exits on SIGTERM after
//   releasing everything (so context cleanup is tested as well).
// Sender: am_rndv_probe send MODE TARGET SIZE COUNT WINDOW
//   MODE: addr-none | addr-peer (worker address, without / with
//   UCP_ERR_HANDLING_MODE_PEER) or sockaddr (listener, with it); TARGET:
//   the receiver's address file or HOST:PORT. Sends COUNT messages
//   (0: forever) of SIZE bytes with the rendezvous flag, WINDOW at a time,
//   from a buffer it never passes a memory handle for, and prints GB/s.
//   Both sides pause when idle, as distore's processes and
//   `ucx_perftest -E sleep` do.
#include <arpa/inet.h>
#include <netdb.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

namespace {

constexpr unsigned kAmId = 7;
using steady = std::chrono::steady_clock;

void die(const char* what, ucs_status_t s) {
  std::fprintf(stderr, "%s: %s\n", what, ucs_status_string(s));
  std::exit(2);
}

struct Header {
  uint64_t seq;
  uint64_t sender;  // the sender's pid: content depends on both
};

// The byte pattern of message (sender, seq): checked word by word.
void fill(uint8_t* p, size_t n, uint64_t sender, uint64_t seq) {
  uint64_t x = sender * 0x9E3779B97F4A7C15ull ^ seq;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    std::memcpy(p + i, &x, 8);
  }
}

bool check(const uint8_t* p, size_t n, uint64_t sender, uint64_t seq) {
  uint64_t x = sender * 0x9E3779B97F4A7C15ull ^ seq;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    if (std::memcmp(p + i, &x, 8) != 0) return false;
  }
  return true;
}

ucp_context_h make_context() {
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // As the runtime's context (transport/runtime.py).
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP | UCP_FEATURE_AM | UCP_FEATURE_RMA;
  ucp_config_t* config;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) die("ucp_config_read", s);
  ucp_context_h ctx;
  s = ucp_init(&params, config, &ctx);
  ucp_config_release(config);
  if (s != UCS_OK) die("ucp_init", s);
  return ctx;
}

ucp_worker_h make_worker(ucp_context_h ctx) {
  ucp_worker_params_t wp;
  std::memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  ucp_worker_h w;
  ucs_status_t s = ucp_worker_create(ctx, &wp, &w);
  if (s != UCS_OK) die("ucp_worker_create", s);
  return w;
}

// ---------------------------------------------------------------- receiver

struct Pending {
  void* desc;
  size_t length;
  Header h;
  ucp_ep_h ep;
};

struct Slot {
  void* request = nullptr;  // receive under way
  Header h{};
  size_t length = 0;
  steady::time_point posted;
};

struct Receiver {
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_mem_h memh;
  uint8_t* base;
  size_t size;
  std::vector<Slot> slots;
  std::vector<size_t> free_slots;
  std::deque<Pending> queue;  // rendezvous descriptors waiting for a slot
  std::vector<ucp_ep_h> eps;  // endpoints we created (listener mode)
  std::vector<ucp_ep_h> failed;
  // Counters (printed).
  uint64_t arrived = 0, ok = 0, bad_content = 0, failed_recv = 0, inline_ok = 0,
           ep_errors = 0, released = 0, conns = 0, eager = 0, max_recv_ms = 0;
  std::vector<uint64_t> fail_status;  // per status, how many
  bool check_content = std::getenv("PROBE_NO_FILL") == nullptr;
};

Receiver* g_rx = nullptr;
volatile sig_atomic_t g_stop = 0, g_report = 0;

void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* rx = static_cast<Receiver*>(arg);
  ++rx->ep_errors;
  rx->failed.push_back(ep);
}

ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data,
                   size_t length, const ucp_am_recv_param_t* param) {
  auto* rx = static_cast<Receiver*>(arg);
  ++rx->arrived;
  if (header_length != sizeof(Header) || !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    ++rx->eager;
    return UCS_OK;
  }
  Pending p;
  p.desc = data;
  p.length = length;
  std::memcpy(&p.h, header, sizeof(Header));
  p.ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  rx->queue.push_back(p);
  return UCS_INPROGRESS;
}

void on_conn(ucp_conn_request_h req, void* arg) {
  auto* rx = static_cast<Receiver*>(arg);
  ucp_ep_params_t ep;
  std::memset(&ep, 0, sizeof(ep));
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = on_ep_error;
  ep.err_handler.arg = rx;
  ucp_ep_h h;
  ucs_status_t s = ucp_ep_create(rx->worker, &ep, &h);
  if (s != UCS_OK) {
    std::fprintf(stderr, "accepting a connection: %s\n", ucs_status_string(s));
    return;
  }
  ++rx->conns;
  rx->eps.push_back(h);
}

void finish_slot(Receiver* rx, size_t i, ucs_status_t s) {
  Slot& slot = rx->slots[i];
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(steady::now() - slot.posted)
                      .count();
  if (uint64_t(ms) > rx->max_recv_ms) rx->max_recv_ms = ms;
  if (s == UCS_OK) {
    ++rx->ok;
    if (rx->check_content &&
        !check(rx->base + i * rx->size, slot.length, slot.h.sender, slot.h.seq)) {
      ++rx->bad_content;
    }
  } else {
    ++rx->failed_recv;
    size_t k = size_t(-int(s));
    if (rx->fail_status.size() <= k) rx->fail_status.resize(k + 1);
    ++rx->fail_status[k];
  }
  slot.request = nullptr;
  rx->free_slots.push_back(i);
}

void close_ep(ucp_worker_h w, ucp_ep_h ep, bool force) {
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  const auto deadline = steady::now() + std::chrono::seconds(2);
  while (ucp_request_check_status(r) == UCS_INPROGRESS && steady::now() < deadline) {
    ucp_worker_progress(w);
  }
  ucp_request_free(r);
}

long rss_kb() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

void report(Receiver* rx) {
  size_t busy = 0;
  for (auto& s : rx->slots) busy += s.request != nullptr;
  std::printf(
      "{\"arrived\": %lu, \"ok\": %lu, \"bad_content\": %lu, \"failed\": %lu, "
      "\"ep_errors\": %lu, \"conns\": %lu, \"eps\": %zu, \"busy_slots\": %zu, "
      "\"queued\": %zu, \"eager\": %lu, \"max_recv_ms\": %lu, \"rss_kb\": %ld, \"fail\": {",
      rx->arrived, rx->ok, rx->bad_content, rx->failed_recv, rx->ep_errors, rx->conns,
      rx->eps.size(), busy, rx->queue.size(), rx->eager, rx->max_recv_ms, rss_kb());
  bool first = true;
  for (size_t k = 0; k < rx->fail_status.size(); ++k) {
    if (!rx->fail_status[k]) continue;
    std::printf("%s\"%s\": %lu", first ? "" : ", ", ucs_status_string(ucs_status_t(-int(k))),
                rx->fail_status[k]);
    first = false;
  }
  std::printf("}}\n");
  std::fflush(stdout);
}

int run_recv(const std::string& where, size_t size, size_t nslots) {
  Receiver rx;
  g_rx = &rx;
  rx.ctx = make_context();
  rx.worker = make_worker(rx.ctx);
  rx.size = size;
  rx.slots.resize(nslots);
  // The slots, registered once (the node's arena), handle passed on receives.
  ucp_mem_map_params_t mp;
  std::memset(&mp, 0, sizeof(mp));
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                  UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
  rx.base = static_cast<uint8_t*>(mmap(nullptr, size * nslots, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  mp.address = rx.base;
  mp.length = size * nslots;
  ucs_status_t s = ucp_mem_map(rx.ctx, &mp, &rx.memh);
  if (s != UCS_OK) die("ucp_mem_map", s);
  for (size_t i = nslots; i-- > 0;) rx.free_slots.push_back(i);

  ucp_am_handler_param_t hp;
  std::memset(&hp, 0, sizeof(hp));
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  hp.cb = on_am;
  hp.arg = &rx;
  s = ucp_worker_set_am_recv_handler(rx.worker, &hp);
  if (s != UCS_OK) die("set_am_recv_handler", s);

  ucp_listener_h listener = nullptr;
  if (where.rfind("listen:", 0) == 0) {
    sockaddr_in sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(uint16_t(std::atoi(where.c_str() + 7)));
    ucp_listener_params_t lp;
    std::memset(&lp, 0, sizeof(lp));
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<sockaddr*>(&sa);
    lp.sockaddr.addrlen = sizeof(sa);
    lp.conn_handler.cb = on_conn;
    lp.conn_handler.arg = &rx;
    s = ucp_listener_create(rx.worker, &lp, &listener);
    if (s != UCS_OK) die("ucp_listener_create", s);
  } else if (where.rfind("addr:", 0) == 0) {
    ucp_address_t* addr;
    size_t len;
    s = ucp_worker_get_address(rx.worker, &addr, &len);
    if (s != UCS_OK) die("ucp_worker_get_address", s);
    std::string tmp = where.substr(5) + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<char*>(addr), len);
    std::rename(tmp.c_str(), where.substr(5).c_str());
    ucp_worker_release_address(rx.worker, addr);
  } else {
    std::fprintf(stderr, "recv: listen:PORT or addr:FILE\n");
    return 2;
  }
  signal(SIGTERM, [](int) { g_stop = 1; });
  signal(SIGUSR1, [](int) { g_report = 1; });
  std::printf("{\"ready\": true}\n");
  std::fflush(stdout);

  ucp_request_param_t rp;
  std::memset(&rp, 0, sizeof(rp));
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  rp.memh = rx.memh;
  while (!g_stop) {
    unsigned events = ucp_worker_progress(rx.worker);
    while (!rx.queue.empty() && !rx.free_slots.empty()) {
      Pending p = rx.queue.front();
      rx.queue.pop_front();
      if (p.length > size) {
        ucp_am_data_release(rx.worker, p.desc);
        ++rx.released;
        continue;
      }
      size_t i = rx.free_slots.back();
      rx.free_slots.pop_back();
      Slot& slot = rx.slots[i];
      slot.h = p.h;
      slot.length = p.length;
      slot.posted = steady::now();
      ucs_status_ptr_t r = ucp_am_recv_data_nbx(rx.worker, p.desc, rx.base + i * size, p.length, &rp);
      if (r == nullptr) {
        ++rx.inline_ok;
        finish_slot(&rx, i, UCS_OK);
      } else if (UCS_PTR_IS_ERR(r)) {
        finish_slot(&rx, i, UCS_PTR_STATUS(r));
      } else {
        slot.request = r;
      }
      events = 1;
    }
    for (size_t i = 0; i < nslots; ++i) {
      Slot& slot = rx.slots[i];
      if (slot.request == nullptr) continue;
      ucs_status_t st = ucp_request_check_status(slot.request);
      if (st == UCS_INPROGRESS) continue;
      ucp_request_free(slot.request);
      finish_slot(&rx, i, st);
    }
    // Endpoints whose peer failed: forced close (after the callback returned).
    while (!rx.failed.empty()) {
      ucp_ep_h ep = rx.failed.back();
      rx.failed.pop_back();
      for (size_t k = 0; k < rx.eps.size(); ++k) {
        if (rx.eps[k] == ep) {
          rx.eps.erase(rx.eps.begin() + k);
          close_ep(rx.worker, ep, true);
          break;
        }
      }
    }
    if (g_report) {
      g_report = 0;
      report(&rx);
    }
    if (events == 0) usleep(20);
  }
  // Teardown in order: receives, endpoints, listener, memory, worker, context.
  for (auto& p : rx.queue) ucp_am_data_release(rx.worker, p.desc);
  rx.queue.clear();
  for (auto& slot : rx.slots) {
    if (slot.request != nullptr) ucp_request_cancel(rx.worker, slot.request);
  }
  for (auto* ep : rx.eps) close_ep(rx.worker, ep, true);
  if (listener) ucp_listener_destroy(listener);
  report(&rx);
  for (auto& slot : rx.slots) {
    if (slot.request != nullptr) ucp_request_free(slot.request);
  }
  ucp_mem_unmap(rx.ctx, rx.memh);
  ucp_worker_destroy(rx.worker);
  ucp_cleanup(rx.ctx);
  std::printf("{\"clean_exit\": true}\n");
  std::fflush(stdout);
  return 0;
}

// ------------------------------------------------------------------ sender

void on_sender_ep_error(void*, ucp_ep_h, ucs_status_t s) {
  std::fprintf(stderr, "sender: endpoint failed: %s\n", ucs_status_string(s));
  std::exit(3);
}

int run_send(const std::string& mode, const std::string& target, size_t size, uint64_t count,
             size_t window) {
  ucp_context_h ctx = make_context();
  ucp_worker_h worker = make_worker(ctx);
  ucp_ep_params_t ep;
  std::memset(&ep, 0, sizeof(ep));
  std::string address;
  sockaddr_in sa;
  if (mode == "sockaddr") {
    const auto colon = target.rfind(':');
    std::memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    inet_pton(AF_INET, target.substr(0, colon).c_str(), &sa.sin_addr);
    sa.sin_port = htons(uint16_t(std::atoi(target.c_str() + colon + 1)));
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<sockaddr*>(&sa);
    ep.sockaddr.addrlen = sizeof(sa);
  } else {
    std::ifstream f(target, std::ios::binary);
    address.assign(std::istreambuf_iterator<char>(f), {});
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  }
  const bool peer = mode != "addr-none";
  ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.err_mode = peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = on_sender_ep_error;
  }
  ucp_ep_h h;
  ucs_status_t s = ucp_ep_create(worker, &ep, &h);
  if (s != UCS_OK) die("ucp_ep_create", s);

  // The staging buffer: registered (as the writer's), handle never passed.
  const size_t nbuf = window;
  auto* buf = static_cast<uint8_t*>(mmap(nullptr, size * nbuf, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ucp_mem_map_params_t mp;
  std::memset(&mp, 0, sizeof(mp));
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
  mp.address = buf;
  mp.length = size * nbuf;
  ucp_mem_h memh;
  s = ucp_mem_map(ctx, &mp, &memh);
  if (s != UCS_OK) die("ucp_mem_map", s);
  const uint64_t me = getpid();
  const bool check_content = std::getenv("PROBE_NO_FILL") == nullptr;
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_COPY_HEADER;
  // The insert path sets REPLY: the receiver learns which endpoint a message came on.
  if (std::getenv("PROBE_REPLY") != nullptr) p.flags |= UCP_AM_SEND_FLAG_REPLY;
  std::vector<void*> reqs(nbuf, nullptr);
  uint64_t seq = 0, done = 0;
  steady::time_point t0, quiet_since{};
  const uint64_t warmup = std::min<uint64_t>(count / 10, 16);
  for (;;) {
    for (size_t b = 0; b < nbuf; ++b) {
      if (reqs[b] != nullptr) {
        ucs_status_t st = ucp_request_check_status(reqs[b]);
        if (st == UCS_INPROGRESS) continue;
        ucp_request_free(reqs[b]);
        reqs[b] = nullptr;
        if (st != UCS_OK) die("send", st);
        if (++done == warmup) t0 = steady::now();
      }
      if (count != 0 && seq >= count) continue;
      Header hd{seq, me};
      if (check_content) fill(buf + b * size, size, me, seq);
      ucs_status_ptr_t r = ucp_am_send_nbx(h, kAmId, &hd, sizeof(hd), buf + b * size, size, &p);
      if (UCS_PTR_IS_ERR(r)) die("ucp_am_send_nbx", UCS_PTR_STATUS(r));
      if (r == nullptr) {
        if (++done == warmup) t0 = steady::now();
      } else {
        reqs[b] = r;
      }
      ++seq;
    }
    if (count != 0 && done >= count) break;
    // Paced as native/idle_wait.h: on a shared machine a sender that spins
    // takes the core its receiver needs.
    if (ucp_worker_progress(worker) != 0) {
      quiet_since = steady::time_point{};
    } else if (quiet_since == steady::time_point{}) {
      quiet_since = steady::now();
    } else if (steady::now() - quiet_since > std::chrono::microseconds(100)) {
      usleep(20);
    } else if (steady::now() - quiet_since > std::chrono::microseconds(10)) {
      sched_yield();
    }
  }
  const double dt = std::chrono::duration<double>(steady::now() - t0).count();
  const double gbs = double(size) * double(count - warmup) / dt / 1e9;
  std::printf("{\"mode\": \"%s\", \"size\": %zu, \"count\": %lu, \"window\": %zu, "
              "\"fill\": %s, \"gb_s\": %.3f}\n",
              mode.c_str(), size, count, window, check_content ? "true" : "false", gbs);
  std::fflush(stdout);
  if (std::getenv("PROBE_PRINT_EP")) ucp_ep_print_info(h, stderr);
  close_ep(worker, h, false);
  ucp_mem_unmap(ctx, memh);
  ucp_worker_destroy(worker);
  ucp_cleanup(ctx);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::strcmp(argv[1], "recv") == 0) {
    return run_recv(argv[2], std::strtoull(argv[3], nullptr, 10), std::strtoull(argv[4], nullptr, 10));
  }
  if (argc >= 7 && std::strcmp(argv[1], "send") == 0) {
    return run_send(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10),
                    std::strtoull(argv[5], nullptr, 10), std::strtoull(argv[6], nullptr, 10));
  }
  std::fprintf(stderr,
               "usage: %s recv listen:PORT|addr:FILE SIZE SLOTS\n"
               "       %s send addr-none|addr-peer|sockaddr FILE|HOST:PORT SIZE COUNT WINDOW\n",
               argv[0], argv[0]);
  return 2;
}
