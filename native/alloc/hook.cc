// In-process alternative to LD_PRELOAD: point one library's own references to posix_memalign,
// free and realloc (its GOT slots) at the pool, in a process that has already started.
//
// Why: XLA CPU allocates every large buffer with posix_memalign(64, size) from libjax_common.so
// and releases it with free() from the same library (tsl::port::AlignedMalloc/AlignedFree). A
// relocation slot rewritten there routes exactly those calls through the pool, whatever started
// the process (mpirun, srun, `python script.py`, a notebook), with no restart and nothing else in
// the process touched: Python, numpy and libc keep glibc's malloc.
//
// Soundness: only posix_memalign may return pool memory, and only to that library; its free and
// realloc first check ownership (the lock-free table lookup) and pass every other pointer (libc
// memory, including blocks allocated before the hook) to glibc. A pool pointer handed to another
// library and freed there would reach glibc's free: XLA does not do that (the allocation and the
// release of a buffer are both in libjax_common; numpy/DLPack views release through XLA's
// deleter), and the LD_PRELOAD path would have the same requirement reversed.
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "alloc/internal.h"

namespace strata::alloc {
namespace {

#if defined(__x86_64__)
constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_AARCH64_GLOB_DAT;
#else
#error "strata_alloc_hook: unsupported architecture"
#endif

// Set once the first slot is rewritten; read by strata_alloc_active / strata_alloc_hooked.
std::atomic<int> g_hooked{0};

int HookPosixMemalign(void** out, size_t align, size_t n) {
  return ImplPosixMemalign(out, align, n);
}
void HookFree(void* p) { ImplFree(p); }
void* HookRealloc(void* p, size_t n) { return ImplReallocOwned(p, n); }

struct Target {
  const char* name;
  void* fn;
};

struct Search {
  const char* lib;  // substring of the library's path
  const Target* targets;
  int ntargets;
  int patched;
  int found;  // libraries matched
  int error;  // errno of a failed mprotect
};

uintptr_t Ptr(uintptr_t base, ElfW(Addr) v) { return v < base ? base + v : v; }

// Rewrites one slot. RELRO pages are made writable for the store and read-only again.
bool Patch(void** slot, void* fn, uintptr_t relro_lo, uintptr_t relro_hi, int* error) {
  uintptr_t a = reinterpret_cast<uintptr_t>(slot);
  long page = sysconf(_SC_PAGESIZE);
  uintptr_t lo = a & ~static_cast<uintptr_t>(page - 1);
  bool relro = a >= relro_lo && a < relro_hi;
  if (relro && mprotect(reinterpret_cast<void*>(lo), page, PROT_READ | PROT_WRITE) != 0) {
    *error = errno;
    return false;
  }
  __atomic_store_n(slot, fn, __ATOMIC_RELEASE);  // other threads see the old or the new target
  if (relro) mprotect(reinterpret_cast<void*>(lo), page, PROT_READ);
  return true;
}

int OnLibrary(struct dl_phdr_info* info, size_t, void* data) {
  auto* s = static_cast<Search*>(data);
  if (!info->dlpi_name || !strstr(info->dlpi_name, s->lib)) return 0;
  s->found++;
  uintptr_t base = info->dlpi_addr;
  const ElfW(Dyn)* dyn = nullptr;
  uintptr_t relro_lo = 0, relro_hi = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) & ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_DYNAMIC) dyn = reinterpret_cast<const ElfW(Dyn)*>(base + ph.p_vaddr);
    if (ph.p_type == PT_GNU_RELRO) {
      relro_lo = base + ph.p_vaddr;
      relro_hi = relro_lo + ph.p_memsz;
    }
  }
  if (!dyn) return 0;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const ElfW(Rela)* jmprel = nullptr;
  const ElfW(Rela)* rela = nullptr;
  size_t jmprel_bytes = 0, rela_bytes = 0;
  for (const ElfW(Dyn)* d = dyn; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB:
        symtab = reinterpret_cast<const ElfW(Sym)*>(Ptr(base, d->d_un.d_ptr));
        break;
      case DT_STRTAB:
        strtab = reinterpret_cast<const char*>(Ptr(base, d->d_un.d_ptr));
        break;
      case DT_JMPREL:
        jmprel = reinterpret_cast<const ElfW(Rela)*>(Ptr(base, d->d_un.d_ptr));
        break;
      case DT_PLTRELSZ:
        jmprel_bytes = d->d_un.d_val;
        break;
      case DT_RELA:
        rela = reinterpret_cast<const ElfW(Rela)*>(Ptr(base, d->d_un.d_ptr));
        break;
      case DT_RELASZ:
        rela_bytes = d->d_un.d_val;
        break;
      default:
        break;
    }
  }
  if (!symtab || !strtab) return 0;
  const ElfW(Rela) * tables[2] = {jmprel, rela};
  size_t counts[2] = {jmprel_bytes / sizeof(ElfW(Rela)), rela_bytes / sizeof(ElfW(Rela))};
  for (int t = 0; t < 2; ++t) {
    if (!tables[t]) continue;
    for (size_t i = 0; i < counts[t]; ++i) {
      const ElfW(Rela) & r = tables[t][i];
      uint32_t type = ELF64_R_TYPE(r.r_info);
      if (type != kJumpSlot && type != kGlobDat) continue;
      const char* name = strtab + symtab[ELF64_R_SYM(r.r_info)].st_name;
      for (int k = 0; k < s->ntargets; ++k) {
        if (strcmp(name, s->targets[k].name) != 0) continue;
        auto** slot = reinterpret_cast<void**>(base + r.r_offset);
        if (Patch(slot, s->targets[k].fn, relro_lo, relro_hi, &s->error)) s->patched++;
      }
    }
  }
  return 0;
}

}  // namespace

bool Hooked() { return g_hooked.load(std::memory_order_acquire) != 0; }

}  // namespace strata::alloc

using namespace strata::alloc;

extern "C" __attribute__((visibility("default"))) int strata_alloc_hook(const char* library) {
  if (!library || !*library) return -EINVAL;
  if (!Resolve() || !GetConfig()) return -EAGAIN;  // libc's functions and the settings first
  // Release first, then allocation: once posix_memalign can return pool memory, every free and
  // realloc of the library already recognises it.
  static const Target release[] = {
      {"free", reinterpret_cast<void*>(&HookFree)},
      {"realloc", reinterpret_cast<void*>(&HookRealloc)},
  };
  static const Target allocate[] = {
      {"posix_memalign", reinterpret_cast<void*>(&HookPosixMemalign)},
  };
  Search s{library, release, 2, 0, 0, 0};
  dl_iterate_phdr(&OnLibrary, &s);
  if (s.error) return -s.error;
  if (s.found == 0) return -ENOENT;
  Search a{library, allocate, 1, 0, 0, 0};
  dl_iterate_phdr(&OnLibrary, &a);
  if (a.error) return -a.error;
  if (a.patched > 0) g_hooked.store(1, std::memory_order_release);
  return s.patched + a.patched;
}
