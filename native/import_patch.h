// Redirecting a function one loaded library imports from another.
//
// A call from a shared library to a function of another goes through the
// caller's global offset table (its PLT slot, or a GLOB_DAT entry where the
// address is taken). Rewriting that entry redirects every call the library
// makes, and only that library's calls: the guard uses it to see, in the
// storage node's process, the bytes UCX's TCP transport (libuct) receives.
// Linux with glibc, x86-64 and aarch64. Not thread safe: patch at start-up,
// before any thread calls the function.
#pragma once

#include <string>

namespace distore {

// Finds the loaded object whose file name contains `library` (e.g.
// "libuct.so") and points its imports of `symbol` at `replacement`.
// Returns "" on success (at least one entry rewritten), else why not.
std::string patch_import(const char* library, const char* symbol, void* replacement);

}  // namespace distore
