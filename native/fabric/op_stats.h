// Per-operator counters behind strata_jax.comm_stats(): calls, bytes, algorithm choices, and the
// time in the handler as a histogram (p50/p99) split into waiting for peers (until the arrival
// barrier is passed) and moving data (the algorithm and the departure). Relaxed atomics: they
// are statistics, not synchronization. The cost per call is two steady_clock reads and a few
// relaxed adds on a slot of the operator's own (measured in tests/test_comm_stats.py: < 2% of a
// 4 KiB psum).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

namespace strata {

// Handler-time histogram: 8 sub-buckets per power of two of nanoseconds (values within 12.5%).
constexpr int kHistSub = 8;
constexpr int kHistBuckets = 64 * kHistSub;

struct OpStats {
  const char* name = nullptr;
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> bytes{0};      // input bytes per rank, summed over calls
  std::atomic<uint64_t> algo[2] = {};  // all-reduce: one-shot, two-shot (else all in [0])
  std::atomic<uint64_t> total_ns{0};   // time in the handler
  std::atomic<uint64_t> wait_ns{0};    // ... of it until every peer had arrived
  std::atomic<uint64_t> hist[kHistBuckets] = {};
};

// The slot of an operator (psum, pmax, ..., "other" for names not listed); never null.
OpStats& op_stats(const char* name);
// Every slot with at least one call.
std::vector<const OpStats*> op_stats_all();
void reset_op_stats();
// Quantile q in [0, 1] of a slot's handler time, in nanoseconds (0 without calls).
double op_stats_quantile(const OpStats& s, double q);
// Whether the counters are kept (STRATA_STATS=0 turns them off; default on).
bool op_stats_enabled();
void set_op_stats_enabled(bool on);

// Times one call of an operator on this thread: constructed when the handler starts,
// arrived() once the arrival barrier is passed (ffi/common.h), recorded when destroyed.
class OpTimer {
 public:
  OpTimer(const char* name, uint64_t bytes, int algo);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;
  // Marks the innermost live timer of this thread as past the arrival barrier.
  static void arrived();

 private:
  using Clock = std::chrono::steady_clock;
  OpStats* slot_;
  uint64_t bytes_;
  int algo_;
  Clock::time_point start_, arrived_;
  bool has_arrived_ = false;
  OpTimer* outer_;
};

}  // namespace strata
