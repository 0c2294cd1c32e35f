// The malloc-family interposer: routes requests of at least the threshold to the pool and
// everything else (and every pointer the pool does not own) to libc.
//
// Bootstrap: libc's functions are found with dlsym(RTLD_NEXT) on the first call. dlsym itself may
// call malloc/calloc; while the resolving thread is inside dlsym those calls are served from a
// small static arena (never freed, recognised by address in free/realloc). Other threads that
// arrive during resolution wait for it to finish. Configuration is read from the environment at the
// first allocation after `environ` is set (before that the pool is simply off).
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc/internal.h"

extern char** environ;

namespace strata::alloc {

[[noreturn]] void Fatal(const char* msg) {
  const char prefix[] = "strata_alloc: fatal: ";
  ssize_t r = write(2, prefix, sizeof(prefix) - 1);
  r = write(2, msg, strlen(msg));
  r = write(2, "\n", 1);
  (void)r;
  abort();
}

// Allocations passed to libc, counted in stripes: a shared atomic would bounce a cache line
// between every allocating thread. Threads are spread by their stack address.
namespace {
struct alignas(64) Stripe {
  std::atomic<uint64_t> n;
};
Stripe g_libc_allocs[16];
}  // namespace

void CountLibcAlloc() {
  int probe;
  size_t i = (reinterpret_cast<uintptr_t>(&probe) >> 14) & 15;
  g_libc_allocs[i].n.fetch_add(1, std::memory_order_relaxed);
}

uint64_t LibcAllocCount() {
  uint64_t total = 0;
  for (auto& s : g_libc_allocs) total += s.n.load(std::memory_order_relaxed);
  return total;
}

namespace {

struct RealFns {
  void* (*malloc)(size_t);
  void (*free)(void*);
  void* (*calloc)(size_t, size_t);
  void* (*realloc)(void*, size_t);
  void* (*memalign)(size_t, size_t);
  int (*posix_memalign)(void**, size_t, size_t);
  void* (*aligned_alloc)(size_t, size_t);
  void* (*valloc)(size_t);
  void* (*pvalloc)(size_t);
  size_t (*usable_size)(void*);
};
RealFns g_real;
std::atomic<int> g_resolve{0};  // 0: not started, 1: in progress, 2: ready
std::atomic<unsigned long> g_resolver{0};

// ---- bootstrap arena: bump allocation, 16-byte header holding the size ----
constexpr size_t kBootBytes = 64 * 1024;
alignas(4096) char g_boot[kBootBytes];
std::atomic<size_t> g_boot_used{0};

bool IsBoot(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(g_boot);
  return a >= b && a < b + kBootBytes;
}
void* BootAlloc(size_t n, size_t align = 16) {
  if (align < 16) align = 16;
  size_t cur = g_boot_used.load(std::memory_order_relaxed), start;
  do {
    start = AlignUp(cur + 16, align);
    if (n > kBootBytes || start + n > kBootBytes) return nullptr;
  } while (!g_boot_used.compare_exchange_weak(cur, start + n));
  memcpy(g_boot + start - sizeof(size_t), &n, sizeof(size_t));
  return g_boot + start;  // static storage: already zero, so calloc needs nothing more
}
size_t BootSize(const void* p) {
  size_t n;
  memcpy(&n, static_cast<const char*>(p) - sizeof(size_t), sizeof(size_t));
  return n;
}

template <typename F>
void Sym(F* out, const char* name, bool required) {
  void* f = dlsym(RTLD_NEXT, name);
  if (!f && required) Fatal("dlsym(RTLD_NEXT) cannot find libc's allocator");
  *out = reinterpret_cast<F>(f);
}

}  // namespace

// true once libc's functions are known; false while this very thread is resolving them.
bool Resolve() {
  if (g_resolve.load(std::memory_order_acquire) == 2) return true;
  unsigned long self = static_cast<unsigned long>(pthread_self());
  int expected = 0;
  if (g_resolve.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    g_resolver.store(self, std::memory_order_relaxed);
    Sym(&g_real.malloc, "malloc", true);
    Sym(&g_real.free, "free", true);
    Sym(&g_real.calloc, "calloc", true);
    Sym(&g_real.realloc, "realloc", true);
    Sym(&g_real.memalign, "memalign", true);
    Sym(&g_real.posix_memalign, "posix_memalign", true);
    Sym(&g_real.aligned_alloc, "aligned_alloc", true);
    Sym(&g_real.valloc, "valloc", true);
    Sym(&g_real.pvalloc, "pvalloc", true);
    Sym(&g_real.usable_size, "malloc_usable_size", true);
    g_resolve.store(2, std::memory_order_release);
    return true;
  }
  if (g_resolver.load(std::memory_order_relaxed) == self) return false;  // dlsym recursed into us
  while (g_resolve.load(std::memory_order_acquire) != 2) sched_yield();
  return true;
}

namespace {

// ---- configuration ----
Config g_cfg;
std::atomic<int> g_cfg_state{0};  // 0: not loaded, 1: loading, 2: loaded
// Requests >= this take the pool path. 0 until the configuration is known (so every request takes
// the slow check), then the threshold, or SIZE_MAX when the pool is off.
std::atomic<size_t> g_threshold{0};

size_t ParseBytes(const char* name, size_t dflt) {
  const char* s = getenv(name);
  if (!s || !*s) return dflt;
  size_t v = 0;
  const char* c = s;
  for (; *c >= '0' && *c <= '9'; ++c) v = v * 10 + static_cast<size_t>(*c - '0');
  if (c == s) return dflt;
  switch (*c) {
    case 'k':
    case 'K':
      v <<= 10;
      break;
    case 'm':
    case 'M':
      v <<= 20;
      break;
    case 'g':
    case 'G':
      v <<= 30;
      break;
    default:
      break;
  }
  return v;
}

void LoadConfig() {
  // Default 64 KiB: the low-latency path's default threshold (fabric/shm_ll.h), so that every
  // buffer a call across processes passes by address (above that threshold) is fabric memory.
  // At 256 KiB (the default before) inputs of 64-256 KiB went to glibc and the general path
  // staged them through a bounce buffer with both barriers: 2 processes under mpirun, 128 KiB
  // per rank, ppermute 74-75 against 32-37 us with 64K, psum 68-71 against 39-41, all_to_all
  // 70-74 against 34-36 (collectives.py, 2 alternated runs); train_moe and train_recsys
  // --preset paper under launch -n 4 were no slower (1.46-1.52x xla_sort against 1.44x, 1.38-
  // 1.43x jax.lax against 1.39-1.42x). Why not lower: glibc reuses its heap below 128 KiB
  // (1.5 us per 64 KiB, tests/alloc_helpers/bench_alloc.c), so pooling gains nothing there, while
  // the pool's mutex would sit in the path of XLA's many small allocations and its 4 KiB rounding
  // waste more (<= 6% at 64 KiB). Above 128 KiB glibc mmaps afresh and pays first touch every
  // time (102 us per 256 KiB buffer, 427 us per MiB) where the pool reuses warm pages (0.3 and
  // 1.4 us).
  g_cfg.threshold = ParseBytes("STRATA_ALLOC_THRESHOLD", size_t{64} << 10);
  if (g_cfg.threshold < kGranule) g_cfg.threshold = kGranule;
  g_cfg.cache_cap = ParseBytes("STRATA_ALLOC_CACHE_BYTES", size_t{1} << 30);
  g_cfg.segment_bytes =
      AlignUp(ParseBytes("STRATA_ALLOC_SEGMENT_BYTES", size_t{64} << 20), kLargeRound);
  if (g_cfg.segment_bytes == 0) g_cfg.segment_bytes = kLargeRound;
  // 128 MiB by default: in benchmarks/registration.py (4 processes, 64 MiB of gradients each)
  // the first training step takes one fresh 80 MiB block per process (XLA's temporaries).
  g_cfg.reserve_bytes = ParseBytes("STRATA_ALLOC_RESERVE_BYTES", 2 * g_cfg.segment_bytes);
  g_cfg.reserve_delay_ms = ParseBytes("STRATA_ALLOC_RESERVE_DELAY_MS", 200);  // a plain number
  long pages = sysconf(_SC_PHYS_PAGES);
  g_cfg.max_request = pages > 0 ? static_cast<size_t>(pages) * 4096 : size_t{1} << 40;
  const char* off = getenv("STRATA_ALLOC_DISABLE");
  g_cfg.enabled = !(off && *off && *off != '0');
}

uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

bool Owned(const void* p) {
  if (!TableMaybeOwns(Addr(p))) return false;
  TableHit h;
  return TableFind(Addr(p), 0, &h);
}

// The pool path for a request of n >= the provisional threshold. nullptr: use libc.
PoolResult Large(size_t n, size_t align) {
  const Config* cfg = GetConfig();
  if (!cfg || !cfg->enabled || n < g_threshold.load(std::memory_order_relaxed)) return {nullptr, 0};
  int saved = errno;
  PoolResult r = PoolAlloc(n, align);
  errno = saved;
  return r;
}

bool Eligible(size_t n) {
  return __builtin_expect(n >= g_threshold.load(std::memory_order_relaxed), 0);
}

}  // namespace

const Config* GetConfig() {
  if (g_cfg_state.load(std::memory_order_acquire) == 2) return &g_cfg;
  if (!environ) return nullptr;  // too early in process start-up to read the environment
  int expected = 0;
  if (g_cfg_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    LoadConfig();  // getenv/sysconf: no allocation
    g_cfg_state.store(2, std::memory_order_release);
    g_threshold.store(g_cfg.enabled ? g_cfg.threshold : SIZE_MAX, std::memory_order_relaxed);
    return &g_cfg;
  }
  while (g_cfg_state.load(std::memory_order_acquire) != 2) sched_yield();
  return &g_cfg;
}

size_t CurrentThreshold() {
  const Config* cfg = GetConfig();
  return cfg && cfg->enabled ? g_threshold.load(std::memory_order_relaxed) : SIZE_MAX;
}

void* RealMalloc(size_t n) { return g_real.malloc(n); }
void RealFree(void* p) { g_real.free(p); }

void* ImplMalloc(size_t n) {
  if (__builtin_expect(g_resolve.load(std::memory_order_acquire) != 2, 0) && !Resolve())
    return BootAlloc(n);
  if (Eligible(n)) {
    if (void* p = Large(n, kMinAlign).ptr) return p;
  }
  CountLibcAlloc();
  return g_real.malloc(n);
}

void ImplFree(void* p) {
  if (!p || IsBoot(p)) return;
  if (Owned(p)) {
    PoolFree(p);
    return;
  }
  if (__builtin_expect(g_resolve.load(std::memory_order_acquire) != 2, 0) && !Resolve()) return;
  g_real.free(p);
}

namespace {

void* ImplCalloc(size_t n, size_t m) {
  size_t total;
  if (__builtin_mul_overflow(n, m, &total)) {
    errno = ENOMEM;
    return nullptr;
  }
  if (__builtin_expect(g_resolve.load(std::memory_order_acquire) != 2, 0) && !Resolve())
    return BootAlloc(total);
  if (Eligible(total)) {
    PoolResult r = Large(total, kMinAlign);
    if (r.ptr) {
      memset(r.ptr, 0, r.dirty);  // fresh memfd pages are already zero: not touched here
      return r.ptr;
    }
  }
  CountLibcAlloc();
  return g_real.calloc(n, m);
}

void* ImplRealloc(void* p, size_t n) {
  if (!p) return ImplMalloc(n);
  if (IsBoot(p)) {
    void* q = ImplMalloc(n);
    if (q) memcpy(q, p, BootSize(p) < n ? BootSize(p) : n);
    return q;
  }
  if (Owned(p)) {
    if (n == 0) {  // glibc semantics: free and return NULL
      PoolFree(p);
      return nullptr;
    }
    if (Eligible(n) && PoolResizeInPlace(p, n)) return p;
    size_t old = PoolUsableSize(p);
    void* q = ImplMalloc(n);  // below the threshold this moves the data back to libc
    if (!q) return nullptr;
    memcpy(q, p, old < n ? old : n);
    PoolFree(p);
    return q;
  }
  if (__builtin_expect(g_resolve.load(std::memory_order_acquire) != 2, 0) && !Resolve())
    return nullptr;
  if (Eligible(n)) {  // a libc block grown past the threshold moves into the pool
    PoolResult r = Large(n, kMinAlign);
    if (r.ptr) {
      size_t old = g_real.usable_size(p);
      memcpy(r.ptr, p, old < n ? old : n);
      g_real.free(p);
      return r.ptr;
    }
  }
  return g_real.realloc(p, n);
}

// Shared body of the aligned entry points. align: a power of two.
void* AlignedPool(size_t align, size_t n) {
  if (n == 0 || !Eligible(n)) return nullptr;
  return Large(n, align).ptr;
}

bool ReadyOrBoot() { return g_resolve.load(std::memory_order_acquire) == 2 || Resolve(); }

}  // namespace

int ImplPosixMemalign(void** out, size_t align, size_t n) {
  if (!IsPow2(align) || align % sizeof(void*) != 0) return EINVAL;
  if (!ReadyOrBoot()) {
    void* p = BootAlloc(n, align);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
  }
  if (void* p = AlignedPool(align, n)) {
    *out = p;
    return 0;
  }
  CountLibcAlloc();
  return g_real.posix_memalign(out, align, n);
}

void* ImplReallocOwned(void* p, size_t n) {
  if (p && (IsBoot(p) || Owned(p))) return ImplRealloc(p, n);
  if (__builtin_expect(g_resolve.load(std::memory_order_acquire) != 2, 0) && !Resolve())
    return nullptr;
  return g_real.realloc(p, n);  // libc memory stays libc memory (it may be freed elsewhere)
}

}  // namespace strata::alloc

using namespace strata::alloc;

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))

STRATA_EXPORT void* malloc(size_t n) noexcept { return ImplMalloc(n); }
STRATA_EXPORT void free(void* p) noexcept { ImplFree(p); }
STRATA_EXPORT void* calloc(size_t n, size_t m) noexcept { return ImplCalloc(n, m); }
STRATA_EXPORT void* realloc(void* p, size_t n) noexcept { return ImplRealloc(p, n); }

STRATA_EXPORT void* reallocarray(void* p, size_t n, size_t m) noexcept {
  size_t total;
  if (__builtin_mul_overflow(n, m, &total)) {
    errno = ENOMEM;
    return nullptr;
  }
  return ImplRealloc(p, total);
}

STRATA_EXPORT int posix_memalign(void** out, size_t align, size_t n) noexcept {
  return ImplPosixMemalign(out, align, n);
}

STRATA_EXPORT void* aligned_alloc(size_t align, size_t n) noexcept {
  if (!ReadyOrBoot()) return BootAlloc(n, align);
  if (IsPow2(align))
    if (void* p = AlignedPool(align, n)) return p;
  CountLibcAlloc();
  return g_real.aligned_alloc(align, n);
}

STRATA_EXPORT void* memalign(size_t align, size_t n) noexcept {
  if (!ReadyOrBoot()) return BootAlloc(n, align);
  if (align <= (size_t{1} << 40)) {
    size_t a =
        align <= 1 ? 1 : size_t{1} << (64 - __builtin_clzll(align - 1));  // glibc rounds up too
    if (void* p = AlignedPool(a, n)) return p;
  }
  CountLibcAlloc();
  return g_real.memalign(align, n);
}

STRATA_EXPORT void* valloc(size_t n) noexcept {
  if (!ReadyOrBoot()) return BootAlloc(n, 4096);
  if (void* p = AlignedPool(4096, n)) return p;
  CountLibcAlloc();
  return g_real.valloc(n);
}

STRATA_EXPORT void* pvalloc(size_t n) noexcept {
  if (!ReadyOrBoot()) return BootAlloc(AlignUp(n ? n : 1, 4096), 4096);
  if (n <= SIZE_MAX - 4096)
    if (void* p = AlignedPool(4096, AlignUp(n, 4096))) return p;
  CountLibcAlloc();
  return g_real.pvalloc(n);
}

STRATA_EXPORT size_t malloc_usable_size(void* p) noexcept {
  if (!p) return 0;
  if (IsBoot(p)) return BootSize(p);
  if (Owned(p)) return PoolUsableSize(p);
  if (!ReadyOrBoot()) return 0;
  return g_real.usable_size(p);
}

STRATA_EXPORT int strata_alloc_preloaded(void) {
  // 1 when the process-wide posix_memalign is this library's (LD_PRELOAD).
  void* global = dlsym(RTLD_DEFAULT, "posix_memalign");
  Dl_info theirs, ours;
  if (!global || !dladdr(global, &theirs) || !dladdr(reinterpret_cast<void*>(&ImplMalloc), &ours))
    return 0;
  return theirs.dli_fbase == ours.dli_fbase;
}

STRATA_EXPORT int strata_alloc_hooked(void) { return Hooked() ? 1 : 0; }

STRATA_EXPORT int strata_alloc_active(void) {
  // Live when the pool is on and serves someone: the whole process (LD_PRELOAD) or a library
  // whose allocation slots strata_alloc_hook rewrote.
  const Config* cfg = GetConfig();
  return cfg && cfg->enabled && (strata_alloc_preloaded() || Hooked());
}

STRATA_EXPORT size_t strata_alloc_set_threshold(size_t bytes) {
  const Config* cfg = GetConfig();
  if (!cfg || !cfg->enabled) return SIZE_MAX;
  const char* set = getenv("STRATA_ALLOC_THRESHOLD");
  if (set && *set) return g_threshold.load(std::memory_order_relaxed);  // the user's choice
  // Relaxed: each allocation reads the threshold once to pick pool or libc; blocks already
  // handed out keep their owner (free and realloc go by address, not size).
  g_threshold.store(bytes < kGranule ? kGranule : bytes, std::memory_order_relaxed);
  return g_threshold.load(std::memory_order_relaxed);
}
