// The shared-memory fabric's rendezvous with many ranks, faked in one process: threads play the
// ranks of one group, every rank's entry of a slot sized at run time (ShmControl::max_ranks).
// Run by tests/test_many_ranks.py for group sizes up to 1024 (the cap was 64 ranks).
//
// What it checks, with exact integer results:
//  - the control block's layout: every slot and every entry of it lies inside the control block,
//    entries do not overlap, the low-latency region starts after the last slot;
//  - a psum (one-shot and two-shot) and an all_gather of int32 data through ShmFabric::join,
//    ShmTeam::arrive/depart and the algorithms of coll/, on `n` threads, several calls in a row
//    (the slots are reused), each rank checking its whole output;
//  - a rank that never comes: every other rank times out naming it (in the two-level barrier
//    where the group has one);
//  - a group larger than the fabric's max_ranks fails with a message naming both sizes.
//
// Usage: shm_many_ranks N [ITERS]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "coll/collectives.h"
#include "common/ops.h"
#include "common/settings.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"

using namespace strata;

// The allocator's C API as the fabric finds it (dlsym): every buffer of this process is
// "fabric memory" of one segment, so arrive() publishes it by address (ranks of one process read
// each other's buffers directly) instead of staging it through a bounce buffer.
extern "C" {
__attribute__((visibility("default"))) int strata_alloc_active(void) { return 1; }
__attribute__((visibility("default"))) int strata_alloc_lookup(const void* p, size_t,
                                                               strata_seg_info* out) {
  out->segment_id = 1;
  out->fd = -1;
  out->size = ~size_t{0} >> 1;
  out->offset = reinterpret_cast<uintptr_t>(p);
  return 1;
}
}

namespace {
constexpr int32_t kS32 = 4;  // xla::ffi::DataType

int check_layout(ShmFabric& f, int n) {
  ShmControl* c = f.control();
  const char* begin = reinterpret_cast<const char*>(c);
  const char* ll = f.ll_region();
  if (static_cast<int>(c->max_ranks) != n) return std::fprintf(stderr, "max_ranks\n"), 1;
  for (int i = 0; i < kShmSlots; ++i) {
    ShmSlot* s = c->slot(i);
    const char* first = reinterpret_cast<const char*>(&s->peer(0));
    const char* end = reinterpret_cast<const char*>(&s->peer(n - 1) + 1);
    if (reinterpret_cast<uintptr_t>(s) % 64 != 0 || first < reinterpret_cast<const char*>(s + 1) ||
        end > reinterpret_cast<const char*>(s) + c->slot_bytes || end > ll || first < begin) {
      std::fprintf(stderr, "FAILED layout: slot %d outside its room\n", i);
      return 1;
    }
    if (i + 1 < kShmSlots && reinterpret_cast<const char*>(c->slot(i + 1)) < end) {
      std::fprintf(stderr, "FAILED layout: slot %d overlaps the next\n", i);
      return 1;
    }
  }
  if (ll != begin + ShmControl::control_bytes(n)) return std::fprintf(stderr, "ll region\n"), 1;
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 3;
  settings().timeout_ms.store(120000);
  ShmFabric& f = ShmFabric::instance();
  std::string err = f.connect_for_test(n);
  if (!err.empty()) return std::fprintf(stderr, "connect_for_test: %s\n", err.c_str()), 1;
  if (check_layout(f, n)) return 1;

  std::vector<int64_t> device_ids(n), parts(n);
  for (int j = 0; j < n; ++j) device_ids[j] = parts[j] = j;
  // Rank r of the one group of n every call here uses (device and partition r).
  auto seat = [&](int r) {
    Placement pl;
    pl.group = 0;
    pl.rank = r;
    pl.size = n;
    pl.partition = r;
    pl.device = r;
    pl.comm = 0xC0FFEE;
    pl.member_parts = parts.data();
    pl.device_ids = device_ids.data();
    return pl;
  };
  std::vector<int> errors(n, 0);
  const size_t count = 3 * static_cast<size_t>(n) + 5;  // not a multiple of n: uneven chunks
  const size_t gcount = 5;                              // all_gather: n blocks of 5
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      for (int it = 0; it < iters && !errors[r]; ++it) {
        // Rank j's element e: j * 7 + e + it; the sum over ranks is known in closed form.
        std::vector<int32_t> in(count), out(count, 0), gathered(gcount * n, -1);
        for (size_t e = 0; e < count; ++e) in[e] = static_cast<int32_t>(r * 7 + e + it);
        const Placement pl = seat(r);
        for (int op = 0; op < 3 && !errors[r]; ++op) {
          std::string e;
          auto team =
              f.join(pl, /*run_id=*/it + 1, /*op_id=*/op, op == 2 ? "all_gather" : "psum", &e);
          if (!team) {
            std::fprintf(stderr, "rank %d: %s\n", r, e.c_str());
            errors[r] = 1;
            return;
          }
          OpDesc d;
          d.kind = static_cast<int32_t>(op == 2 ? Op::all_gather : Op::psum);
          d.dtype = kS32;
          d.in_bytes = (op == 2 ? gcount : count) * 4;
          d.out_bytes = op == 2 ? gcount * 4 * n : count * 4;
          e = team->arrive(d, in.data(), op == 2 ? gathered.data() : out.data());
          if (e.empty()) {
            e = op == 2 ? all_gather(*team, gcount * 4, /*push=*/it % 2 == 0)
                        : all_reduce(*team, kS32, ReduceOp::kSum, count, /*two_shot=*/op == 1);
          }
          std::string d2 = team->depart();
          if (e.empty()) e = d2;
          if (!e.empty()) {
            std::fprintf(stderr, "rank %d: %s\n", r, e.c_str());
            errors[r] = 1;
            return;
          }
          const int64_t rank_sum = 7LL * n * (n - 1) / 2;
          for (size_t k = 0; k < (op == 2 ? gcount : count) && !errors[r]; ++k) {
            if (op < 2) {
              const int64_t want = rank_sum + static_cast<int64_t>(n) * (k + it);
              if (out[k] != static_cast<int32_t>(want)) {
                std::fprintf(stderr, "FAILED psum rank %d iter %d elem %zu: %d != %lld\n", r, it, k,
                             out[k], static_cast<long long>(want));
                errors[r] = 1;
              }
            } else {
              for (int j = 0; j < n; ++j) {
                const int32_t want = static_cast<int32_t>(j * 7 + k + it);
                if (gathered[j * gcount + k] != want) {
                  std::fprintf(stderr, "FAILED all_gather rank %d block %d elem %zu\n", r, j, k);
                  errors[r] = 1;
                  break;
                }
              }
            }
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  int bad = 0;
  for (int e : errors) bad += e;
  if (bad) return std::fprintf(stderr, "FAILED on %d of %d ranks\n", bad, n), 1;

  // A rank that never comes (one in the middle: inside a group of the two-level barrier when
  // there is one): every other rank times out naming it, in the arrival barrier.
  const int miss = n / 2;
  settings().timeout_ms.store(500);
  std::vector<std::string> timeouts(n);
  threads.clear();
  for (int r = 0; r < n; ++r) {
    if (r == miss) continue;
    threads.emplace_back([&, r] {
      const Placement pl = seat(r);
      std::string e;
      auto team = f.join(pl, /*run_id=*/iters + 1, /*op_id=*/0, "psum", &e);
      if (!team) {
        timeouts[r] = "join failed: " + e;
        return;
      }
      OpDesc d;
      d.kind = static_cast<int32_t>(Op::psum);
      d.dtype = kS32;
      d.in_bytes = d.out_bytes = 4;
      int32_t one = 1, got = 0;
      e = team->arrive(d, &one, &got);
      team->depart();
      timeouts[r] = e;
    });
  }
  for (auto& t : threads) t.join();
  const std::string named = "rank(s) [" + std::to_string(miss) + "]";
  for (int r = 0; r < n; ++r) {
    if (r == miss) continue;
    if (timeouts[r].find(named) == std::string::npos) {
      std::fprintf(stderr, "FAILED: rank %d without rank %d gave '%s'\n", r, miss,
                   timeouts[r].c_str());
      return 1;
    }
  }

  // A group larger than the fabric: a clear error, no slot touched.
  Placement big;
  big.size = n + 1;
  big.comm = 1;
  std::string e;
  auto none = f.join(big, 1, 0, "psum", &e);
  if (none || e.find(std::to_string(n + 1)) == std::string::npos ||
      e.find(std::to_string(n) + " devices") == std::string::npos) {
    std::fprintf(stderr, "FAILED: oversized group gave '%s'\n", e.c_str());
    return 1;
  }
  std::printf("OK %d ranks, %d iterations, slot %zu B, control block %zu B\n", n, iters,
              ShmControl::slot_bytes_for(n), ShmControl::control_bytes(n));
  return 0;
}
