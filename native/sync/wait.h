// Waiting on 32-bit words shared between threads (and, through shared memory, processes).
//
// Waiters spin briefly (a peer on another core usually answers within a microsecond), then
// yield, then sleep in futex(2) with a bounded timeout so that a waiter never sleeps through
// an abort flag or its deadline. On this machine there are more rank threads than cores, so
// long spinning steals the core from the peer we are waiting for: the spin budget is small.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace strata {

using Clock = std::chrono::steady_clock;

// Sleeps until *word may differ from `expected` (or a short slice elapses). `shared` selects
// FUTEX_WAIT (inter-process) instead of FUTEX_WAIT_PRIVATE.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns, bool shared);
// Wakes every waiter on `word`.
void futex_wake_all(std::atomic<uint32_t>* word, bool shared);

// Waits until `ready()` holds. `word` is the futex word whose change signals progress.
// Returns true when ready, false when `failed()` became true or the deadline passed.
template <class Ready, class Failed>
bool wait_until(std::atomic<uint32_t>* word, Ready ready, Failed failed, Clock::time_point deadline,
                bool shared = false, int spins = 64, int yields = 16) {
  // A short spin catches a peer already running on another core; then yield, which hands
  // the core to a runnable peer (ranks outnumber cores here); then sleep in the kernel.
  for (int i = 0; i < spins; ++i) {
    if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  for (int i = 0; i < yields; ++i) {
    if (ready()) return true;
    sched_yield();
  }
  for (;;) {
    // acquire in the caller's ready(): what a peer wrote before its release increment of `word`
    // is visible once ready() observes that increment.
    uint32_t seen = word->load(std::memory_order_acquire);
    if (ready()) return true;
    if (failed()) return false;
    auto now = Clock::now();
    if (now >= deadline) return ready();
    int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    // Bounded slices keep the abort flag and deadline responsive.
    futex_wait(word, seen, left < 50'000'000 ? left : 50'000'000, shared);
  }
}

}  // namespace strata
