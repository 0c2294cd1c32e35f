// Internals of the registration-on-allocation pool, shared by interpose.cc, pool.cc, table.cc.
//
// Rules for everything in this folder (it runs inside malloc, possibly before main):
//  - no malloc/new, no std containers, no C++ dynamic initialisation of globals (all globals are
//    constant-initialised PODs, atomics or pthread objects with static initialisers);
//  - metadata lives in memory taken straight from mmap (alloc/meta.h: MetaArena, PtrMap);
//  - nothing that may call malloc runs while the pool mutex is held.
#ifndef STRATA_ALLOC_INTERNAL_H_
#define STRATA_ALLOC_INTERNAL_H_

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <atomic>

#include "alloc/strata_alloc.h"

// Internal symbols stay out of the dynamic symbol table (only the C API and malloc family export).
#pragma GCC visibility push(hidden)
namespace strata::alloc {

constexpr size_t kGranule = 4096;  // block sizes and offsets are multiples of this
constexpr size_t kMinAlign = 64;   // every pool pointer is at least cache-line aligned
constexpr size_t kLargeRound = size_t{2} << 20;  // dedicated segments are multiples of 2 MiB
constexpr size_t kMaxSegments = 16384;           // capacity of the lookup table

inline size_t AlignUp(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }
inline bool IsPow2(size_t x) { return x && !(x & (x - 1)); }

// ---- configuration (interpose.cc) ----
struct Config {
  size_t threshold;      // requests >= threshold go to the pool
  size_t cache_cap;      // STRATA_ALLOC_CACHE_BYTES
  size_t segment_bytes;  // shared segment size
  size_t max_request;    // larger requests go to libc (physical memory: avoid SIGBUS on overcommit)
  size_t reserve_bytes;  // STRATA_ALLOC_RESERVE_BYTES: strata_alloc_set_reserve(SIZE_MAX)'s target
  size_t reserve_delay_ms;  // STRATA_ALLOC_RESERVE_DELAY_MS: quiet time before a refill
  bool enabled;
};
// Loaded once the environment is readable; until then the pool is off. Returns nullptr if not yet.
const Config* GetConfig();

// libc's functions, resolved with dlsym(RTLD_NEXT) (interpose.cc).
void* RealMalloc(size_t n);
void RealFree(void* p);

// The exported entry points' implementations, for calls from inside this library: a plain call to
// `malloc` from here would bind to whichever malloc wins symbol lookup.
void* ImplMalloc(size_t n);
void ImplFree(void* p);
int ImplPosixMemalign(void** out, size_t align, size_t n);
// realloc for a library hooked by strata_alloc_hook: pool blocks are resized through the pool,
// every other pointer through libc (it never moves libc memory into the pool).
void* ImplReallocOwned(void* p, size_t n);
// libc's functions resolved (interpose.cc); false while this thread is resolving them.
bool Resolve();
// true once strata_alloc_hook rewrote a library's allocation slots (hook.cc).
bool Hooked();

// ---- the segment lookup table (table.cc): a sorted interval array under a seqlock ----
struct TableHit {
  uint64_t id;
  int fd;  // -1: owned but not shareable (inherited across fork)
  uintptr_t base;
  size_t size;
};
// Writers hold the pool mutex. Readers are lock-free.
bool TableInsert(uintptr_t base, size_t size, uint64_t id, int fd);
void TableRemove(uintptr_t base);
void TableSetFd(uintptr_t base, int fd);
bool TableFind(uintptr_t p, size_t len, TableHit* hit);
// Fast necessary condition for ownership: p lies within [lowest base, highest end).
bool TableMaybeOwns(uintptr_t p);

// ---- the pool (pool.cc) ----
struct PoolResult {
  void* ptr;
  size_t dirty;  // bytes from ptr that may hold old data (the rest is fresh zero memory)
};
// nullptr ptr when the pool cannot serve it (caller falls back to libc). align: power of two.
PoolResult PoolAlloc(size_t size, size_t align);
// p must be owned (TableFind); aborts on an invalid/double free.
void PoolFree(void* p);
size_t PoolUsableSize(const void* p);
// Try to resize the block at p in place to at least n bytes (n >= threshold). true on success.
bool PoolResizeInPlace(void* p, size_t n);

void CountLibcAlloc();
uint64_t LibcAllocCount();

[[noreturn]] void Fatal(const char* msg);

}  // namespace strata::alloc
#pragma GCC visibility pop

#endif  // STRATA_ALLOC_INTERNAL_H_
