// Process-wide counters, exposed to Python through strata_jax.memory_stats()/comm_stats().
// Relaxed atomics: they are statistics, not synchronization.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace strata {

struct Stats {
  std::atomic<uint64_t> calls{0};            // collective calls (per rank)
  std::atomic<uint64_t> zero_copy_bytes{0};  // bytes read straight from peers' buffers
  std::atomic<uint64_t> staged_bytes{0};     // bytes copied through a bounce buffer
  std::atomic<uint64_t> one_shot{0};         // all-reduce algorithm choices
  std::atomic<uint64_t> two_shot{0};
  std::atomic<uint64_t> timeouts{0};
  std::atomic<uint64_t> moe_calls{0};
  // Shared-memory fabric (fabric/shm.h). "Registration" = exporting a segment's fd to every
  // peer and mapping it there.
  std::atomic<uint64_t> reg_critical{0};     // registrations a collective had to do or wait for
  std::atomic<uint64_t> reg_critical_ns{0};  // time collectives spent on them
  std::atomic<uint64_t> reg_offpath{0};      // segments exported from the allocator's thread
  std::atomic<uint64_t> reg_offpath_ns{0};
  std::atomic<uint64_t> exported_segments{0};  // live segments of this process shared with peers
  std::atomic<uint64_t> exported_bytes{0};
  std::atomic<uint64_t> mapped_segments{0};  // live peer segments mapped here
  std::atomic<uint64_t> mapped_bytes{0};
  std::atomic<uint64_t> staged_calls{0};       // calls that staged at least one buffer
  std::atomic<uint64_t> bounce_bytes{0};       // bytes in this process's bounce buffers
  std::atomic<uint64_t> peer_bounce_bytes{0};  // bytes read from/written to peers' bounce buffers
  // Between fabrics (strata_jax/_src/hierarchy/): bytes handed to XLA's own collectives by
  // the inter-fabric steps of hierarchical collectives, counted by a custom call next to each.
  std::atomic<uint64_t> inter_fabric_calls{0};
  std::atomic<uint64_t> inter_fabric_bytes{0};
  // Concurrency XLA really gives strata calls (ffi/common.h, InFlight): the most calls, and
  // the most distinct executions (run ids), ever in flight at once on one device. The
  // cross-process rendezvous rule relies on the second staying 1 (fabric/shm.h).
  std::atomic<uint64_t> max_calls_in_flight{0};
  std::atomic<uint64_t> max_runs_in_flight{0};
  std::atomic<uint64_t> low_latency_calls{0};  // calls on the small-message path (shm_ll.h)
  std::atomic<uint64_t> direct_calls{0};       // calls on its direct (zero-copy) form
  // Waits of the low-latency channel (arrival, and the direct form's departure) that did not
  // find the condition at once, and those of them that slept on the futex (a sleep costs a
  // wake-up: tens of microseconds; a spin or a yield does not).
  std::atomic<uint64_t> channel_waits{0};
  std::atomic<uint64_t> channel_sleeps{0};
  std::atomic<uint64_t> mismatches{0};  // calls failed because ranks disagreed on the op
  std::atomic<uint64_t> failures{0};    // strata calls that returned an error (any cause)
  // In-process calls in one rendezvous (per rank): the last rank to arrive ran every rank's
  // part (InProcTeam::arrive_lead), or the pairs of blocks were copied as ranks arrived
  // (InProcTeam::arrive_pairs).
  std::atomic<uint64_t> lead_calls{0};
  std::atomic<uint64_t> pair_calls{0};
  // Rendezvous steps (docs/scaling.md), per rank: every entry into a barrier of a call's slot
  // (an add on its `arrivals`, or on its group's counter above 64 ranks, then a wait for the
  // group), and every publication of the
  // low-latency path (one per call: its slot is reused once the peers' read marks are in).
  std::atomic<uint64_t> rendezvous_steps{0};
};
Stats& stats();

// A sentence appended to every timeout error, set from Python (strata_jax/_src/runtime.py: the
// dispatch-ahead explanation when XLA's launch pool is too small); empty by default. Guarded by
// a mutex: handlers read it while Python may set it.
void set_timeout_hint(const std::string& hint);
std::string timeout_hint();

}  // namespace strata
