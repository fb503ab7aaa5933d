// The TCP half of the remote-write guard (guard.h says why it exists).
//
// UCX's TCP transport carries a zero-copy put as a frame of its own (a
// PUT_REQ message: address, length, then the bytes), which the receiving
// side writes to the address named, without a key check, inside
// uct_tcp_ep_progress_data_rx. An endpoint without peer-failure handling
// uses it for ucp_put; any program that speaks the TCP transport's wire
// format can send one. No UCX option refuses it on the receiving side
// (UCX_TCP_PUT_ENABLE only stops this process from advertising, and
// issuing, puts).
//
// So the node looks at what libuct receives: libuct reads its sockets with
// ucs_socket_recv_nb (libucs), through its import table, which
// import_patch.h redirects to guarded_recv. Every connection of the TCP
// transport is a stream of frames (a 5-byte header: AM id, length; a
// connection it accepted starts with an 8-byte magic number); guarded_recv
// follows the framing of each socket and, before UCX can act on a PUT_REQ
// (UCX needs the whole frame first, and the frame's last byte is in the
// chunk being returned), checks its range against the windows the node
// opened for receives it posted (open_put_window). A put outside them, or a
// frame UCX would misread, ends that connection: the receive reports the
// peer gone (UCS_ERR_NOT_CONNECTED, as when a peer closes) and the socket
// is shut down. Only the offending connection goes; the node serves on.
//
// The connection manager of sockaddr endpoints (uct_tcp_sockcm) reads other
// bytes on its own sockets: calls from it are passed through unparsed.
#include <dlfcn.h>
#include <link.h>
#include <sys/socket.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "guard.h"
#include "import_patch.h"

namespace distore {

namespace {

using RecvNb = ucs_status_t (*)(int fd, void* data, int flags, size_t* length_p);
using AcceptFn = ucs_status_t (*)(int fd, struct sockaddr* addr, socklen_t* length, int* accepted);
using CreateFn = ucs_status_t (*)(int domain, int type, int protocol, int* fd_p);

RecvNb g_recv = nullptr;
AcceptFn g_accept = nullptr;
CreateFn g_create = nullptr;
uintptr_t g_pass_lo = 0, g_pass_hi = 0;  // callers whose sockets carry no frames

// The TCP transport's wire format (src/uct/tcp/tcp.h, UCX 1.19-1.22).
constexpr uint8_t kPutReq = 33;   // UCT_TCP_EP_PUT_REQ_AM_ID = UCT_AM_ID_MAX + 1
constexpr uint8_t kLastId = 35;   // UCT_TCP_EP_KEEPALIVE_AM_ID, the highest id it sends
constexpr size_t kHeader = 5;     // uct_tcp_am_hdr_t: uint8 am_id, uint32 length (packed)
constexpr size_t kPutHeader = 20; // uct_tcp_ep_put_req_hdr_t: uint64 addr, size_t length, uint32 sn
constexpr uint64_t kMagic = 8;    // UCT_TCP_MAGIC_NUMBER, first on an accepted connection

enum Phase : uint8_t { kSkip, kFrameHeader, kPutRequest, kRefused };

struct Stream {
  Phase phase = kFrameHeader;
  uint64_t left = 0;  // bytes to pass over (kSkip): a prefix, a frame body, put bytes
  uint8_t have = 0;   // bytes gathered in buf (kFrameHeader, kPutRequest)
  uint8_t buf[kPutHeader] = {};
};

std::mutex g_mu;  // guards everything below
std::unordered_map<int, Stream> g_streams;
std::vector<std::pair<uint64_t, uint64_t>> g_windows;  // [start, start + size) open to puts
std::string g_last;                                    // the last refusal, in words
std::atomic<uint64_t> g_refused{0};
std::atomic<uint64_t> g_accepted{0};  // puts that landed in a window

uint64_t load_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool in_window(uint64_t address, uint64_t length) {
  if (length == 0) return true;  // writes nothing
  for (const auto& [start, size] : g_windows) {
    if (address >= start && length <= size && address - start <= size - length) return true;
  }
  return false;
}

// Follows n received bytes of one connection. False, with `why`, when they
// hold a put outside every window or a frame UCX would misread.
bool follow(Stream& s, const uint8_t* p, size_t n, std::string* why) {
  while (n > 0) {
    switch (s.phase) {
      case kSkip: {
        const uint64_t take = s.left < n ? s.left : n;
        s.left -= take;
        p += take;
        n -= take;
        if (s.left == 0) {
          s.phase = kFrameHeader;
          s.have = 0;
        }
        break;
      }
      case kFrameHeader:
      case kPutRequest: {
        const size_t want = s.phase == kFrameHeader ? kHeader : kPutHeader;
        const size_t take = want - s.have < n ? want - s.have : n;
        std::memcpy(s.buf + s.have, p, take);
        s.have += static_cast<uint8_t>(take);
        p += take;
        n -= take;
        if (s.have < want) break;
        s.have = 0;
        if (s.phase == kFrameHeader) {
          const uint8_t id = s.buf[0];
          const uint64_t length = load_le(s.buf + 1, 4);
          if (id == kPutReq && length == kPutHeader) {
            s.phase = kPutRequest;
          } else if (id == kPutReq || id > kLastId) {
            *why = "a malformed frame (id " + std::to_string(id) + ", " +
                   std::to_string(length) + " bytes)";
            return false;
          } else {
            s.phase = length > 0 ? kSkip : kFrameHeader;
            s.left = length;
          }
        } else {
          const uint64_t address = load_le(s.buf, 8), length = load_le(s.buf + 8, 8);
          if (!in_window(address, length)) {
            char text[96];
            std::snprintf(text, sizeof(text), "a put of %llu bytes at 0x%llx",
                          static_cast<unsigned long long>(length),
                          static_cast<unsigned long long>(address));
            *why = text;
            return false;
          }
          g_accepted.fetch_add(1, std::memory_order_relaxed);
          s.phase = length > 0 ? kSkip : kFrameHeader;
          s.left = length;
        }
        break;
      }
      case kRefused:
        return false;
    }
  }
  return true;
}

std::string peer_of(int fd) {
  sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

ucs_status_t guarded_recv(int fd, void* data, int flags, size_t* length_p) {
  const auto caller = reinterpret_cast<uintptr_t>(__builtin_return_address(0));
  if (caller >= g_pass_lo && caller < g_pass_hi) return g_recv(fd, data, flags, length_p);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_streams.find(fd);
    if (it != g_streams.end() && it->second.phase == kRefused) {
      *length_p = 0;
      return UCS_ERR_NOT_CONNECTED;
    }
  }
  const ucs_status_t status = g_recv(fd, data, flags, length_p);
  if (status != UCS_OK || (flags & MSG_PEEK) != 0 || *length_p == 0) return status;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    Stream& s = g_streams[fd];  // a socket made before the guard: framing from here
    if (follow(s, static_cast<const uint8_t*>(data), *length_p, &why)) return status;
    s.phase = kRefused;
    g_last = why + " from " + peer_of(fd);
    g_refused.fetch_add(1, std::memory_order_relaxed);
  }
  shutdown(fd, SHUT_RDWR);  // the peer learns at once; UCX closes the socket itself
  *length_p = 0;
  return UCS_ERR_NOT_CONNECTED;
}

ucs_status_t guarded_accept(int fd, struct sockaddr* addr, socklen_t* length, int* accepted) {
  const ucs_status_t status = g_accept(fd, addr, length, accepted);
  if (status == UCS_OK) {
    std::lock_guard<std::mutex> lock(g_mu);
    Stream s;
    s.phase = kSkip;
    s.left = kMagic;
    g_streams[*accepted] = s;
  }
  return status;
}

ucs_status_t guarded_create(int domain, int type, int protocol, int* fd_p) {
  const ucs_status_t status = g_create(domain, type, protocol, fd_p);
  if (status == UCS_OK) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_streams[*fd_p] = Stream{};
  }
  return status;
}

void* find_symbol(const char* name) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (p != nullptr) return p;
  for (const char* lib : {"libucs.so.0", "libuct.so.0"}) {
    void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) continue;
    p = dlsym(h, name);
    dlclose(h);
    if (p != nullptr) return p;
  }
  return nullptr;
}

}  // namespace

std::string refuse_tcp_puts() {
  static std::mutex mu;
  static std::string result = "not tried";
  std::lock_guard<std::mutex> lock(mu);
  if (result.empty()) return result;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major != 1 || minor < 19 || minor > 22) {
    return result = "UCX " + std::to_string(major) + "." + std::to_string(minor) +
                    ": the guard knows the TCP transport of UCX 1.19 to 1.22";
  }
  g_recv = reinterpret_cast<RecvNb>(find_symbol("ucs_socket_recv_nb"));
  g_accept = reinterpret_cast<AcceptFn>(find_symbol("ucs_socket_accept"));
  g_create = reinterpret_cast<CreateFn>(find_symbol("ucs_socket_create"));
  if (g_recv == nullptr || g_accept == nullptr || g_create == nullptr) {
    return result = "libucs exports no ucs_socket_recv_nb, ucs_socket_accept or ucs_socket_create";
  }
  if (void* cm = find_symbol("uct_tcp_sockcm_ep_recv")) {
    Dl_info info;
    void* entry = nullptr;
    const bool found = dladdr1(cm, &info, &entry, RTLD_DL_SYMENT) != 0;
    const auto* sym = static_cast<const ElfW(Sym)*>(entry);
    if (found && sym != nullptr && sym->st_size > 0) {
      g_pass_lo = reinterpret_cast<uintptr_t>(cm);
      g_pass_hi = g_pass_lo + sym->st_size;
    }
  }
  // Sockets first, so that every socket the receive hook sees was recorded.
  for (auto [name, fn] : {std::pair<const char*, void*>{"ucs_socket_accept",
                                                        reinterpret_cast<void*>(&guarded_accept)},
                          {"ucs_socket_create", reinterpret_cast<void*>(&guarded_create)},
                          {"ucs_socket_recv_nb", reinterpret_cast<void*>(&guarded_recv)}}) {
    std::string why = patch_import("libuct.so", name, fn);
    if (!why.empty()) return result = why;
  }
  return result = "";
}

void open_put_window(uint64_t address, uint64_t size) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_windows.emplace_back(address, size);
}

void close_put_window(uint64_t address, uint64_t size) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (size_t i = 0; i < g_windows.size(); ++i) {
    if (g_windows[i].first == address && g_windows[i].second == size) {
      g_windows[i] = g_windows.back();
      g_windows.pop_back();
      return;
    }
  }
}

uint64_t refused_tcp_puts() { return g_refused.load(std::memory_order_relaxed); }
uint64_t accepted_tcp_puts() { return g_accepted.load(std::memory_order_relaxed); }

std::string last_refused_tcp_put() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_last;
}

}  // namespace distore
