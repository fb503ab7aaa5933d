// Bindings: inserts carried by UCX active messages with rendezvous
// (am_insert.h): the writer's send, the node's inbox and batched receive.
#include "bindings.h"

#include "am_insert.h"
#include "endpoint.h"
#include "memory.h"

namespace distore {

void bind_am(nb::module_& m) {
  nb::class_<AmInbox>(m, "AmInbox",
                      "A storage node's inbox of writers' insert messages on one UCX worker.")
      .def(
          "__init__",
          [](AmInbox* self, nb::object worker, unsigned am_id, size_t max_messages) {
            uintptr_t h = handle_of(worker, "worker");
            new (self) AmInbox(std::move(worker), h, am_id, max_messages);
          },
          "worker"_a, "am_id"_a, "max_messages"_a = 1 << 16,
          "Register the insert handler for active message `am_id` on `worker` (a ucxx\n"
          "worker); at most `max_messages` wait to be received, more are refused.")
      .def(
          "listen",
          [](AmInbox& self, const std::string& host, uint16_t port, size_t max_connections) {
            nb::gil_scoped_release release;
            return self.listen(host, port, max_connections);
          },
          "host"_a = "", "port"_a = 0, "max_connections"_a = 4096,
          "Listen on `host`:`port` ('' all addresses, 0 any free port) for writers'\n"
          "connections (Endpoint.to_listener), at most `max_connections` at once, and\n"
          "from then on take messages only from them. Returns the port.")
      .def_prop_ro(
          "connections",
          [](const AmInbox& self) {
            nb::dict d = connection_counts(self.connections());
            d["abandoned_receives"] = self.abandoned();
            return d;
          },
          "Writers' connections: open now, accepted, refused (too many, or closed),\n"
          "failed (the writer died or left), aborted (force-closed to end a receive\n"
          "that did not end by itself), and receives left to UCX (abandoned_receives).")
      .def_prop_ro("waiting", &AmInbox::waiting, "Messages received and not taken yet.")
      .def_prop_ro("chunks", &AmInbox::chunks,
                   "Bounce chunks made so far for runs (at most 16 in use at once).")
      .def_ro_static("run_bytes", &AmInbox::kRunBytes,
                     "The largest run (bytes of data in one message) a pull receives.")
      .def_prop_ro("refused", &AmInbox::refused,
                   "Messages refused so far (malformed, inbox full, batch failed).")
      .def(
          "expire",
          [](AmInbox& self, double max_age) {
            nb::gil_scoped_release release;
            return self.expire(max_age);
          },
          "max_age"_a,
          "Release messages older than `max_age` seconds (their senders' requests end),\n"
          "close the connections of writers that failed or left; returns how many\n"
          "messages it released.")
      .def(
          "discard",
          [](AmInbox& self, uint64_t token, uint32_t count) {
            nb::gil_scoped_release release;
            self.discard(token, count);
          },
          "token"_a, "count"_a,
          "Release batch `token`'s messages, now and when they arrive: it failed.")
      .def(
          "close",
          [](AmInbox& self) {
            nb::gil_scoped_release release;
            self.close();
          },
          "Unregister the handler and release every waiting message (idempotent).");

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

}  // namespace distore
