// The pool: fabric segments (memfd, MAP_SHARED), blocks carved from them, the cache cap, and the
// background thread that announces segments to the fabric (registration-on-allocation).
//
// Structure:
//  - A Segment is one memfd mapping. Its Blocks tile it in address order (prev/next), each free or
//    allocated; free blocks also sit in a size-class bin (log2 of pages). Neighbouring free blocks
//    are always coalesced.
//  - Allocated blocks are found from the user pointer through PtrMap (open addressing, mmap'd).
//  - One mutex (g_mu) guards all of it. Syscalls that may be slow (memfd_create, mmap, munmap) run
//    outside it. Nothing under it calls malloc.
//  - Callbacks run on one background thread, started by the first callback installation (an
//    ordinary API call, never from inside malloc). Once it exists, segment releases are handed to
//    it so the freed-segment callback runs before munmap/close and never races an announcement of
//    the same fd.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "alloc/internal.h"
#include "alloc/meta.h"

namespace strata::alloc {

namespace {

struct Segment;

struct Block {
  uintptr_t start;
  size_t size;
  Block* prev;  // address order within the segment
  Block* next;
  Block* fprev;  // free-bin list
  Block* fnext;
  Segment* seg;
  int bin;
  bool free;
  bool resident;  // free block that may hold faulted-in pages (counted in g_free_resident)
};

struct Segment {
  uint64_t id;
  int fd;
  uintptr_t base;
  size_t size;
  size_t used;       // bytes in allocated blocks
  size_t dirty_end;  // offset high-water mark of anything ever handed out
  Block* first;
  Segment* lprev;  // live list
  Segment* lnext;
  Segment* pnext;          // pending-release list (background thread)
  uint64_t announced_gen;  // callback generation it was announced under (0: never)
  bool exportable;
};

constexpr int kBins = 48;

struct Released {  // a segment to unmap and close outside the lock
  uintptr_t base;
  size_t size;
  int fd;
};

// ---- all pool state; constant-initialised, guarded by g_mu ----
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_work_cv = PTHREAD_COND_INITIALIZER;  // background thread waits for work
pthread_cond_t g_idle_cv = PTHREAD_COND_INITIALIZER;  // flush / callback setters wait for a batch
MetaArena<Block> g_blocks;
MetaArena<Segment> g_segs;
PtrMap<Block> g_map;
Block* g_bins[kBins];
Segment* g_live;
Segment* g_pending;
size_t g_nsegs, g_seg_bytes, g_in_use, g_cached, g_nempty;
// The keep budget (strata_alloc_set_keep): free blocks that may hold faulted-in pages, at most
// g_keep bytes of them; past it a freed block's pages are returned (MADV_REMOVE on the shared
// mapping; the block stays in the pool, its next user faults pages in again, zero-filled).
size_t g_keep = SIZE_MAX, g_free_resident;
uint64_t g_trimmed_bytes;
uint64_t g_next_id = 1, g_pool_allocs, g_pool_frees, g_created, g_released, g_announced;
strata_seg_callback g_new_cb, g_free_cb;
void* g_new_user;
void* g_free_user;
uint64_t g_cb_gen;
bool g_bg_started, g_bg_busy;
pthread_t g_bg_thread;
// The reserve (strata_alloc_set_reserve): a thread of its own keeps at least g_reserve_target
// bytes in wholly free segments that it created and faulted in ahead of demand (the background
// thread announces them like any other), so that a malloc needing fresh memory neither creates a
// segment nor first-touches its pages on the caller's thread. g_empty_bytes: bytes in wholly free
// segments (g_nempty of them); g_reserve_inflight: bytes of the segment being made now.
pthread_cond_t g_reserve_cv = PTHREAD_COND_INITIALIZER;  // the reserve thread waits for a deficit
size_t g_reserve_target, g_empty_bytes, g_reserve_inflight;
bool g_reserve_started;
bool g_reserve_stopped;  // a refill failed: no more until the next strata_alloc_set_reserve
uint64_t g_reserve_made, g_reserve_populated, g_reserve_failures, g_on_demand;
std::atomic<bool> g_atfork_registered{false};

struct Lock {
  Lock() { pthread_mutex_lock(&g_mu); }
  ~Lock() { pthread_mutex_unlock(&g_mu); }
};

int BinOf(size_t size) {
  int b = 63 - __builtin_clzll(size / kGranule);
  return b < kBins ? b : kBins - 1;
}
void BinPush(Block* b) {
  b->bin = BinOf(b->size);
  b->fprev = nullptr;
  b->fnext = g_bins[b->bin];
  if (b->fnext) b->fnext->fprev = b;
  g_bins[b->bin] = b;
}
void BinPop(Block* b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    g_bins[b->bin] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = nullptr;
}

bool Fits(const Block* b, size_t req, size_t align) {
  uintptr_t a = AlignUp(b->start, align);
  return a + req <= b->start + b->size;
}

Block* FindFit(size_t req, size_t align) {
  int b0 = BinOf(req);
  Block* best = nullptr;
  for (Block* x = g_bins[b0]; x; x = x->fnext) {  // mixed sizes: best fit, exact fit at once
    if (!Fits(x, req, align)) continue;
    if (x->size == req) return x;
    if (!best || x->size < best->size) best = x;
  }
  if (best) return best;
  for (int i = b0 + 1; i < kBins; ++i)  // every block here is big enough unless align pads it
    for (Block* x = g_bins[i]; x; x = x->fnext)
      if (Fits(x, req, align)) return x;
  return nullptr;
}

// Reserve segments hold the whole target in one piece, so that one large request (XLA's CPU
// runtime asks for all temporaries of a program in one block: 80 MiB in the registration
// benchmark) fits; never smaller than a shared segment.
size_t ReserveSegmentBytes(const Config* cfg) {
  return g_reserve_target > cfg->segment_bytes ? g_reserve_target : cfg->segment_bytes;
}
// True when the reserve needs another segment (lock held): below its target, counting the one
// in the making, and room for one more under the cache cap (else the cap would trim it again).
bool ReserveShort() {
  if (!g_reserve_target || g_reserve_stopped || !g_reserve_started) return false;
  const Config* cfg = GetConfig();
  if (!cfg) return false;
  return g_empty_bytes + g_reserve_inflight < g_reserve_target &&
         g_cached + g_reserve_inflight + ReserveSegmentBytes(cfg) <= cfg->cache_cap;
}

// Splits a new free block [at, b end) off the tail of b and bins it. false if out of metadata.
bool SplitTail(Block* b, uintptr_t at) {
  Block* t = g_blocks.Get();
  if (!t) return false;
  t->start = at;
  t->size = b->start + b->size - at;
  t->seg = b->seg;
  t->free = true;
  t->resident = b->resident;
  t->prev = b;
  t->next = b->next;
  if (b->next) b->next->prev = t;
  b->next = t;
  b->size = at - b->start;
  BinPush(t);
  return true;
}

void Unlink(Block* b) {
  if (b->prev)
    b->prev->next = b->next;
  else
    b->seg->first = b->next;
  if (b->next) b->next->prev = b->prev;
}

// Free block a takes in its free next neighbour n (neither binned). The merged block is
// resident if either part is (over-counting a clean part's bytes).
void Absorb(Block* a, Block* n) {
  if (a->resident != n->resident) g_free_resident += a->resident ? n->size : a->size;
  a->resident = a->resident || n->resident;
  a->size += n->size;
  Unlink(n);
  g_blocks.Put(n);
}

// Frees b (already marked free, not binned): merges free neighbours, bins the result.
Block* Coalesce(Block* b) {
  if (b->prev && b->prev->free) {
    Block* p = b->prev;
    BinPop(p);
    Absorb(p, b);
    b = p;
  }
  if (b->next && b->next->free) {
    Block* n = b->next;
    BinPop(n);
    Absorb(b, n);
  }
  BinPush(b);
  return b;
}

// Carves [aligned start, +req) out of free block b; returns the allocated block or nullptr.
Block* Carve(Block* b, size_t req, size_t align) {
  if (!g_map.Reserve()) return nullptr;
  uintptr_t a = AlignUp(b->start, align);
  BinPop(b);
  if (a > b->start) {  // front padding becomes its own free block
    if (!SplitTail(b, a)) {
      BinPush(b);
      return nullptr;
    }
    Block* front = b;
    b = front->next;
    BinPop(b);
    BinPush(front);  // the shrunken front stays free
  }
  if (b->size - req >= kGranule) SplitTail(b, b->start + req);  // on failure keep the slack
  if (b->resident) g_free_resident -= b->size;
  b->resident = false;
  b->free = false;
  Segment* s = b->seg;
  if (s->used == 0) {
    --g_nempty;
    g_empty_bytes -= s->size;
    if (ReserveShort()) pthread_cond_signal(&g_reserve_cv);  // make the next one
  }
  s->used += b->size;
  g_in_use += b->size;
  g_cached -= b->size;
  g_map.Insert(b->start, b);
  ++g_pool_allocs;
  return b;
}

void LinkLive(Segment* s) {
  s->lprev = nullptr;
  s->lnext = g_live;
  if (g_live) g_live->lprev = s;
  g_live = s;
}
void UnlinkLive(Segment* s) {
  if (s->lprev)
    s->lprev->lnext = s->lnext;
  else
    g_live = s->lnext;
  if (s->lnext) s->lnext->lprev = s->lprev;
}

bool HasWork() {
  if (g_pending) return true;
  if (!g_new_cb) return false;
  for (Segment* s = g_live; s; s = s->lnext)
    if (s->exportable && s->announced_gen != g_cb_gen) return true;
  return false;
}

// Takes an empty segment out of the pool (lock held). Returns true if the caller must unmap `out`
// after unlocking; false if the background thread owns the release.
bool ReleaseSegment(Segment* s, Released* out) {
  Block* b = s->first;  // an empty segment is one free block
  BinPop(b);
  if (b->resident) g_free_resident -= b->size;
  g_blocks.Put(b);
  g_cached -= s->size;
  g_seg_bytes -= s->size;
  --g_nsegs;
  --g_nempty;
  g_empty_bytes -= s->size;
  ++g_released;
  TableRemove(s->base);
  UnlinkLive(s);
  if (g_bg_started) {
    s->pnext = g_pending;
    g_pending = s;
    pthread_cond_signal(&g_work_cv);
    return false;
  }
  *out = {s->base, s->size, s->fd};
  g_segs.Put(s);
  return true;
}

// Returns wholly free segments to the OS while the cache is over its cap (lock held). `hint` is
// tried first. Fills `out` (up to max) with segments to unmap after unlocking.
int TrimCache(Segment* hint, Released* out, int max, size_t cap) {
  int n = 0;
  if (hint && hint->used == 0 && g_cached > cap && n < max)
    if (ReleaseSegment(hint, &out[n])) ++n;
  for (Segment* s = g_live; s && g_cached > cap && g_nempty > 0 && n < max;) {
    Segment* next = s->lnext;
    if (s->used == 0 && ReleaseSegment(s, &out[n])) ++n;
    s = next;
  }
  return n;
}

void UnmapReleased(const Released* r, int n) {
  for (int i = 0; i < n; ++i) {
    munmap(reinterpret_cast<void*>(r[i].base), r[i].size);
    if (r[i].fd >= 0) close(r[i].fd);
  }
}

bool CreateSegment(size_t size, Released* out) {
  int fd = static_cast<int>(syscall(SYS_memfd_create, "strata_seg", MFD_CLOEXEC));
  if (fd < 0) return false;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return false;
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return false;
  }
  *out = {reinterpret_cast<uintptr_t>(base), size, fd};
  return true;
}

// Adds a freshly mapped segment to the pool (lock held). false (caller unmaps) if out of room.
bool AdoptSegment(const Released& r) {
  Segment* s = g_segs.Get();
  if (!s) return false;
  Block* b = g_blocks.Get();
  if (!b) {
    g_segs.Put(s);
    return false;
  }
  s->id = g_next_id++;
  if (!TableInsert(r.base, r.size, s->id, r.fd)) {
    g_blocks.Put(b);
    g_segs.Put(s);
    return false;
  }
  s->fd = r.fd;
  s->base = r.base;
  s->size = r.size;
  s->first = b;
  s->exportable = true;
  b->start = r.base;
  b->size = r.size;
  b->seg = s;
  b->free = true;
  b->resident = false;  // fresh memfd pages (the reserve's are faulted in, and kept on purpose)
  BinPush(b);
  LinkLive(s);
  ++g_nsegs;
  ++g_nempty;
  g_empty_bytes += r.size;
  ++g_created;
  g_seg_bytes += r.size;
  g_cached += r.size;
  if (g_new_cb) pthread_cond_signal(&g_work_cv);
  return true;
}

PoolResult Finish(Block* b, size_t size) {
  Segment* s = b->seg;
  size_t off = b->start - s->base;
  size_t dirty = s->dirty_end > off ? s->dirty_end - off : 0;
  if (dirty > size) dirty = size;
  if (off + b->size > s->dirty_end) s->dirty_end = off + b->size;
  return {reinterpret_cast<void*>(b->start), dirty};
}

// ---- fork: the child must not share pool memory with the parent ----
// MAP_SHARED pages would stay shared after fork, so parent and child would scribble on each other's
// buffers. In the child every segment is remapped MAP_PRIVATE from its memfd (copy-on-write, no
// copy now), its fd is closed and it stops being shareable; the child has no background thread.
void AtforkPrepare() { pthread_mutex_lock(&g_mu); }
void AtforkParent() { pthread_mutex_unlock(&g_mu); }
void AtforkChild() {
  for (Segment* s = g_live; s; s = s->lnext) {
    if (s->fd >= 0) {
      mmap(reinterpret_cast<void*>(s->base), s->size, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_FIXED, s->fd, 0);
      close(s->fd);
      s->fd = -1;
      TableSetFd(s->base, -1);
    }
    s->exportable = false;
  }
  while (Segment* s = g_pending) {
    g_pending = s->pnext;
    munmap(reinterpret_cast<void*>(s->base), s->size);
    if (s->fd >= 0) close(s->fd);
    g_segs.Put(s);
  }
  g_new_cb = g_free_cb = nullptr;
  g_bg_started = g_bg_busy = false;
  // A segment the parent's thread was making is not in the pool: the child simply never uses it.
  g_reserve_target = g_reserve_inflight = 0;
  g_reserve_started = false;
  pthread_cond_init(&g_reserve_cv, nullptr);
  pthread_cond_init(&g_work_cv, nullptr);
  pthread_cond_init(&g_idle_cv, nullptr);
  pthread_mutex_unlock(&g_mu);
}

__attribute__((constructor)) void RegisterAtfork() {
  if (!g_atfork_registered.exchange(true)) pthread_atfork(AtforkPrepare, AtforkParent, AtforkChild);
}

// ---- the background (registration) thread ----
// One round of announcements and releases (lock held on entry and on return; dropped while the
// callbacks run). false when there was nothing to do.
bool ServiceRound(Lock&) {
  constexpr int kBatch = 64;
  strata_seg_info announce[kBatch];
  strata_seg_info release[kBatch];
  bool release_cb[kBatch];
  Segment* release_seg[kBatch];
  int na = 0, nr = 0;
  strata_seg_callback new_cb = g_new_cb, free_cb = g_free_cb;
  void* new_user = g_new_user;
  void* free_user = g_free_user;
  if (new_cb) {
    for (Segment* s = g_live; s && na < kBatch; s = s->lnext) {
      if (!s->exportable || s->announced_gen == g_cb_gen) continue;
      s->announced_gen = g_cb_gen;
      announce[na++] = {s->id, s->fd, reinterpret_cast<void*>(s->base), s->size, 0};
    }
  }
  while (g_pending && nr < kBatch) {
    Segment* s = g_pending;
    g_pending = s->pnext;
    release[nr] = {s->id, s->fd, reinterpret_cast<void*>(s->base), s->size, 0};
    release_cb[nr] = free_cb && s->announced_gen != 0;
    release_seg[nr++] = s;
  }
  if (na == 0 && nr == 0) return false;
  g_bg_busy = true;
  g_announced += na;
  pthread_mutex_unlock(&g_mu);
  for (int i = 0; i < na; ++i) new_cb(&announce[i], new_user);
  for (int i = 0; i < nr; ++i) {
    if (release_cb[i]) free_cb(&release[i], free_user);
    munmap(release[i].base, release[i].size);
    if (release[i].fd >= 0) close(release[i].fd);
  }
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < nr; ++i) g_segs.Put(release_seg[i]);
  pthread_cond_broadcast(&g_idle_cv);
  return true;
}

// Faults in every page of a fresh segment (allocated and zeroed by the kernel here, so the
// thread that first writes a buffer there takes no page fault). MADV_POPULATE_WRITE (Linux
// 5.14) does it in one call; older kernels get a write per page (of zero: the pages are zero
// already, and no caller has the memory yet).
void Populate(uintptr_t base, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(reinterpret_cast<void*>(base), bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  for (size_t off = 0; off < bytes; off += kGranule)
    reinterpret_cast<volatile char*>(base)[off] = 0;
}

// Waits (lock held) until the reserve is short and the pool has been quiet (no allocation or
// free) for STRATA_ALLOC_RESERVE_DELAY_MS. false: the deficit ended (or the reserve was turned
// off). A loop of steps allocates and frees all the time, so refills wait for its pauses.
bool ShortAndQuiet() {
  const size_t ms = GetConfig()->reserve_delay_ms;
  while (ms) {
    const uint64_t activity = g_pool_allocs + g_pool_frees;
    timespec until;
    clock_gettime(CLOCK_REALTIME, &until);  // the condition variable's clock
    until.tv_sec += static_cast<time_t>(ms / 1000);
    until.tv_nsec += static_cast<long>(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec += 1;
      until.tv_nsec -= 1000000000L;
    }
    while (ReserveShort())
      if (pthread_cond_timedwait(&g_reserve_cv, &g_mu, &until) == ETIMEDOUT) break;
    if (!ReserveShort()) return false;
    if (g_pool_allocs + g_pool_frees == activity) break;
  }
  return ReserveShort();
}

// The reserve thread: makes a segment whenever the reserve is short, faults it in and hands it to
// the pool (AdoptSegment wakes the background thread, which announces it). The first fill runs
// at once and at normal priority (it happens at start-up, while the program compiles). Then the
// thread switches itself to SCHED_IDLE, so that refills use only CPU time nobody else wants, and
// refills only when the pool has been quiet for STRATA_ALLOC_RESERVE_DELAY_MS (default 200): a
// training loop that took the reserve in its first step is not slowed by refills between its
// steps (measured on 2 cores with refills right after the first step: the second step took
// 105-178 ms against on_use's 52-63 ms in the same runs), while memory that stays taken (host
// arrays, new parameters) is replaced in the next pause (the compilation before a first step).
void* ReserveMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  pthread_setname_np(pthread_self(), "strata_reserve");
  bool idle = false;
  Lock lock;
  for (;;) {
    while (!ReserveShort()) {
      if (!idle && g_reserve_target) {
        sched_param prio{};
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &prio);
        idle = true;
      }
      pthread_cond_wait(&g_reserve_cv, &g_mu);
    }
    if (idle && !ShortAndQuiet()) continue;
    const size_t size = ReserveSegmentBytes(GetConfig());
    g_reserve_inflight += size;
    pthread_mutex_unlock(&g_mu);
    Released r;
    bool ok = CreateSegment(size, &r);
    if (ok) Populate(r.base, size);
    pthread_mutex_lock(&g_mu);
    g_reserve_inflight -= size;
    if (ok && !AdoptSegment(r)) {
      pthread_mutex_unlock(&g_mu);
      UnmapReleased(&r, 1);
      pthread_mutex_lock(&g_mu);
      ok = false;
    }
    if (ok) {
      ++g_reserve_made;
      g_reserve_populated += size;
    } else {
      ++g_reserve_failures;
      g_reserve_stopped = true;  // out of memory or fds: callers create segments themselves
    }
  }
  return nullptr;
}

void* BackgroundMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);  // process signals belong to the application
  // Named for top -H, perf and /proc/PID/task (benchmarks/registration.py counts its faults).
  pthread_setname_np(pthread_self(), "strata_alloc");
  Lock lock;
  g_bg_thread = pthread_self();
  for (;;) {
    if (ServiceRound(lock)) continue;
    g_bg_busy = false;
    pthread_cond_broadcast(&g_idle_cv);
    pthread_cond_wait(&g_work_cv, &g_mu);
  }
  return nullptr;
}

bool OnBackgroundThread() { return g_bg_started && pthread_equal(pthread_self(), g_bg_thread); }

// Runs fn on a new detached thread (never joined); pthread_create's error, or 0.
int StartDetached(void* (*fn)(void*)) {
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  const int rc = pthread_create(&t, &attr, fn, nullptr);
  pthread_attr_destroy(&attr);
  return rc;
}

void EnsureBackgroundThread() {
  {
    Lock lock;
    if (g_bg_started) return;
    g_bg_started = true;  // before the thread exists: releases from now on are deferred to it
    g_bg_busy = true;
  }
  if (StartDetached(BackgroundMain) != 0) Fatal("cannot start the registration thread");
}

void SetCallback(bool is_new, strata_seg_callback cb, void* user) {
  if (cb) EnsureBackgroundThread();
  Lock lock;
  if (is_new) {
    g_new_cb = cb;
    g_new_user = user;
    ++g_cb_gen;  // every live segment is announced again to the new callback
  } else {
    g_free_cb = cb;
    g_free_user = user;
  }
  if (!g_bg_started) return;
  pthread_cond_signal(&g_work_cv);
  // The batch in flight may still be using the old callback: wait it out.
  if (!OnBackgroundThread())
    while (g_bg_busy) pthread_cond_wait(&g_idle_cv, &g_mu);
}

// Returns the pages of free block b to the OS (lock held: no allocation can take b meanwhile).
// MADV_REMOVE frees a shared mapping's backing pages (here, and in every peer that maps the
// segment); the block keeps its place and its next user gets zero-filled pages.
void ReturnPages(Block* b) {
  const uintptr_t lo = AlignUp(b->start, kGranule);
  const uintptr_t hi = (b->start + b->size) & ~(uintptr_t{kGranule} - 1);
  if (!b->resident || hi <= lo) return;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_REMOVE) != 0) return;
  b->resident = false;
  g_free_resident -= b->size;
  g_trimmed_bytes += hi - lo;
}

}  // namespace

// ---- pool operations used by interpose.cc ----

PoolResult PoolAlloc(size_t size, size_t align) {
  const Config* cfg = GetConfig();
  if (!cfg || !cfg->enabled || size > cfg->max_request) return {nullptr, 0};
  if (align < kMinAlign) align = kMinAlign;
  size_t req = AlignUp(size, kGranule);
  {
    Lock lock;
    if (Block* b = FindFit(req, align)) {
      if (Block* got = Carve(b, req, align)) return Finish(got, size);
      return {nullptr, 0};
    }
  }
  // No room: map a new segment outside the lock, then add it and carve from it under one lock
  // hold. (Adding, unlocking and retrying let a concurrent free under a small cache cap release
  // the still-empty new segment first, and this request fell back to libc: 16% of runs of
  // alloc_check's callback case with STRATA_ALLOC_CACHE_BYTES=0.)
  size_t need = req + (align > kGranule ? align : 0);
  size_t seg = need > cfg->segment_bytes / 4 ? AlignUp(need, kLargeRound) : cfg->segment_bytes;
  Released r;
  if (!CreateSegment(seg, &r)) return {nullptr, 0};
  {
    Lock lock;
    if (AdoptSegment(r)) {
      ++g_on_demand;
      // Another thread may have freed room meanwhile; then the new segment stays cached.
      if (Block* b = FindFit(req, align))
        if (Block* got = Carve(b, req, align)) return Finish(got, size);
      return {nullptr, 0};
    }
  }
  UnmapReleased(&r, 1);
  return {nullptr, 0};
}

void PoolFree(void* p) {
  const Config* cfg = GetConfig();
  Released rel[8];
  int nrel = 0;
  {
    Lock lock;
    Block* b = g_map.Find(reinterpret_cast<uintptr_t>(p));
    if (!b) Fatal("free(): invalid pointer or double free of a pool block");
    g_map.Erase(b->start);
    Segment* s = b->seg;
    b->free = true;
    b->resident = true;
    g_free_resident += b->size;
    s->used -= b->size;
    g_in_use -= b->size;
    g_cached += b->size;
    ++g_pool_frees;
    b = Coalesce(b);
    if (g_free_resident > g_keep) ReturnPages(b);
    if (s->used == 0) {
      ++g_nempty;
      g_empty_bytes += s->size;
    }
    size_t cap = cfg ? cfg->cache_cap : 0;
    if (g_cached > cap && g_nempty > 0) nrel = TrimCache(s, rel, 8, cap);
  }
  UnmapReleased(rel, nrel);
}

size_t PoolUsableSize(const void* p) {
  Lock lock;
  Block* b = g_map.Find(reinterpret_cast<uintptr_t>(p));
  return b ? b->size : 0;
}

bool PoolResizeInPlace(void* p, size_t n) {
  size_t req = AlignUp(n, kGranule);
  Lock lock;
  Block* b = g_map.Find(reinterpret_cast<uintptr_t>(p));
  if (!b) Fatal("realloc(): invalid pointer to a pool block");
  Segment* s = b->seg;
  if (req > b->size) {  // grow into a free right neighbour
    Block* nx = b->next;
    if (!nx || !nx->free || b->size + nx->size < req) return false;
    size_t take = req - b->size;
    BinPop(nx);
    if (nx->size - take >= kGranule) {
      nx->start += take;
      nx->size -= take;
      BinPush(nx);
    } else {
      take = nx->size;
      Unlink(nx);
      g_blocks.Put(nx);
    }
    b->size += take;
    s->used += take;
    g_in_use += take;
    g_cached -= take;
    size_t end = b->start + b->size - s->base;
    if (end > s->dirty_end) s->dirty_end = end;
    return true;
  }
  if (b->size - req >= kGranule) {  // shrink: give the tail back
    size_t give = b->size - req;
    if (SplitTail(b, b->start + req)) {
      Block* t = b->next;
      BinPop(t);
      s->used -= give;
      g_in_use -= give;
      g_cached += give;
      Coalesce(t);
    }
  }
  return true;
}

}  // namespace strata::alloc

// ---- the C API ----
using namespace strata::alloc;

extern "C" {

STRATA_ALLOC_API int strata_alloc_lookup(const void* p, size_t len, strata_seg_info* out) {
  TableHit h;
  if (!TableFind(reinterpret_cast<uintptr_t>(p), len, &h) || h.fd < 0) return 0;
  if (out)
    *out = {h.id, h.fd, reinterpret_cast<void*>(h.base), h.size,
            reinterpret_cast<uintptr_t>(p) - h.base};
  return 1;
}

STRATA_ALLOC_API void strata_alloc_set_new_segment_callback(strata_seg_callback cb, void* user) {
  SetCallback(true, cb, user);
}

STRATA_ALLOC_API void strata_alloc_set_free_segment_callback(strata_seg_callback cb, void* user) {
  SetCallback(false, cb, user);
}

STRATA_ALLOC_API void strata_alloc_flush(void) {
  Lock lock;
  if (!g_bg_started || OnBackgroundThread()) return;
  while (g_bg_busy || HasWork()) {
    pthread_cond_signal(&g_work_cv);
    pthread_cond_wait(&g_idle_cv, &g_mu);
  }
}

STRATA_ALLOC_API size_t strata_alloc_set_reserve(size_t bytes) {
  const Config* cfg = GetConfig();
  // Not the process's allocator (dlopen'ed, not preloaded): nobody would use the reserve.
  if (!cfg || !cfg->enabled || !strata_alloc_active()) return 0;
  if (bytes == SIZE_MAX) bytes = cfg->reserve_bytes;
  // Whole segments, at most half the cache cap (past the cap, frees would trim the reserve).
  const size_t seg = cfg->segment_bytes;
  size_t n = bytes / seg + (bytes % seg != 0);
  if (n > cfg->cache_cap / 2 / seg) n = cfg->cache_cap / 2 / seg;
  bytes = n * seg;
  bool start = false;
  {
    Lock lock;
    g_reserve_target = bytes;
    g_reserve_stopped = false;
    if (bytes && !g_reserve_started) start = g_reserve_started = true;
    pthread_cond_signal(&g_reserve_cv);
  }
  if (start && StartDetached(ReserveMain) != 0) {  // outside the lock: pthread_create may allocate
    Lock lock;
    g_reserve_started = false;
    return 0;
  }
  return bytes;
}

STRATA_ALLOC_API size_t strata_alloc_set_keep(size_t bytes) {
  Lock lock;
  g_keep = bytes;
  return g_free_resident;
}

STRATA_ALLOC_API void strata_alloc_keep_stats(uint64_t* keep, uint64_t* free_resident,
                                              uint64_t* returned) {
  Lock lock;
  *keep = g_keep == SIZE_MAX ? UINT64_MAX : g_keep;
  *free_resident = g_free_resident;
  *returned = g_trimmed_bytes;
}

STRATA_ALLOC_API void strata_alloc_reserve_stats(strata_alloc_reserve_t* out) {
  Lock lock;
  out->target_bytes = g_reserve_target;
  out->empty_bytes = g_empty_bytes;
  out->segments_made = g_reserve_made;
  out->bytes_populated = g_reserve_populated;
  out->failures = g_reserve_failures;
  out->segments_on_demand = g_on_demand;
}

STRATA_ALLOC_API void strata_alloc_stats(strata_alloc_stats_t* out) {
  const Config* cfg = GetConfig();
  Lock lock;
  out->segments = g_nsegs;
  out->segment_bytes = g_seg_bytes;
  out->bytes_in_use = g_in_use;
  out->bytes_cached = g_cached;
  out->pool_allocs = g_pool_allocs;
  out->pool_frees = g_pool_frees;
  out->libc_allocs = LibcAllocCount();
  out->segments_created = g_created;
  out->segments_released = g_released;
  out->segments_announced = g_announced;
  out->threshold = cfg && cfg->enabled ? CurrentThreshold() : UINT64_MAX;
  out->cache_cap = cfg ? cfg->cache_cap : 0;
}

STRATA_ALLOC_API int strata_alloc_check(void) {
  Lock lock;
  size_t nsegs = 0, seg_bytes = 0, in_use = 0, cached = 0, nempty = 0, nfree = 0, nalloc = 0;
  for (Segment* s = g_live; s; s = s->lnext) {
    ++nsegs;
    seg_bytes += s->size;
    uintptr_t at = s->base;
    size_t used = 0;
    bool prev_free = false;
    for (Block* b = s->first; b; b = b->next) {
      if (b->seg != s || b->start != at || b->size == 0 || b->size % kGranule) return 1;
      if (b->next && b->next->prev != b) return 2;
      if (b->free) {
        if (prev_free) return 3;  // two free neighbours: coalescing missed
        ++nfree;
        cached += b->size;
      } else {
        if (g_map.Find(b->start) != b) return 4;
        ++nalloc;
        used += b->size;
      }
      prev_free = b->free;
      at += b->size;
    }
    if (at != s->base + s->size) return 5;  // blocks do not tile the segment
    if (used != s->used) return 6;
    if (used == 0) ++nempty;
    in_use += used;
    TableHit h;
    if (!TableFind(s->base, s->size, &h) || h.base != s->base || h.size != s->size || h.id != s->id)
      return 7;
  }
  size_t binned = 0;
  for (int i = 0; i < kBins; ++i)
    for (Block* b = g_bins[i]; b; b = b->fnext) {
      if (!b->free || b->bin != i || BinOf(b->size) != i) return 8;
      if (b->fnext && b->fnext->fprev != b) return 9;
      ++binned;
    }
  if (binned != nfree) return 10;
  if (nalloc != g_map.count) return 11;
  if (nsegs != g_nsegs || seg_bytes != g_seg_bytes || in_use != g_in_use || cached != g_cached ||
      nempty != g_nempty)
    return 12;
  size_t empty_bytes = 0;
  for (Segment* s = g_live; s; s = s->lnext)
    if (s->used == 0) empty_bytes += s->size;
  if (empty_bytes != g_empty_bytes) return 13;
  return 0;
}

STRATA_ALLOC_API int strata_alloc_abi_version(void) { return STRATA_ALLOC_ABI_VERSION; }

}  // extern "C"
