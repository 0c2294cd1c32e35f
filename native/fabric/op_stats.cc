#include "fabric/op_stats.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "common/ops.h"

namespace strata {
namespace {

// The operators' names in comm_stats() (common/ops.h), then the MPI engine's calls; the last
// slot takes any other name.
constexpr const char* kNames[] = {
#define STRATA_STATS_NAME(id, api, lax, target, stats, algorithms, reduce) stats,
    STRATA_OPERATORS(STRATA_STATS_NAME)
#undef STRATA_STATS_NAME
#define STRATA_ENGINE_STATS_NAME(id, mpi, stats) stats,
        STRATA_ENGINE_CALLS(STRATA_ENGINE_STATS_NAME)
#undef STRATA_ENGINE_STATS_NAME
            "other"};
constexpr int kSlots = sizeof(kNames) / sizeof(kNames[0]);

OpStats* slots() {
  static OpStats* s = [] {
    auto* a = new OpStats[kSlots];
    for (int i = 0; i < kSlots; ++i) a[i].name = kNames[i];
    return a;
  }();
  return s;
}

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{env_flag("STRATA_STATS", true)};
  return on;
}

int bucket(uint64_t ns) {
  if (ns < kHistSub) return static_cast<int>(ns);
  const int p = 63 - __builtin_clzll(ns);  // ns in [2^p, 2^(p+1))
  const int sub = static_cast<int>((ns >> (p - 3)) & (kHistSub - 1));
  const int b = (p - 2) * kHistSub + sub;
  return b < kHistBuckets ? b : kHistBuckets - 1;
}

// Lower edge of a bucket, in ns (inverse of bucket()).
double bucket_low(int b) {
  if (b < kHistSub) return b;
  const int p = b / kHistSub + 2, sub = b % kHistSub;
  return std::ldexp(1.0 + sub / double(kHistSub), p);
}

thread_local OpTimer* innermost = nullptr;

}  // namespace

OpStats& op_stats(const char* name) {
  OpStats* s = slots();
  for (int i = 0; i < kSlots - 1; ++i)
    if (std::strcmp(kNames[i], name) == 0) return s[i];
  return s[kSlots - 1];
}

std::vector<const OpStats*> op_stats_all() {
  std::vector<const OpStats*> out;
  OpStats* s = slots();
  for (int i = 0; i < kSlots; ++i)
    if (s[i].calls.load(std::memory_order_relaxed)) out.push_back(&s[i]);
  return out;
}

void reset_op_stats() {
  OpStats* s = slots();
  for (int i = 0; i < kSlots; ++i) {
    s[i].calls.store(0, std::memory_order_relaxed);
    s[i].bytes.store(0, std::memory_order_relaxed);
    s[i].algo[0].store(0, std::memory_order_relaxed);
    s[i].algo[1].store(0, std::memory_order_relaxed);
    s[i].total_ns.store(0, std::memory_order_relaxed);
    s[i].wait_ns.store(0, std::memory_order_relaxed);
    for (auto& h : s[i].hist) h.store(0, std::memory_order_relaxed);
  }
}

double op_stats_quantile(const OpStats& s, double q) {
  uint64_t total = 0;
  for (const auto& h : s.hist) total += h.load(std::memory_order_relaxed);
  if (total == 0) return 0;
  const double want = q * static_cast<double>(total);
  uint64_t seen = 0;
  for (int b = 0; b < kHistBuckets; ++b) {
    const uint64_t c = s.hist[b].load(std::memory_order_relaxed);
    if (c && static_cast<double>(seen + c) >= want) {
      // Interpolate inside the bucket.
      const double lo = bucket_low(b), hi = bucket_low(b + 1);
      return lo + (hi - lo) * ((want - static_cast<double>(seen)) / static_cast<double>(c));
    }
    seen += c;
  }
  return bucket_low(kHistBuckets - 1);
}

bool op_stats_enabled() { return enabled_flag().load(std::memory_order_relaxed); }

void set_op_stats_enabled(bool on) { enabled_flag().store(on, std::memory_order_relaxed); }

OpTimer::OpTimer(const char* name, uint64_t bytes, int algo)
    : slot_(op_stats_enabled() ? &op_stats(name) : nullptr),
      bytes_(bytes),
      algo_(algo == 1 ? 1 : 0),
      outer_(innermost) {
  if (slot_) start_ = Clock::now();
  innermost = this;
}

void OpTimer::arrived() {
  OpTimer* t = innermost;
  if (t && t->slot_ && !t->has_arrived_) {
    t->arrived_ = Clock::now();
    t->has_arrived_ = true;
  }
}

OpTimer::~OpTimer() {
  innermost = outer_;
  if (!slot_) return;
  const auto end = Clock::now();
  const auto ns = [](Clock::duration d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  const uint64_t total = ns(end - start_);
  const uint64_t wait = has_arrived_ ? ns(arrived_ - start_) : total;
  slot_->calls.fetch_add(1, std::memory_order_relaxed);
  slot_->bytes.fetch_add(bytes_, std::memory_order_relaxed);
  slot_->algo[algo_].fetch_add(1, std::memory_order_relaxed);
  slot_->total_ns.fetch_add(total, std::memory_order_relaxed);
  slot_->wait_ns.fetch_add(wait, std::memory_order_relaxed);
  slot_->hist[bucket(total)].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace strata
