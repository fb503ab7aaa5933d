#include "import_patch.h"

#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

namespace distore {

namespace {

#if defined(__x86_64__)
constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_AARCH64_GLOB_DAT;
#else
#define DISTORE_NO_IMPORT_PATCH 1
#endif

struct Search {
  const char* library;
  const char* symbol;
  void* replacement;
  int found_objects = 0;
  int patched = 0;
  std::string error;
};

// glibc relocates the pointers of a writable .dynamic in place; others keep
// them relative to the load address.
uintptr_t dyn_ptr(ElfW(Addr) base, ElfW(Addr) value) {
  return value < base ? base + value : value;
}

bool write_slot(uintptr_t slot, void* value) {
  const long page = sysconf(_SC_PAGESIZE);
  const uintptr_t start = slot & ~static_cast<uintptr_t>(page - 1);
  // RELRO pages are read-only after start-up: make the one page writable.
  // It stays writable; nothing else in the process relies on it being not.
  if (mprotect(reinterpret_cast<void*>(start), page, PROT_READ | PROT_WRITE) != 0) return false;
  __atomic_store_n(reinterpret_cast<void**>(slot), value, __ATOMIC_RELEASE);
  return true;
}

int visit(struct dl_phdr_info* info, size_t, void* arg) {
  auto* s = static_cast<Search*>(arg);
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, s->library) == nullptr) return 0;
  ++s->found_objects;
#ifndef DISTORE_NO_IMPORT_PATCH
  const ElfW(Addr) base = info->dlpi_addr;
  const ElfW(Dyn)* dyn = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
      dyn = reinterpret_cast<const ElfW(Dyn)*>(base + info->dlpi_phdr[i].p_vaddr);
    }
  }
  if (dyn == nullptr) return 0;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const ElfW(Rela)* tables[2] = {nullptr, nullptr};
  size_t sizes[2] = {0, 0};
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    switch (dyn->d_tag) {
      case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym)*>(dyn_ptr(base, dyn->d_un.d_ptr)); break;
      case DT_STRTAB: strtab = reinterpret_cast<const char*>(dyn_ptr(base, dyn->d_un.d_ptr)); break;
      case DT_JMPREL: tables[0] = reinterpret_cast<const ElfW(Rela)*>(dyn_ptr(base, dyn->d_un.d_ptr)); break;
      case DT_PLTRELSZ: sizes[0] = dyn->d_un.d_val; break;
      case DT_RELA: tables[1] = reinterpret_cast<const ElfW(Rela)*>(dyn_ptr(base, dyn->d_un.d_ptr)); break;
      case DT_RELASZ: sizes[1] = dyn->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == nullptr || strtab == nullptr) return 0;
  for (int t = 0; t < 2; ++t) {
    if (tables[t] == nullptr) continue;
    for (size_t i = 0; i < sizes[t] / sizeof(ElfW(Rela)); ++i) {
      const ElfW(Rela)& r = tables[t][i];
      const uint32_t type = ELF64_R_TYPE(r.r_info);
      if (type != kJumpSlot && type != kGlobDat) continue;
      const ElfW(Sym)& sym = symtab[ELF64_R_SYM(r.r_info)];
      if (std::strcmp(strtab + sym.st_name, s->symbol) != 0) continue;
      if (write_slot(base + r.r_offset, s->replacement)) {
        ++s->patched;
      } else {
        s->error = "mprotect refused";
      }
    }
  }
#endif
  return 0;
}

}  // namespace

std::string patch_import(const char* library, const char* symbol, void* replacement) {
#ifdef DISTORE_NO_IMPORT_PATCH
  (void)library;
  (void)symbol;
  (void)replacement;
  return "this CPU architecture is not supported";
#else
  Search s{library, symbol, replacement, 0, 0, {}};
  dl_iterate_phdr(&visit, &s);
  if (s.found_objects == 0) return std::string(library) + " is not loaded";
  if (s.patched == 0) {
    return std::string(library) + " does not import " + symbol +
           (s.error.empty() ? "" : " (" + s.error + ")");
  }
  return "";
#endif
}

}  // namespace distore
