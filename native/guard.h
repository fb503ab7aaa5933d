// Refusing remote writes on a storage node.
//
// Two paths carry a UCX put into a process over TCP, and both are guarded:
// UCP's software put (an active message; endpoints with peer-failure
// handling use it), refused here by replacing its handler, and the TCP
// transport's own zero-copy put (endpoints without it), refused by
// tcp_guard.cc unless it lands inside a window the node opened for a
// receive it posted (a rendezvous insert).
//
// Over TCP (and any transport without hardware RMA) UCX emulates RMA with
// active messages, and the target's handlers trust the initiator: a PUT
// (or atomic) message is a memcpy to whatever address it names, without
// looking at remote keys or their access flags (ucp_mem_map's
// UCP_MEM_MAP_PROT_* bind hardware keys only). One put into a node's
// read-only arena faults the node; a put anywhere else corrupts it silently.
// A storage node never receives writes (it pulls inserts itself, learners
// only read), so it replaces UCX's PUT and atomic-request handlers with ones
// that drop the message, and guards GET requests to the ranges it serves.
//
// This patches handler tables libucp exports (ucp_am_handler_UCP_AM_ID_*);
// it must run before the process creates its UCX worker. Thread safety:
// install once at start; the handlers only use atomics.
#pragma once

#include <cstdint>
#include <string>

namespace distore {

// Installs the refusing handlers in this process. Returns "" on success, else
// why not (the libucp build lacks the symbols, or their layout is not the
// one expected): the caller logs it and carries on unguarded.
std::string refuse_remote_writes();

// Lets software GETs read [base, base + size) (the arena); a GET outside
// every allowed range is dropped. Until the first call, GETs are not limited.
void allow_remote_reads(uint64_t base, uint64_t size);

// Messages dropped so far: (puts and atomics, gets outside the allowed ranges).
uint64_t refused_writes();
uint64_t refused_reads();

// Makes this process's UCX TCP transport end any connection that carries a
// put outside the open windows, or a frame UCX would misread (tcp_guard.cc).
// Must run before the process creates its UCX worker. "" on success, else
// why not (another UCX version, symbols missing): the caller then keeps
// stock UCX peers from choosing TCP puts (UCX_TCP_PUT_ENABLE=n) and warns.
std::string refuse_tcp_puts();

// Opens [address, address + size) to TCP puts (a rendezvous receive the
// node posted into a slot), until the matching close. Thread safe.
void open_put_window(uint64_t address, uint64_t size);
void close_put_window(uint64_t address, uint64_t size);

// Connections ended for a put outside the windows (or a malformed frame),
// and the last one in words ("a put of 256 bytes at 0x... from IP:PORT").
uint64_t refused_tcp_puts();
uint64_t accepted_tcp_puts();  // puts that landed in a window (inserts)
std::string last_refused_tcp_put();

}  // namespace distore
