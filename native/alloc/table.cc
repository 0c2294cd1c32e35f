// The segment lookup table: address interval -> segment, sorted by base, read without locks.
//
// Concurrency: writers (insert/remove/update) are serialised by the pool mutex; readers (free() on
// every pointer, strata_alloc_lookup from collectives) never block. Consistency is a seqlock:
//   writer: seq := odd (relaxed); release fence; relaxed stores to entries; seq := even (release)
//   reader: s1 := seq (acquire), retry if odd; relaxed loads; acquire fence; s2 := seq (relaxed);
//           retry if s1 != s2.
// The release fence orders the odd store before the entry stores; a reader whose relaxed loads
// observed any of those stores synchronises through the fences and so reads s2 != s1 (Boehm, "Can
// seqlocks get along with programming language memory models?", 2012). All entry fields are
// atomics, so a torn read is a retried read, never UB; a reader clamps indices so garbage cannot
// send it out of bounds.
#include <algorithm>

#include "alloc/internal.h"

namespace strata::alloc {
namespace {

struct Entry {
  std::atomic<uintptr_t> base;
  std::atomic<uintptr_t> end;
  std::atomic<uint64_t> id;
  std::atomic<int> fd;
};

// Zero-initialised static storage: valid before any constructor runs. 16384 * 32 B = 512 KiB of
// BSS, touched only as far as it is used.
Entry g_entries[kMaxSegments];
std::atomic<size_t> g_count{0};
std::atomic<uint64_t> g_seq{0};
// Monotonic hull of every segment ever inserted: a cheap reject for libc pointers in free().
std::atomic<uintptr_t> g_lo{UINTPTR_MAX};
std::atomic<uintptr_t> g_hi{0};

void WriteBegin() {
  g_seq.store(g_seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}
void WriteEnd() {
  g_seq.store(g_seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

void CopyEntry(Entry& dst, const Entry& src) {
  dst.base.store(src.base.load(std::memory_order_relaxed), std::memory_order_relaxed);
  dst.end.store(src.end.load(std::memory_order_relaxed), std::memory_order_relaxed);
  dst.id.store(src.id.load(std::memory_order_relaxed), std::memory_order_relaxed);
  dst.fd.store(src.fd.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

// Index of the first entry with base > p among the first n. Relaxed loads: the writer holds the
// table's lock, a reader checks the sequence number around it (TableFind).
size_t UpperBound(size_t n, uintptr_t p) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_entries[mid].base.load(std::memory_order_relaxed) <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace

bool TableInsert(uintptr_t base, size_t size, uint64_t id, int fd) {
  size_t n = g_count.load(std::memory_order_relaxed);
  if (n >= kMaxSegments) return false;
  size_t at = UpperBound(n, base);
  WriteBegin();
  for (size_t i = n; i > at; --i) CopyEntry(g_entries[i], g_entries[i - 1]);
  g_entries[at].base.store(base, std::memory_order_relaxed);
  g_entries[at].end.store(base + size, std::memory_order_relaxed);
  g_entries[at].id.store(id, std::memory_order_relaxed);
  g_entries[at].fd.store(fd, std::memory_order_relaxed);
  g_count.store(n + 1, std::memory_order_relaxed);
  WriteEnd();
  // The hull only grows; relaxed is enough since it is a hint checked before the seqlock read.
  if (base < g_lo.load(std::memory_order_relaxed)) g_lo.store(base, std::memory_order_relaxed);
  if (base + size > g_hi.load(std::memory_order_relaxed))
    g_hi.store(base + size, std::memory_order_relaxed);
  return true;
}

void TableRemove(uintptr_t base) {
  size_t n = g_count.load(std::memory_order_relaxed);
  size_t at = UpperBound(n, base);
  if (at == 0 || g_entries[at - 1].base.load(std::memory_order_relaxed) != base) return;
  --at;
  WriteBegin();
  for (size_t i = at; i + 1 < n; ++i) CopyEntry(g_entries[i], g_entries[i + 1]);
  g_count.store(n - 1, std::memory_order_relaxed);
  WriteEnd();
}

void TableSetFd(uintptr_t base, int fd) {
  size_t n = g_count.load(std::memory_order_relaxed);
  size_t at = UpperBound(n, base);
  if (at == 0 || g_entries[at - 1].base.load(std::memory_order_relaxed) != base) return;
  WriteBegin();
  g_entries[at - 1].fd.store(fd, std::memory_order_relaxed);
  WriteEnd();
}

bool TableMaybeOwns(uintptr_t p) {
  return p >= g_lo.load(std::memory_order_relaxed) && p < g_hi.load(std::memory_order_relaxed);
}

bool TableFind(uintptr_t p, size_t len, TableHit* hit) {
  if (!TableMaybeOwns(p)) return false;
  for (;;) {
    uint64_t s1 = g_seq.load(std::memory_order_acquire);
    if (s1 & 1) {
      __builtin_ia32_pause();
      continue;
    }
    const size_t lo =
        UpperBound(std::min(g_count.load(std::memory_order_relaxed), kMaxSegments), p);
    bool found = false;
    TableHit h{};
    if (lo > 0) {
      const Entry& e = g_entries[lo - 1];
      h.base = e.base.load(std::memory_order_relaxed);
      uintptr_t end = e.end.load(std::memory_order_relaxed);
      h.id = e.id.load(std::memory_order_relaxed);
      h.fd = e.fd.load(std::memory_order_relaxed);
      h.size = end - h.base;
      found = p >= h.base && p < end && len <= end - p;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (g_seq.load(std::memory_order_relaxed) != s1) continue;
    if (found) *hit = h;
    return found;
  }
}

}  // namespace strata::alloc
