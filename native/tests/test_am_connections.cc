// A storage node's listener connections (native/am_connections.h) and the
// authentication exchange, both ends in one process over UCX TCP on
// loopback: the right capability is served, a wrong one refused and
// closed, a silent connection closed after kAuthTimeout, a full listener
// refuses more, an aborted connection fails at its peer.
#include <atomic>
#include <string>
#include <vector>

#include "am_connections.h"
#include "am_grant.h"
#include "check.h"
#include "status.h"
#include "ucx_env.h"

using distore::AmAuthClient;
using distore::AmConnections;
using distore_test::connect_to;
using distore_test::Progress;
using distore_test::Ucx;
using distore_test::wait_for;

namespace {

std::string node_key(uint8_t seed) {
  std::string key(distore::kAmKeyBytes, '\0');
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<char>(seed * 31 + i);
  return key;
}

std::string cap_of(const std::string& key) {
  std::string cap(distore::kAmCapBytes, '\0');
  distore::am_connect_cap(reinterpret_cast<const uint8_t*>(key.data()),
                          reinterpret_cast<uint8_t*>(cap.data()));
  return cap;
}

// A node's listener on its own worker (progressed by a thread, as a node's
// reader ticks) and a client's worker, which the test progresses.
struct Sides {
  Ucx node, client;
  AmConnections listener;
  Progress ticks;
  AmAuthClient auth;
  std::vector<ucp_ep_h> eps;
  Sides(const std::string& key, size_t max_connections)
      : listener(node.worker(), "127.0.0.1", 0, max_connections, "insert", key,
                 distore::kAmInsertAuthId),
        ticks(node.worker()),
        auth(client.worker()) {}
  ~Sides() {
    for (ucp_ep_h ep : eps) distore::force_close(client.worker(), ep, 1.0);
    auth.close();
  }
  ucp_ep_h connect(std::atomic<bool>* failed = nullptr) {
    eps.push_back(connect_to(client.worker(), listener.port(), failed));
    return eps.back();
  }
  int32_t authenticate(ucp_ep_h ep, const std::string& cap) {
    return auth.authenticate(ep, distore::kAmInsertAuthId, cap, 10.0);
  }
};

}  // namespace

TEST(the_right_capability_is_served_and_a_wrong_one_refused) {
  const std::string key = node_key(1);
  Sides s(key, 8);
  CHECK(s.listener.port() != 0);
  CHECK_EQ(s.authenticate(s.connect(), cap_of(key)), int32_t{UCS_OK});
  auto c = s.listener.counts();
  CHECK_EQ(c.accepted, uint64_t{1});
  CHECK_EQ(c.open, uint64_t{1});
  CHECK_EQ(c.pending, uint64_t{0});
  std::atomic<bool> failed{false};
  CHECK_EQ(s.authenticate(s.connect(&failed), cap_of(node_key(2))),
           int32_t{UCS_ERR_REJECTED});  // another node's capability
  c = s.listener.counts();
  CHECK_EQ(c.accepted, uint64_t{2});
  CHECK_EQ(c.open, uint64_t{1});
  CHECK_EQ(c.unauthenticated, uint64_t{1});
  CHECK_EQ(s.listener.failed_ids(), (std::vector<uint64_t>{2}));
  CHECK_EQ(s.listener.reap(1.0), size_t{1});  // the refused one is closed
  CHECK(wait_for([&] { return failed.load(); }, 10.0, s.client.worker()));
  CHECK_EQ(s.listener.counts().open, uint64_t{1});
  CHECK(s.listener.id_of(nullptr) == 0);
}

TEST(a_connection_that_does_not_authenticate_in_time_is_closed) {
  Sides s(node_key(3), 8);
  std::atomic<bool> failed{false};
  s.connect(&failed);
  CHECK(wait_for([&] { return s.listener.counts().pending == 1; }, 10.0, s.client.worker()));
  // Failed by the sweep once kAuthTimeout (1 s) has passed.
  CHECK(wait_for([&] { return !s.listener.failed_ids().empty(); }, 5.0, s.client.worker()));
  CHECK_EQ(s.listener.counts().unauthenticated, uint64_t{1});
  CHECK_EQ(s.listener.reap(1.0), size_t{1});
  CHECK(wait_for([&] { return failed.load(); }, 10.0, s.client.worker()));
}

TEST(a_full_listener_refuses_another_authenticated_connection) {
  const std::string key = node_key(4);
  Sides s(key, 1);
  CHECK_EQ(s.authenticate(s.connect(), cap_of(key)), int32_t{UCS_OK});
  CHECK_EQ(s.authenticate(s.connect(), cap_of(key)), int32_t{UCS_ERR_EXCEEDS_LIMIT});
  CHECK_EQ(s.listener.counts().open, uint64_t{1});
  CHECK_EQ(s.listener.counts().failed, uint64_t{1});
}

TEST(without_a_key_every_connection_is_served_and_abort_ends_one) {
  Sides s("", 8);
  std::atomic<bool> failed{false};
  ucp_ep_h ep = s.connect(&failed);
  // The connection is made when the client side sends something: flush it.
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(r)) {
    CHECK(wait_for([&] { return ucp_request_check_status(r) != UCS_INPROGRESS; }, 10.0,
                   s.client.worker()));
    ucp_request_free(r);
  }
  CHECK(wait_for([&] { return s.listener.counts().open == 1; }, 10.0, s.client.worker()));
  CHECK_EQ(s.listener.counts().pending, uint64_t{0});
  CHECK(s.listener.abort(1, 1.0));  // ids count from 1
  CHECK(!s.listener.abort(1, 1.0));
  CHECK_EQ(s.listener.counts().aborted, uint64_t{1});
  CHECK(wait_for([&] { return failed.load(); }, 10.0, s.client.worker()));
}

TEST(malformed_keys_and_capabilities_are_refused) {
  Ucx node;
  CHECK_THROWS(AmConnections(node.worker(), "127.0.0.1", 0, 1, "insert", "short", 1),
               distore::UcxError, "must be 16 bytes");
  CHECK_THROWS(AmConnections(node.worker(), "no-such-host.invalid", 0, 1, "insert", "", 1),
               distore::UcxError, "cannot listen for inserts");
  AmAuthClient auth(node.worker());
  CHECK_THROWS(auth.authenticate(nullptr, 1, "abc", 1.0), distore::UcxError, "16 bytes");
  auth.close();
  CHECK_THROWS(auth.authenticate(nullptr, 1, std::string(16, 'x'), 1.0), distore::UcxError,
               "closed");
}
