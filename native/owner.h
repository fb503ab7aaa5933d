// What a native object holds to keep alive a parent that is not one of ours:
// the object that owns a raw UCX handle it was given (a ucxx worker or
// context, whose handle it uses) or memory it borrows (a torch tensor). The
// core never looks inside an Owner and needs no Python to hold one; the
// bindings make it from a Python object (bindings.h, owner_of), so dropping
// its last copy releases a Python reference and must happen with the GIL
// held, as the Python object would have been dropped: the core's holders
// drop theirs in their destructors (which Python runs) or under a call that
// keeps the GIL. Copies may be made without it. Empty: nothing held.
#pragma once

#include <memory>
#include <utility>

namespace distore {

using Owner = std::shared_ptr<void>;

// Keeps what `o` holds alive for good, never released: memory UCX may still
// use after its holder gave up waiting for it. Needs no GIL.
inline void keep_for_good(Owner o) { new Owner(std::move(o)); }

}  // namespace distore
