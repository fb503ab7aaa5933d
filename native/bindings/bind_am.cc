// Bindings: inserts carried by UCX active messages with rendezvous
// (am_insert.h): the writer's send, the node's inbox and batched receive,
// and the authentication of a listener's connections (am_connections.h).
#include "bindings.h"

#include "am_insert.h"
#include "endpoint.h"
#include "memory.h"

namespace distore {

namespace {

void bind_am_auth(nb::module_& m) {
  nb::class_<AmAuthClient> cls(
      m, "AmAuthClient",
      "A client's side of a node listener's authentication, on one worker: sends the\n"
      "node's capability on a new connection and waits for the answer.");
  cls.def(
      "__init__",
      [](AmAuthClient* self, nb::object worker) {
        new (self) AmAuthClient(reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker")));
      },
      "worker"_a, nb::keep_alive<1, 2>(),
      "Register the answer handler on `worker` (a ucxx worker).");
  cls.def(
      "authenticate",
      [](AmAuthClient& self, const Endpoint& ep, unsigned auth_id, nb::bytes cap,
         double timeout) {
        std::string c(cap.c_str(), cap.size());
        nb::gil_scoped_release release;
        return self.authenticate(ep.ep(), auth_id, c, timeout);
      },
      "endpoint"_a, "auth_id"_a, "cap"_a, "timeout"_a = 5.0,
      "Authenticate `endpoint` (to a node's listener, on this worker) with the node's\n"
      "capability `cap` (16 bytes) as message `auth_id` (AM_INSERT_AUTH_ID or\n"
      "AM_SAMPLE_AUTH_ID): 0 once the node took it, else its refusal's status\n"
      "(UCS_ERR_REJECTED: a wrong capability), or UCS_ERR_TIMED_OUT after `timeout`.");
  cls.def(
      "close",
      [](AmAuthClient& self) {
        nb::gil_scoped_release release;
        self.close();
      },
      "Unregister the answer handler (idempotent).");
}

// What the node's upkeep calls on the inbox: expiry, failed batches, closing.
void bind_am_inbox_upkeep(nb::class_<AmInbox>& cls) {
  cls.def(
      "expire",
      [](AmInbox& self, double max_age) {
        nb::gil_scoped_release release;
        return self.expire(max_age);
      },
      "max_age"_a,
      "Release messages older than `max_age` seconds (their senders' requests end),\n"
      "close the connections of writers that failed or left; returns how many\n"
      "messages it released.");
  cls.def(
      "discard",
      [](AmInbox& self, uint64_t token, uint32_t count) {
        nb::gil_scoped_release release;
        self.discard(token, count);
      },
      "token"_a, "count"_a,
      "Release batch `token`'s messages, now and when they arrive: it failed.");
  cls.def(
      "close",
      [](AmInbox& self) {
        nb::gil_scoped_release release;
        self.close();
      },
      "Unregister the handler and release every waiting message (idempotent).");
}

// The inbox: made on a worker, listening, and what it holds.
void bind_am_inbox(nb::module_& m) {
  nb::class_<AmInbox> cls(m, "AmInbox",
                          "A storage node's inbox of writers' insert messages on one UCX worker.");
  cls.def(
      "__init__",
      [](AmInbox* self, nb::object worker, unsigned am_id, size_t max_messages) {
        uintptr_t h = handle_of(worker, "worker");
        new (self) AmInbox(owner_of(std::move(worker)), h, am_id, max_messages);
      },
      "worker"_a, "am_id"_a, "max_messages"_a = 1 << 16,
      "Register the insert handler for active message `am_id` on `worker` (a ucxx\n"
      "worker); at most `max_messages` wait to be received, more are refused.");
  cls.def(
      "listen",
      [](AmInbox& self, const std::string& host, uint16_t port, size_t max_connections,
         nb::bytes key) {
        std::string k(key.c_str(), key.size());
        nb::gil_scoped_release release;
        return self.listen(host, port, max_connections, k);
      },
      "host"_a = "", "port"_a = 0, "max_connections"_a = 4096, "key"_a = nb::bytes(""),
      "Listen on `host`:`port` ('' all addresses, 0 any free port) for writers'\n"
      "connections (Endpoint.to_listener), at most `max_connections` at once, and\n"
      "from then on take messages only from them. With `key` (the node's 16 bytes),\n"
      "only from those that authenticated with its capability (AmAuthClient), each\n"
      "given a second to. Returns the port.");
  cls.def_prop_ro(
      "connections",
      [](const AmInbox& self) {
        nb::dict d = connection_counts(self.connections());
        d["abandoned_receives"] = self.abandoned();
        return d;
      },
      "Writers' connections: open now (authenticated), accepted, refused (too many,\n"
      "or closed), failed (the writer died or left), aborted (force-closed to end a\n"
      "receive that did not end by itself), pending (not authenticated yet),\n"
      "unauthenticated (closed: a wrong capability or none in time), and receives\n"
      "left to UCX (abandoned_receives).");
  cls.def_prop_ro("waiting", &AmInbox::waiting, "Messages received and not taken yet.");
  cls.def_prop_ro("chunks", [](const AmInbox& a) { return a.chunk_pool().made(); },
                  "Bounce chunks made so far for runs (at most 16 in use at once).");
  cls.def_ro_static("run_bytes", &AmInbox::kRunBytes,
                    "The largest run (bytes of data in one message) a pull receives.");
  cls.def_prop_ro("refused", &AmInbox::refused,
                  "Messages refused so far (malformed, inbox full, batch failed).");
  bind_am_inbox_upkeep(cls);
}

// The writer's sends, and the raw ones the security tests attack with.
void bind_am_sends(nb::module_& m) {
  m.def(
      "am_send",
      [](const Endpoint& ep, const MemoryRegion& region, unsigned am_id, uint64_t token,
         Vec<uint64_t> offsets, Vec<uint64_t> lengths, uint64_t run_bytes) {
        const size_t n = offsets.shape(0);
        if (lengths.shape(0) != n) {
          throw UcxError(kStatusBadArgument, "am_send: offsets and lengths differ in length");
        }
        nb::gil_scoped_release release;
        am_send(ep, region, am_id, token, offsets.data(), lengths.data(), n, run_bytes);
      },
      "endpoint"_a, "region"_a, "am_id"_a, "token"_a, "offsets"_a, "lengths"_a,
      "run_bytes"_a = 0,
      "Post one rendezvous active message per item of `region` (at `offsets`, `lengths`\n"
      "bytes) to `endpoint`, headed by batch `token`, in one call; with `run_bytes`,\n"
      "items that follow one another in `region` go as runs of up to that many bytes\n"
      "(a node that takes them: AmInbox.run_bytes). The node's acknowledgement, not\n"
      "this call, says the batch landed.");

  m.def(
      "am_send_raw",
      [](const Endpoint& ep, unsigned am_id, nb::bytes header, nb::bytes data, size_t count,
         bool eager, double timeout) {
        const std::string h(header.c_str(), header.size()), d(data.c_str(), data.size());
        nb::gil_scoped_release release;
        return am_send_raw(ep, am_id, h, d, count, eager, timeout);
      },
      "endpoint"_a, "am_id"_a, "header"_a, "data"_a = nb::bytes(""), "count"_a = 1,
      "eager"_a = true, "timeout"_a = 5.0,
      "Post `count` active messages `am_id` of `header` and `data` on `endpoint`\n"
      "(eagerly, or by rendezvous) and progress its worker until they end or\n"
      "`timeout` s pass; returns how many ended well. Any bytes, any id: what a\n"
      "hostile peer can send a node's listeners (the security tests' attacker).");
}

void bind_pull_am(nb::module_& m) {
  m.def(
      "pull_am",
      [](const MemoryRegion& arena, const MemoryRegion& dest, AmInbox& inbox, uint64_t token,
         Vec<uint64_t> slot_offsets, Vec<uint64_t> lengths, Vec<uint64_t> keys,
         Vec<uint64_t> generations, double timeout_s) {
        const size_t n = slot_offsets.shape(0);
        if (lengths.shape(0) != n || keys.shape(0) != n || generations.shape(0) != n) {
          throw UcxError(kStatusBadArgument, "pull_am: the per-item arrays differ in length");
        }
        std::vector<PullItem> items(n);
        for (size_t i = 0; i < n; ++i) {
          items[i] = PullItem{slot_offsets(i), 0, lengths(i), keys(i), generations(i)};
        }
        auto [array, statuses] = new_statuses(n);
        {
          nb::gil_scoped_release release;
          pull_am(arena, dest, inbox, token, items.data(), n, timeout_s, statuses);
        }
        return array;
      },
      "arena"_a, "dest"_a, "inbox"_a, "token"_a, "slot_offsets"_a, "lengths"_a, "keys"_a,
      "generations"_a, "timeout"_a = 30.0,
      "Receive batch `token`'s items, each straight into its arena slot (payload at\n"
      "slot + 16), progressing the inbox's worker, in one call: headers invalidated\n"
      "first, real headers written after the payloads. Returns the per-item\n"
      "ucs_status_t (0 = UCS_OK; UCS_ERR_TIMED_OUT for a message that never came,\n"
      "UCS_ERR_MESSAGE_TRUNCATED for one of another length). Raises OutOfBoundsError\n"
      "before writing anything if a slot lies outside the arena.");
}

}  // namespace

void bind_am(nb::module_& m) {
  m.attr("AM_INSERT_AUTH_ID") = kAmInsertAuthId;
  m.attr("AM_SAMPLE_AUTH_ID") = kAmSampleAuthId;
  m.attr("AM_AUTH_ACK_ID") = kAmAuthAckId;
  bind_am_auth(m);
  bind_am_inbox(m);
  bind_am_sends(m);
  bind_pull_am(m);
}

}  // namespace distore
