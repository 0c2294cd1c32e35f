// Process-wide counters, exposed to Python through strata_jax.memory_stats()/comm_stats().
// Relaxed atomics: they are statistics, not synchronization.
#pragma once

#include <atomic>
#include <cstdint>

namespace strata {

struct Stats {
  std::atomic<uint64_t> calls{0};             // collective calls (per rank)
  std::atomic<uint64_t> zero_copy_bytes{0};   // bytes read straight from peers' buffers
  std::atomic<uint64_t> staged_bytes{0};      // bytes copied through a bounce buffer
  std::atomic<uint64_t> one_shot{0};          // all-reduce algorithm choices
  std::atomic<uint64_t> two_shot{0};
  std::atomic<uint64_t> timeouts{0};
  std::atomic<uint64_t> moe_calls{0};
};
Stats& stats();

}  // namespace strata
