/* Checks for libstrata_alloc.so, run under LD_PRELOAD by tests/test_alloc.py:
 *   alloc_check <case>     exits 0 and prints "ok <case>" on success, aborts with a message otherwise.
 * The allocator's API is found with dlsym(RTLD_DEFAULT), as the rest of strata finds it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc/strata_alloc.h"

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
      abort();                                                                   \
    }                                                                            \
  } while (0)

#define MiB ((size_t)1 << 20)

static strata_alloc_lookup_fn lookup_fn;
static void (*stats_fn)(strata_alloc_stats_t*);
static void (*set_new_cb)(strata_seg_callback, void*);
static void (*set_free_cb)(strata_seg_callback, void*);
static void (*flush_fn)(void);
static int (*active_fn)(void);
static int (*check_fn)(void);
static size_t (*set_reserve_fn)(size_t);
static void (*reserve_stats_fn)(strata_alloc_reserve_t*);

extern void* __libc_malloc(size_t);

static void load_api(void) {
  lookup_fn = (strata_alloc_lookup_fn)dlsym(RTLD_DEFAULT, "strata_alloc_lookup");
  stats_fn = (void (*)(strata_alloc_stats_t*))dlsym(RTLD_DEFAULT, "strata_alloc_stats");
  set_new_cb = (void (*)(strata_seg_callback, void*))dlsym(RTLD_DEFAULT,
                                                           "strata_alloc_set_new_segment_callback");
  set_free_cb = (void (*)(strata_seg_callback, void*))dlsym(RTLD_DEFAULT,
                                                            "strata_alloc_set_free_segment_callback");
  flush_fn = (void (*)(void))dlsym(RTLD_DEFAULT, "strata_alloc_flush");
  active_fn = (int (*)(void))dlsym(RTLD_DEFAULT, "strata_alloc_active");
  check_fn = (int (*)(void))dlsym(RTLD_DEFAULT, "strata_alloc_check");
  set_reserve_fn = (size_t (*)(size_t))dlsym(RTLD_DEFAULT, "strata_alloc_set_reserve");
  reserve_stats_fn =
      (void (*)(strata_alloc_reserve_t*))dlsym(RTLD_DEFAULT, "strata_alloc_reserve_stats");
  CHECK(set_reserve_fn && reserve_stats_fn);
  CHECK(check_fn && lookup_fn && stats_fn && set_new_cb && set_free_cb && flush_fn && active_fn);
}

static int in_pool(const void* p, size_t len) {
  strata_seg_info info;
  return lookup_fn(p, len, &info);
}

static strata_alloc_stats_t stats(void) {
  strata_alloc_stats_t s;
  stats_fn(&s);
  return s;
}

static void fill(unsigned char* p, size_t n, unsigned seed) {
  for (size_t i = 0; i + 1 < n; i += 512) p[i] = (unsigned char)(seed + i / 512);
  if (n) p[n - 1] = (unsigned char)(seed * 7);
}
static int check_fill(const unsigned char* p, size_t n, unsigned seed) {
  for (size_t i = 0; i + 1 < n; i += 512)
    if (p[i] != (unsigned char)(seed + i / 512)) return 0;
  return !n || p[n - 1] == (unsigned char)(seed * 7);
}

/* ---- cases ---- */

static void case_active(void) { CHECK(active_fn() == 1); }

static void case_align(void) {
  size_t sizes[] = {1 * MiB, 1 * MiB + 1, 3 * MiB + 123, 20 * MiB + 7, 4096, 100};
  for (size_t a = 8; a <= 4 * MiB; a *= 2) {
    for (unsigned k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k) {
      size_t n = sizes[k];
      void* p = NULL;
      CHECK(posix_memalign(&p, a, n) == 0);
      CHECK(((uintptr_t)p % a) == 0);
      CHECK(((uintptr_t)p % 16) == 0);
      CHECK(in_pool(p, n) == (n >= MiB));
      if (n >= MiB) CHECK(((uintptr_t)p % 64) == 0);
      CHECK(malloc_usable_size(p) >= n);
      fill(p, n, (unsigned)(a + k));
      void* q = aligned_alloc(a, n);
      CHECK(q && ((uintptr_t)q % a) == 0);
      void* r = memalign(a, n);
      CHECK(r && ((uintptr_t)r % a) == 0);
      memset(q, 1, n);
      memset(r, 2, n);
      CHECK(check_fill(p, n, (unsigned)(a + k)));
      free(p);
      free(q);
      free(r);
    }
  }
  void* v = valloc(2 * MiB);
  CHECK(v && ((uintptr_t)v % 4096) == 0 && in_pool(v, 2 * MiB));
  void* pv = pvalloc(2 * MiB - 5);
  CHECK(pv && ((uintptr_t)pv % 4096) == 0 && malloc_usable_size(pv) >= 2 * MiB);
  free(v);
  free(pv);
  void* m = malloc(5 * MiB);
  CHECK(m && ((uintptr_t)m % 64) == 0 && in_pool(m, 5 * MiB));
  free(m);
  void* bad = NULL;
  CHECK(posix_memalign(&bad, 24, 2 * MiB) == EINVAL);
  CHECK(posix_memalign(&bad, 0, 2 * MiB) == EINVAL);
}

static void case_realloc(void) {
  /* pool -> bigger pool (maybe in place), content kept */
  unsigned char* p = malloc(2 * MiB);
  CHECK(in_pool(p, 2 * MiB));
  fill(p, 2 * MiB, 11);
  p = realloc(p, 9 * MiB);
  CHECK(p && in_pool(p, 9 * MiB) && check_fill(p, 2 * MiB, 11));
  fill(p, 9 * MiB, 12);
  /* pool -> smaller pool */
  p = realloc(p, 3 * MiB);
  CHECK(p && in_pool(p, 3 * MiB));
  for (size_t i = 0; i < 3 * MiB; i += 512) CHECK(p[i] == (unsigned char)(12 + i / 512));
  /* pool -> below the threshold: moves to libc */
  p = realloc(p, 1000);
  CHECK(p && !in_pool(p, 1));
  for (size_t i = 0; i < 1000; i += 512) CHECK(p[i] == (unsigned char)(12 + i / 512));
  /* libc -> pool */
  unsigned char* q = malloc(50000);
  CHECK(q && !in_pool(q, 1));
  fill(q, 50000, 13);
  q = realloc(q, 4 * MiB);
  CHECK(q && in_pool(q, 4 * MiB) && q[0] == 13 && q[49999] == (unsigned char)(13 * 7));
  /* libc -> libc */
  unsigned char* r = malloc(100);
  memset(r, 7, 100);
  r = realloc(r, 5000);
  CHECK(r && !in_pool(r, 1) && r[99] == 7);
  /* NULL and zero */
  unsigned char* n = realloc(NULL, 2 * MiB);
  CHECK(n && in_pool(n, 2 * MiB));
  CHECK(realloc(n, 0) == NULL);
  unsigned char* g = reallocarray(NULL, 3, MiB);
  CHECK(g && in_pool(g, 3 * MiB));
  CHECK(reallocarray(g, SIZE_MAX / 2, 4) == NULL && errno == ENOMEM);
  free(g);
  free(p);
  free(q);
  free(r);
  /* grow in place into a free neighbour: allocate two adjacent blocks, free the second */
  unsigned char* a = malloc(2 * MiB);
  unsigned char* b = malloc(2 * MiB);
  fill(a, 2 * MiB, 14);
  free(b);
  unsigned char* a2 = realloc(a, 4 * MiB);
  CHECK(a2 && check_fill(a2, 2 * MiB, 14));
  free(a2);
}

/* Many threads allocating, filling, checking and freeing at once. */
#define NTHREADS 8
#define LIVE 12
static void* worker(void* arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  unsigned char* live[LIVE] = {0};
  size_t sizes[LIVE] = {0};
  unsigned tags[LIVE] = {0};
  for (int it = 0; it < 1500; ++it) {
    if (it % 100 == 0) CHECK(check_fn() == 0);
    seed = seed * 1103515245u + 12345u;
    int slot = (int)((seed >> 8) % LIVE);
    if (live[slot]) {
      CHECK(check_fill(live[slot], sizes[slot], tags[slot]));
      if ((seed >> 20) % 4 == 0) {  /* resize instead of free */
        size_t nn = sizes[slot] / 2 + 4096;
        unsigned char* np = realloc(live[slot], nn);
        CHECK(np);
        size_t keep = nn < sizes[slot] ? nn : sizes[slot];
        for (size_t i = 0; i + 1 < keep; i += 512) CHECK(np[i] == (unsigned char)(tags[slot] + i / 512));
        free(np);
      } else {
        free(live[slot]);
      }
      live[slot] = NULL;
    } else {
      size_t choice = (seed >> 12) % 5;
      size_t n = choice == 0 ? 700 + (seed >> 16) % 5000
               : choice == 1 ? MiB + (seed >> 10) % (3 * MiB)
               : choice == 2 ? 24 * MiB + (seed >> 16) % 4096
               : (seed >> 8) % (2 * MiB) + 64;
      unsigned char* p;
      if (choice == 3) {
        p = calloc(1, n);
        CHECK(p);
        for (size_t i = 0; i < n; i += 4096) CHECK(p[i] == 0);
        CHECK(p[n - 1] == 0);
      } else if (choice == 4) {
        void* v = NULL;
        CHECK(posix_memalign(&v, 64, n) == 0);
        p = v;
      } else {
        p = malloc(n);
      }
      CHECK(p);
      sizes[slot] = n;
      tags[slot] = seed;
      fill(p, n, seed);
      live[slot] = p;
    }
  }
  for (int i = 0; i < LIVE; ++i) {
    if (live[i]) CHECK(check_fill(live[i], sizes[i], tags[i]));
    free(live[i]);
  }
  return NULL;
}

static void case_threads(void) {
  pthread_t t[NTHREADS];
  strata_alloc_stats_t s0 = stats();
  for (uintptr_t i = 0; i < NTHREADS; ++i) CHECK(pthread_create(&t[i], NULL, worker, (void*)(i + 1)) == 0);
  for (int i = 0; i < NTHREADS; ++i) pthread_join(t[i], NULL);
  strata_alloc_stats_t s = stats();
  /* the threads' own blocks are all back (libc may keep a few of its own big buffers) */
  CHECK(s.bytes_in_use == s0.bytes_in_use);
  CHECK(s.pool_allocs - s0.pool_allocs > 1000);
  CHECK(s.pool_allocs - s.pool_frees == s0.pool_allocs - s0.pool_frees);
  CHECK(s.bytes_cached + s.bytes_in_use == s.segment_bytes);
}

static void case_sizes(void) {
  void* z = malloc(0);
  free(z);
  void* zp = NULL;
  CHECK(posix_memalign(&zp, 64, 0) == 0);
  free(zp);
  free(NULL);
  errno = 0;
  CHECK(malloc(SIZE_MAX) == NULL && errno == ENOMEM);
  CHECK(malloc(SIZE_MAX - 4096) == NULL);
  CHECK(malloc((size_t)1 << 62) == NULL);
  void* h = NULL;
  CHECK(posix_memalign(&h, 4096, (size_t)1 << 62) == ENOMEM);
  CHECK(calloc(SIZE_MAX / 2, 3) == NULL && errno == ENOMEM);
  /* a big one: its own segment, pages touched sparsely */
  size_t big = 300 * MiB + 5;
  unsigned char* b = malloc(big);
  CHECK(b && in_pool(b, big));
  for (size_t i = 0; i < big; i += 8 * MiB) b[i] = 1;
  b[big - 1] = 2;
  strata_seg_info info;
  CHECK(lookup_fn(b, big, &info) && info.offset == 0 && info.size >= big && info.size % (2 * MiB) == 0);
  free(b);
  /* calloc must return zeros even from a reused (dirty) block */
  unsigned char* d = malloc(6 * MiB);
  memset(d, 0xAB, 6 * MiB);
  free(d);
  unsigned char* c = calloc(6, MiB);
  CHECK(in_pool(c, 6 * MiB));
  for (size_t i = 0; i < 6 * MiB; i += 64) CHECK(c[i] == 0);
  free(c);
}

static void case_foreign(void) {
  /* libc pointers (made by libc behind our back) go back to libc */
  void* a = __libc_malloc(2 * MiB);
  CHECK(a && !in_pool(a, 1));
  free(a);
  void* b = __libc_malloc(64);
  CHECK(malloc_usable_size(b) >= 64);
  free(b);
  /* small requests are libc's */
  char* s = malloc(1000);
  CHECK(!in_pool(s, 1));
  free(s);
  /* memory that is nobody's heap */
  int local = 0;
  CHECK(!in_pool(&local, sizeof(local)));
  void* m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(!in_pool(m, 1));
  munmap(m, 4096);
  strata_alloc_stats_t st = stats();
  CHECK(st.libc_allocs >= 1);
}

static void case_cache(void) {
  /* run with STRATA_ALLOC_CACHE_BYTES=64M: 6 x 40 MiB dedicated segments, all freed */
  void* p[6];
  for (int i = 0; i < 6; ++i) {
    p[i] = malloc(40 * MiB);
    CHECK(in_pool(p[i], 40 * MiB));
    memset(p[i], i, 40 * MiB);
  }
  strata_alloc_stats_t s0 = stats();
  CHECK(s0.segments >= 6 && s0.bytes_in_use >= 240 * MiB);
  for (int i = 0; i < 6; ++i) free(p[i]);
  strata_alloc_stats_t s1 = stats();
  CHECK(s1.bytes_in_use == 0);
  CHECK(s1.segments_released >= 5);
  CHECK(s1.bytes_cached <= 64 * MiB + 40 * MiB);
  CHECK(s1.segment_bytes == s1.bytes_cached);
  printf("cache: segments %llu cached %llu released %llu\n", (unsigned long long)s1.segments,
         (unsigned long long)s1.bytes_cached, (unsigned long long)s1.segments_released);
}

static void case_cache_zero(void) {
  /* STRATA_ALLOC_CACHE_BYTES=0: everything goes back to the OS at once */
  void* p = malloc(3 * MiB);
  void* q = malloc(50 * MiB);
  free(p);
  free(q);
  strata_alloc_stats_t s = stats();
  fprintf(stderr, "segments %llu bytes %llu cached %llu released %llu\n", (unsigned long long)s.segments,
         (unsigned long long)s.segment_bytes, (unsigned long long)s.bytes_cached,
         (unsigned long long)s.segments_released);
  CHECK(s.segments == 0 && s.segment_bytes == 0 && s.bytes_cached == 0 && s.segments_released >= 1);
}

static void case_reuse(void) {
  /* default cap: freed blocks are reused, no new segment */
  void* p = malloc(8 * MiB);
  free(p);
  strata_alloc_stats_t s0 = stats();
  for (int i = 0; i < 50; ++i) {
    void* q = malloc(8 * MiB);
    CHECK(q == p);
    free(q);
  }
  strata_alloc_stats_t s1 = stats();
  CHECK(s1.segments_created == s0.segments_created);
  /* coalescing: 8 x 8 MiB blocks of one 64 MiB segment, freed, give one 64 MiB block back */
  void* b[8];
  for (int i = 0; i < 8; ++i) b[i] = malloc(8 * MiB);
  for (int i = 0; i < 8; i += 2) free(b[i]);
  for (int i = 1; i < 8; i += 2) free(b[i]);
  void* whole = malloc(16 * MiB);  /* fits in the coalesced space: still no new segment */
  strata_alloc_stats_t s2 = stats();
  CHECK(s2.segments_created == s1.segments_created);
  free(whole);
}

static void case_lookup(void) {
  unsigned char* p = malloc(3 * MiB);
  strata_seg_info info;
  CHECK(lookup_fn(p, 3 * MiB, &info) == 1);
  CHECK(info.segment_id >= 1 && info.fd >= 0 && info.size >= 3 * MiB);
  CHECK((unsigned char*)info.base + info.offset == p);
  CHECK(lookup_fn(p + 100, 5, &info) == 1 && (unsigned char*)info.base + info.offset == p + 100);
  /* a range running past the segment end is not inside one segment */
  CHECK(lookup_fn((unsigned char*)info.base + info.size - 8, 16, &info) == 0);
  CHECK(lookup_fn(p, 3 * MiB, &info) == 1);
  /* the fd really is the memory: a second mapping sees our writes */
  memset(p, 0x5A, 3 * MiB);
  unsigned char* view = mmap(NULL, info.size, PROT_READ, MAP_SHARED, info.fd, 0);
  CHECK(view != MAP_FAILED);
  CHECK(view[info.offset] == 0x5A && view[info.offset + 3 * MiB - 1] == 0x5A);
  munmap(view, info.size);
  char* small = malloc(100);
  CHECK(lookup_fn(small, 1, &info) == 0);
  free(small);
  free(p);
  /* two allocations in different segments get different ids */
  void* x = malloc(40 * MiB);
  void* y = malloc(40 * MiB);
  strata_seg_info ix, iy;
  CHECK(lookup_fn(x, 1, &ix) && lookup_fn(y, 1, &iy) && ix.segment_id != iy.segment_id);
  free(x);
  free(y);
}

/* Callbacks: record what the background thread reports. */
#define MAXSEEN 256
static uint64_t seen_new[MAXSEEN], seen_free[MAXSEEN];
static int n_new, n_free;
static pthread_t main_thread;
static int on_main;
static void on_new(const strata_seg_info* info, void* user) {
  CHECK(user == (void*)0x1234);
  CHECK(info->fd >= 0 && info->size > 0 && info->offset == 0);
  if (pthread_equal(pthread_self(), main_thread)) on_main = 1;
  void* scratch = malloc(2 * MiB);  /* callbacks may allocate */
  free(scratch);
  if (n_new < MAXSEEN) seen_new[n_new++] = info->segment_id;
}
static void on_free(const strata_seg_info* info, void* user) {
  CHECK(user == (void*)0x5678);
  if (n_free < MAXSEEN) seen_free[n_free++] = info->segment_id;
}
static int contains(const uint64_t* a, int n, uint64_t v) {
  for (int i = 0; i < n; ++i)
    if (a[i] == v) return 1;
  return 0;
}

static void case_callback(void) {
  /* run with STRATA_ALLOC_CACHE_BYTES=0 so frees release segments */
  main_thread = pthread_self();
  strata_seg_info i1, i2, i3;
  void* a = malloc(2 * MiB);  /* made before the "fabric" connects */
  void* b = malloc(70 * MiB);  /* larger than a shared segment: a segment of its own */
  CHECK(lookup_fn(a, 1, &i1) && lookup_fn(b, 1, &i2) && i1.segment_id != i2.segment_id);
  set_free_cb(on_free, (void*)0x5678);
  set_new_cb(on_new, (void*)0x1234);
  flush_fn();
  CHECK(contains(seen_new, n_new, i1.segment_id) && contains(seen_new, n_new, i2.segment_id));
  CHECK(!on_main);
  void* c = malloc(80 * MiB);  /* made after */
  CHECK(lookup_fn(c, 1, &i3) && i3.segment_id > i2.segment_id);
  flush_fn();
  CHECK(contains(seen_new, n_new, i3.segment_id));
  free(b);  /* released (cap 0): freed callback, then unmap */
  flush_fn();
  CHECK(contains(seen_free, n_free, i2.segment_id));
  CHECK(!contains(seen_free, n_free, i1.segment_id));
  /* removing the callback: nothing more is announced */
  set_new_cb(NULL, NULL);
  int before = n_new;
  void* d = malloc(90 * MiB);
  flush_fn();
  CHECK(n_new == before);
  free(a);
  free(c);
  free(d);
  flush_fn();
  strata_alloc_stats_t s = stats();
  CHECK(s.segments == 0);
}

/* The reserve: run with STRATA_ALLOC_SEGMENT_BYTES=4M STRATA_ALLOC_RESERVE_BYTES=8M
 * STRATA_ALLOC_CACHE_BYTES=24M (and the default refill delay: 200 ms of a quiet pool). */
static strata_alloc_reserve_t reserve_stats(void) {
  strata_alloc_reserve_t r;
  reserve_stats_fn(&r);
  return r;
}
/* Waits (up to 60 s: the refills run at SCHED_IDLE on a possibly busy machine) until the
 * reserve thread has made `n` segments. */
static void wait_made(uint64_t n) {
  for (int i = 0; i < 6000 && reserve_stats().segments_made < n; ++i) usleep(10000);
  CHECK(reserve_stats().segments_made == n);
}
static int resident_pages(void* p, size_t n) {
  size_t pages = n / 4096;
  unsigned char* v = __libc_malloc(pages);
  CHECK(v && mincore(p, n, v) == 0);
  size_t in = 0;
  for (size_t i = 0; i < pages; ++i) in += v[i] & 1;
  return (int)in;
}
static void case_reserve(void) {
  CHECK(reserve_stats().target_bytes == 0);
  CHECK(set_reserve_fn(SIZE_MAX) == 8 * MiB);  /* STRATA_ALLOC_RESERVE_BYTES */
  wait_made(1);                                /* the first fill: one 8 MiB segment, at once */
  strata_alloc_reserve_t r = reserve_stats();
  CHECK(r.target_bytes == 8 * MiB && r.bytes_populated == 8 * MiB && r.failures == 0);
  CHECK(r.empty_bytes >= 8 * MiB);
  uint64_t on_demand = r.segments_on_demand;
  /* 6 MiB is more than a quarter of a 4 MiB segment, so without the reserve it would get a
   * segment of its own on this thread; the reserve's 8 MiB segment serves it, already resident */
  unsigned char* a = malloc(6 * MiB);
  strata_seg_info info;
  CHECK(lookup_fn(a, 6 * MiB, &info) && info.size == 8 * MiB);
  uint64_t first_id = info.segment_id;
  CHECK(resident_pages(a, 6 * MiB) == (int)(6 * MiB / 4096));  /* before any write here */
  CHECK(reserve_stats().segments_on_demand == on_demand);
  fill(a, 6 * MiB, 11);
  /* the deficit lasts (a stays allocated), but while the pool is busy (a loop of steps) nothing
   * is refilled */
  for (int i = 0; i < 60; ++i) {
    void* t = malloc(512 * 1024);
    CHECK(in_pool(t, 1));
    free(t);
    usleep(10000);
  }
  CHECK(reserve_stats().segments_made == 1);
  /* the deficit lasts (a stays allocated) and the pool is quiet: the reserve thread replaces it */
  wait_made(2);
  r = reserve_stats();
  CHECK(r.empty_bytes >= 8 * MiB && r.bytes_populated == 16 * MiB);
  unsigned char* b = malloc(6 * MiB);  /* from the replacement */
  CHECK(lookup_fn(b, 1, &info) && info.size == 8 * MiB && info.segment_id != first_id);
  CHECK(resident_pages(b, 6 * MiB) == (int)(6 * MiB / 4096));
  CHECK(reserve_stats().segments_on_demand == on_demand);
  /* a deficit that ends within the delay (b freed at once) is not refilled */
  free(b);
  usleep(600000);
  CHECK(reserve_stats().segments_made == 2);
  CHECK(check_fill(a, 6 * MiB, 11));
  /* at most half the cache cap (24M: 12M, whole 4M segments); 0 turns it off */
  CHECK(set_reserve_fn((size_t)1 << 40) == 12 * MiB);
  CHECK(set_reserve_fn(0) == 0 && reserve_stats().target_bytes == 0);
  void* c = malloc(7 * MiB);  /* the free 8 MiB segment serves it; the next one is on demand */
  void* d = malloc(7 * MiB);
  CHECK(reserve_stats().segments_on_demand == on_demand + 1);
  free(a);
  free(c);
  free(d);
}

static void case_fork(void) {
  /* after fork, the child's writes to pool memory must not reach the parent */
  unsigned char* p = malloc(4 * MiB);
  memset(p, 1, 4 * MiB);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    memset(p, 2, 4 * MiB);
    strata_seg_info info;
    if (lookup_fn(p, 1, &info)) _exit(3);  /* not shareable in the child */
    void* q = malloc(4 * MiB);  /* and the child's own pool works */
    memset(q, 3, 4 * MiB);
    free(q);
    free(p);
    _exit(p[0] == 2 ? 0 : 4);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (size_t i = 0; i < 4 * MiB; i += 4096) CHECK(p[i] == 1);
  void* q = malloc(4 * MiB);
  memset(q, 5, 4 * MiB);
  for (size_t i = 0; i < 4 * MiB; i += 4096) CHECK(p[i] == 1);
  free(q);
  free(p);
}

static void case_threshold(void) {
  /* run with STRATA_ALLOC_THRESHOLD=128K (the default is 64K) */
  void* p = malloc(128 * 1024);
  void* q = malloc(128 * 1024 - 1);
  CHECK(in_pool(p, 1) && !in_pool(q, 1));
  strata_alloc_stats_t s = stats();
  CHECK(s.threshold == 128 * 1024);
  free(p);
  free(q);
}

static void case_disabled(void) {
  void* p = malloc(8 * MiB);
  CHECK(!in_pool(p, 1));
  CHECK(active_fn() == 0);
  free(p);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: alloc_check <case>\n");
    return 2;
  }
  load_api();
  const char* c = argv[1];
  struct { const char* name; void (*fn)(void); } cases[] = {
      {"active", case_active},   {"align", case_align},     {"realloc", case_realloc},
      {"threads", case_threads}, {"sizes", case_sizes},     {"foreign", case_foreign},
      {"cache", case_cache},     {"cache_zero", case_cache_zero}, {"reuse", case_reuse},
      {"lookup", case_lookup},   {"callback", case_callback}, {"fork", case_fork},
      {"threshold", case_threshold}, {"disabled", case_disabled}, {"reserve", case_reserve},
  };
  for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
    if (strcmp(c, cases[i].name) == 0) {
      cases[i].fn();
      int heap = check_fn();
      if (heap != 0) {
        fprintf(stderr, "strata_alloc_check() = %d after %s\n", heap, c);
        return 1;
      }
      printf("ok %s\n", c);
      return 0;
    }
  }
  fprintf(stderr, "unknown case %s\n", c);
  return 2;
}
