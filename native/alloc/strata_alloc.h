/* strata_alloc: registration-on-allocation pool (libstrata_alloc.so).
 *
 * Loaded with LD_PRELOAD, the library interposes the malloc family. Every allocation of at least
 * STRATA_ALLOC_THRESHOLD bytes is carved from a "fabric segment": a memfd mapped MAP_SHARED, which
 * a peer process can map from the fd (SCM_RIGHTS / pidfd_getfd). Everything smaller, and every
 * pointer the pool does not own, goes to libc untouched.
 *
 * The rest of strata finds this API with dlsym(RTLD_DEFAULT, "strata_alloc_lookup") etc., so it
 * works whether or not the library was preloaded (when it is not, the lookups simply find nothing).
 *
 * Environment (read once, at the first allocation after the environment is available):
 *   STRATA_ALLOC_THRESHOLD      bytes (suffix K/M/G allowed, minimum 4K); default 64K (measured:
 *                               see interpose.cc), lowered by strata_alloc_set_threshold (the
 *                               fabric across processes) unless set here. Smaller requests use
 *                               libc.
 *   STRATA_ALLOC_CACHE_BYTES    cap on free memory kept in the pool; default 1G. Past it, wholly
 *                               free segments are returned to the OS (munmap + close).
 *   STRATA_ALLOC_SEGMENT_BYTES  size of the shared segments small-ish requests are carved from;
 *                               default 64M. Requests above a quarter of it get their own segment,
 *                               rounded up to a multiple of 2 MiB.
 *   STRATA_ALLOC_RESERVE_BYTES  the reserve strata_alloc_set_reserve(SIZE_MAX) keeps (rounded up
 *                               to whole segments, made as one segment); default 128M. 0: none.
 *   STRATA_ALLOC_RESERVE_DELAY_MS  a reserve deficit is refilled once the pool has been quiet (no
 *                               allocation or free) this long; default 200. 0: at once.
 *   STRATA_ALLOC_DISABLE=1      interpose but serve everything from libc.
 */
#ifndef STRATA_ALLOC_STRATA_ALLOC_H_
#define STRATA_ALLOC_STRATA_ALLOC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_ALLOC_API __attribute__((visibility("default")))
#define STRATA_ALLOC_ABI_VERSION 1

/* One pool segment, or a range inside one. */
typedef struct strata_seg_info {
  uint64_t segment_id; /* unique per process, never reused; starts at 1 */
  int fd;              /* the memfd (MFD_CLOEXEC); owned by the allocator: dup it to keep it */
  void* base;          /* where the segment is mapped in this process */
  size_t size;         /* segment size in bytes (a multiple of 4096) */
  size_t offset;       /* offset of the looked-up pointer from base (0 in callbacks) */
} strata_seg_info;

typedef struct strata_alloc_stats_t {
  uint64_t segments;           /* live segments */
  uint64_t segment_bytes;      /* bytes mapped in live segments */
  uint64_t bytes_in_use;       /* bytes in allocated pool blocks (rounded to 4 KiB) */
  uint64_t bytes_cached;       /* free bytes kept in live segments */
  uint64_t pool_allocs;        /* allocations served from the pool */
  uint64_t pool_frees;         /* pool blocks freed */
  uint64_t libc_allocs;        /* allocations passed to libc (all sizes) */
  uint64_t segments_created;   /* segments ever created */
  uint64_t segments_released;  /* segments returned to the OS */
  uint64_t segments_announced; /* new-segment callback invocations */
  uint64_t threshold;          /* effective threshold (UINT64_MAX when the pool is off) */
  uint64_t cache_cap;          /* effective STRATA_ALLOC_CACHE_BYTES */
} strata_alloc_stats_t;

/* The reserve (strata_alloc_set_reserve). */
typedef struct strata_alloc_reserve_t {
  uint64_t target_bytes;       /* bytes kept ahead of demand (0: no reserve) */
  uint64_t empty_bytes;        /* bytes in wholly free segments now */
  uint64_t segments_made;      /* segments the background thread made ahead of demand */
  uint64_t bytes_populated;    /* bytes it faulted in for them */
  uint64_t failures;           /* refills that failed (the reserve then stops until re-set) */
  uint64_t segments_on_demand; /* segments created inside malloc, on the caller's thread */
} strata_alloc_reserve_t;

typedef void (*strata_seg_callback)(const strata_seg_info* info, void* user);

/* 1 if [p, p+len) lies inside one shareable pool segment (out filled), else 0. Lock-free (seqlock);
 * safe from any thread. The answer is only meaningful while the caller keeps the memory alive. */
STRATA_ALLOC_API int strata_alloc_lookup(const void* p, size_t len, strata_seg_info* out);

/* Install (or, with cb == NULL, remove) the new-segment callback. It runs on the allocator's own
 * background thread, never inside malloc: once for every segment that exists at installation and
 * then once for every segment created later. A segment released before the thread reached it is
 * skipped. When this returns, a previously installed callback is not running and will not run again
 * (unless this is called from inside a callback). The callback may allocate. */
STRATA_ALLOC_API void strata_alloc_set_new_segment_callback(strata_seg_callback cb, void* user);

/* Install (or remove) the freed-segment callback: called on the background thread for a segment
 * about to be unmapped and closed, if the new-segment callback was called for it. Install it before
 * the new-segment callback to see every pair. */
STRATA_ALLOC_API void strata_alloc_set_free_segment_callback(strata_seg_callback cb, void* user);

/* Block until the background thread has announced every live segment and finished every pending
 * release. Returns at once if no callback was ever installed. Never call it from a callback. */
STRATA_ALLOC_API void strata_alloc_flush(void);

STRATA_ALLOC_API void strata_alloc_stats(strata_alloc_stats_t* out);

/* Keep at least `bytes` (rounded up to whole segments, at most half of STRATA_ALLOC_CACHE_BYTES)
 * in wholly free segments made ahead of demand: whenever an allocation takes the first block of
 * an empty segment and the rest falls below the target, the background thread creates a segment,
 * faults in every page (allocation and zeroing by the kernel happen there, not in the thread
 * that first writes a buffer) and adds it to the pool, where it is announced to the new-segment
 * callback like any other. So a burst of fresh allocations (the first step of a training loop)
 * finds memory that is already faulted in and registered. SIZE_MAX: STRATA_ALLOC_RESERVE_BYTES;
 * 0: no reserve (segments made so far stay cached). Returns the effective target. Costs the
 * reserve's resident memory. */
STRATA_ALLOC_API size_t strata_alloc_set_reserve(size_t bytes);

/* The keep budget: free pool blocks that may hold faulted-in pages are kept up to `bytes` in
 * all; past it, a block freed is given back to the OS (MADV_REMOVE: its pages, not its place in
 * the pool). SIZE_MAX (the default): keep everything, as a cache. The fabric sets it to the
 * process's share of the host when it connects (native/fabric/shm_link.cc). Returns the free
 * resident bytes now. */
STRATA_ALLOC_API size_t strata_alloc_set_keep(size_t bytes);
/* The budget (SIZE_MAX: none), the free bytes that may be resident, the bytes given back. */
STRATA_ALLOC_API void strata_alloc_keep_stats(uint64_t* keep, uint64_t* free_resident,
                                              uint64_t* returned);
STRATA_ALLOC_API void strata_alloc_reserve_stats(strata_alloc_reserve_t* out);

/* 1 when the pool is on and serves allocations: this library's malloc family is the one the
 * process uses (LD_PRELOAD), or strata_alloc_hook rewrote a library's allocation slots. */
STRATA_ALLOC_API int strata_alloc_active(void);
/* 1 when this library was preloaded (its posix_memalign is the process-wide one). */
STRATA_ALLOC_API int strata_alloc_preloaded(void);
/* 1 once strata_alloc_hook rewrote at least one slot. */
STRATA_ALLOC_API int strata_alloc_hooked(void);

/* Without LD_PRELOAD: in an already running process, point the posix_memalign, free and realloc
 * relocation slots (GOT entries) of every loaded library whose path contains `library` at the
 * pool (posix_memalign serves requests >= the threshold from fabric segments; free and realloc
 * handle pool blocks and pass every other pointer to libc). Other libraries keep libc. Slots
 * for free/realloc are rewritten before posix_memalign's. Returns the number of slots rewritten,
 * -ENOENT when no loaded library matches, -EAGAIN before libc is resolved, or -errno of a failed
 * mprotect. Idempotent (a second call rewrites the same slots to the same targets). */
STRATA_ALLOC_API int strata_alloc_hook(const char* library);

/* Requests of at least `bytes` (at least 4 KiB) go to the pool from now on; blocks already handed
 * out keep their owner. A threshold set in the environment (STRATA_ALLOC_THRESHOLD) wins: the call
 * then changes nothing. Returns the threshold in effect (SIZE_MAX when the pool is off). The
 * shared-memory fabric lowers it when it connects processes (fabric/shm_link.cc). */
STRATA_ALLOC_API size_t strata_alloc_set_threshold(size_t bytes);

STRATA_ALLOC_API int strata_alloc_abi_version(void);

/* Debugging aid: walks every segment and checks the pool's invariants (blocks tile segments,
 * neighbours coalesced, bins and accounting consistent). 0 when sound, else a code > 0. */
STRATA_ALLOC_API int strata_alloc_check(void);

/* Function-pointer types for dlsym users. */
typedef int (*strata_alloc_lookup_fn)(const void*, size_t, strata_seg_info*);
typedef void (*strata_alloc_set_callback_fn)(strata_seg_callback, void*);
typedef void (*strata_alloc_stats_fn)(strata_alloc_stats_t*);
typedef int (*strata_alloc_active_fn)(void);
typedef size_t (*strata_alloc_set_reserve_fn)(size_t);
typedef size_t (*strata_alloc_set_keep_fn)(size_t);
typedef void (*strata_alloc_keep_stats_fn)(uint64_t*, uint64_t*, uint64_t*);
typedef void (*strata_alloc_reserve_stats_fn)(strata_alloc_reserve_t*);
typedef size_t (*strata_alloc_set_threshold_fn)(size_t);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_ALLOC_STRATA_ALLOC_H_ */
