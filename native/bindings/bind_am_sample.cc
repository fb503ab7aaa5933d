// Bindings: samples carried by UCX active messages (am_sample.h): the
// node's server, the learner's client and its one call per batch.
#include "bindings.h"

#include <nanobind/stl/optional.h>

#include "am_sample.h"
#include "endpoint.h"
#include "layout.h"
#include "memory.h"

namespace distore {

namespace {

AmSampleServer::Endpoints endpoints_mode(const std::string& name) {
  if (name == "reply") return AmSampleServer::Endpoints::kReply;
  if (name == "registered") return AmSampleServer::Endpoints::kRegistered;
  throw UcxError(kStatusBadArgument, "AmSampleServer: endpoints must be 'reply' or "
                                     "'registered', not '" + name + "'");
}

// Learners' endpoints ('registered' mode) and connections (its listener).
void bind_am_sample_server_peers(nb::class_<AmSampleServer>& cls) {
  cls.def(
      "set_peer",
      [](AmSampleServer& self, uint64_t client, nb::handle_t<Endpoint> ep) {
        self.set_peer(client, nb::cast<Endpoint*>(ep), owner_of(nb::borrow(ep)));
      },
      "client"_a, "endpoint"_a,
      "'registered' mode: answer requests naming `client` on `endpoint` (kept alive\n"
      "until drop_peer).");
  cls.def("drop_peer", &AmSampleServer::drop_peer, "client"_a,
          "Stop answering `client`: its batches under way fail.");
  cls.def(
      "listen",
      [](AmSampleServer& self, const std::string& host, uint16_t port,
         size_t max_connections, nb::bytes key) {
        std::string k(key.c_str(), key.size());
        nb::gil_scoped_release release;
        return self.listen(host, port, max_connections, k);
      },
      "host"_a = "", "port"_a = 0, "max_connections"_a = 4096, "key"_a = nb::bytes(""),
      "Listen on `host`:`port` ('' all addresses, 0 any free port) for learners'\n"
      "connections (Endpoint.to_listener), at most `max_connections` at once:\n"
      "requests on them are answered on them ('reply'), with peer-failure handling\n"
      "and zero-copy rendezvous over TCP. With `key` (the node's 16 bytes), only\n"
      "connections that authenticated with its capability are served (others are\n"
      "closed after a second), and only requests whose items carry the control\n"
      "plane's grants (am_grant.h). Returns the port.");
  cls.def(
      "reap",
      [](AmSampleServer& self, double timeout) {
        nb::gil_scoped_release release;
        return self.reap(timeout);
      },
      "timeout"_a = 1.0,
      "Close the listener's connections of learners that failed or left (each\n"
      "close progresses the worker for at most `timeout` s); returns how many.");
  cls.def_prop_ro(
      "connections",
      [](const AmSampleServer& self) { return connection_counts(self.connections()); },
      "Learners' connections through the listener: open now, accepted, refused\n"
      "(too many, or closed), failed (the learner died or left), aborted (all 0\n"
      "when not listening).");
}

void bind_am_sample_server_stats(nb::class_<AmSampleServer>& cls) {
  cls.def_prop_ro(
      "stats",
      [](const AmSampleServer& self) {
        const AmSampleServer::Stats s = self.stats();
        nb::dict d;
        d["requests"] = s.requests;
        d["refused"] = s.refused;
        d["unauthorized"] = s.unauthorized;
        d["held_bytes"] = s.held_bytes;
        d["batches_done"] = s.batches_done;
        d["batches_failed"] = s.batches_failed;
        d["messages"] = s.messages;
        d["bytes"] = s.bytes;
        d["send_errors"] = s.send_errors;
        d["in_flight"] = s.in_flight;
        d["abandoned"] = s.abandoned;
        d["stuck"] = s.stuck;
        d["runs"] = s.runs;
        d["unpacked"] = s.unpacked;
        return d;
      },
      "Counters: requests accepted and refused (unauthorized: of those, from no\n"
      "authenticated connection or without grants), request state held now\n"
      "(held_bytes), batches sent whole and failed (the\n"
      "learner went away), messages sent, bytes of batches sent, send errors,\n"
      "batches being sent now, batches abandoned after `stall` s without progress\n"
      "and, of those, the ones UCX still holds (stuck), messages that carried several\n"
      "items (runs) and runs sent item by item for want of a free chunk (unpacked).\n"
      "Reading it abandons stalled batches.");
  cls.def(
      "close",
      [](AmSampleServer& self, double timeout) {
        nb::gil_scoped_release release;
        return self.close(timeout);
      },
      "timeout"_a = 5.0,
      "Unregister the handler, close the listener and its connections, and wait up\n"
      "to `timeout` s for batches being sent; True if none is left (else the arena\n"
      "stays mapped for good).");
}

void bind_am_sample_server(nb::module_& m) {
  nb::class_<AmSampleServer> cls(
      m, "AmSampleServer",
      "A storage node's side of samples by active message: answers learners'\n"
      "requests by sending each asked-for part of a slot, rendezvous, from the arena.");
  cls.def(
      "__init__",
      [](AmSampleServer* self, nb::object worker, nb::object arena, unsigned request_id,
         unsigned data_id, const std::string& endpoints, size_t max_in_flight,
         size_t max_batches, double stall, nb::object bounce, size_t chunk_bytes) {
        uintptr_t h = handle_of(worker, "worker");
        const MemoryRegion& region = nb::cast<const MemoryRegion&>(arena);
        const MemoryRegion* b =
            bounce.is_none() ? nullptr : &nb::cast<const MemoryRegion&>(bounce);
        new (self) AmSampleServer(owner_of(std::move(worker)), h, owner_of(std::move(arena)),
                                  region, request_id, data_id, endpoints_mode(endpoints),
                                  max_in_flight, max_batches, stall,
                                  owner_of(std::move(bounce)), b, chunk_bytes);
      },
      "worker"_a, "arena"_a, "request_id"_a = kAmSampleRequestId,
      "data_id"_a = kAmSampleDataId, "endpoints"_a = "reply", "max_in_flight"_a = 16,
      "max_batches"_a = 256, "stall"_a = 10.0, "bounce"_a = nb::none(),
      "chunk_bytes"_a = 1 << 20,
      "Register the sample request handler on `worker` (a ucxx worker: the one\n"
      "learners connect to; its progress thread runs the handler); parts are\n"
      "sent from `arena` (a MemoryRegion; offsets are relative to its address).\n"
      "`endpoints`: 'reply' answers on the endpoint a request came on, 'registered'\n"
      "on the endpoint set_peer() gave for the request's client id. At most\n"
      "`max_in_flight` messages per batch and `max_batches` batches at a time\n"
      "(more are refused with UCS_ERR_BUSY). A batch whose sends made no progress\n"
      "for `stall` s (a learner that went away where UCX does not fail the sends)\n"
      "stops counting against max_batches (stats: abandoned, stuck).\n"
      "`bounce` (a MemoryRegion, or None): cut into chunks of `chunk_bytes`; a part of\n"
      "several items the learner reads into consecutive rows is copied into a free\n"
      "chunk and sent as one message (up to 64 items; stats: runs), else item by item\n"
      "(stats: unpacked). None: one message per item and part.");
  bind_am_sample_server_peers(cls);
  bind_am_sample_server_stats(cls);
}

void bind_am_sample_fetch(nb::class_<AmSampleClient>& cls) {
  cls.def(
      "fetch",
      [](AmSampleClient& self, std::vector<Endpoint*> endpoints, Vec<uint32_t> node,
         Vec<uint64_t> slot_offsets, Vec<uint64_t> rows, const BatchLayout& layout,
         const MemoryRegion& dest, double timeout, uint64_t rndv_min, double stall,
         std::optional<Vec<uint32_t>> tags, uint64_t slot_size) {
        const size_t n = node.shape(0);
        if (slot_offsets.shape(0) != n || rows.shape(0) != n ||
            (tags && tags->shape(0) != n)) {
          throw UcxError(kStatusBadArgument, "AmSampleClient.fetch: node, slot_offsets, "
                                             "rows and tags differ in length");
        }
        const uint32_t* t = tags ? tags->data() : nullptr;
        auto [array, statuses] = new_statuses(n);
        {
          nb::gil_scoped_release release;
          self.fetch(endpoints, node.data(), slot_offsets.data(), t, slot_size, rows.data(),
                     n, layout, dest, timeout, rndv_min, stall, statuses);
        }
        return array;
      },
      "endpoints"_a, "node"_a, "slot_offsets"_a, "rows"_a, "layout"_a, "dest"_a,
      "timeout"_a = 30.0, "rndv_min"_a = 8192, "stall"_a = 2.0, "tags"_a = nb::none(),
      "slot_size"_a = 0,
      "Read one batch, in one call: item i's slot (at slot_offsets[i] in the arena of\n"
      "the node behind endpoints[node[i]], of `slot_size` bytes, granted by tags[i]:\n"
      "the sample reply's ITEM_LOCATION `pad`) lands in row rows[i] of `layout` in\n"
      "`dest` (host memory): each field in its dense array, sent by the node straight\n"
      "into place (rendezvous for fields of `rndv_min` bytes and more), and the slot\n"
      "header, once the item is whole, in the header array ((0, 0) for an item that\n"
      "failed). Returns the per-item ucs_status_t (0 = UCS_OK); the caller checks the\n"
      "headers against the (key, generation) it asked for, as after gather_dense.\n"
      "When nothing of the batch arrives for `stall` s (0: never), the items still\n"
      "awaited fail with UCS_ERR_TIMED_OUT as at `timeout`; then the endpoints with\n"
      "error handling of the nodes awaited are force-closed (drop them).\n"
      "Raises InvalidArgument / OutOfBoundsError before sending anything if an\n"
      "argument is malformed.");
}

void bind_am_sample_client(nb::module_& m) {
  nb::class_<AmSampleClient> cls(
      m, "AmSampleClient",
      "A learner's side of samples by active message: one request per node, every\n"
      "part received straight into its dense array.");
  cls.def(
      "__init__",
      [](AmSampleClient* self, nb::object worker, unsigned request_id, unsigned data_id,
         uint64_t client_id) {
        uintptr_t h = handle_of(worker, "worker");
        new (self) AmSampleClient(owner_of(std::move(worker)), h, request_id, data_id,
                                  client_id);
      },
      "worker"_a, "request_id"_a = kAmSampleRequestId, "data_id"_a = kAmSampleDataId,
      "client_id"_a = 0,
      "Register the data handler on `worker` (the ucxx worker the endpoints to the\n"
      "nodes are on; fetch progresses it); requests name `client_id`.");
  bind_am_sample_fetch(cls);
  cls.def_prop_ro(
      "stats",
      [](const AmSampleClient& self) {
        const AmSampleClient::Stats s = self.stats();
        nb::dict d;
        d["batches"] = s.batches;
        d["late"] = s.late;
        d["refused"] = s.refused;
        d["malformed"] = s.malformed;
        return d;
      },
      "Counters: batches fetched, messages that came for no batch under way (late),\n"
      "refusals from nodes, malformed messages.");
  cls.def(
      "close",
      [](AmSampleClient& self) {
        nb::gil_scoped_release release;
        self.close();
      },
      "Unregister the data handler (idempotent).");
}

}  // namespace

void bind_am_sample(nb::module_& m) {
  m.attr("AM_SAMPLE_REQUEST_ID") = kAmSampleRequestId;
  m.attr("AM_SAMPLE_DATA_ID") = kAmSampleDataId;
  bind_am_sample_server(m);
  bind_am_sample_client(m);
}

}  // namespace distore
