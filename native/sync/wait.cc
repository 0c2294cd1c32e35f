#include "sync/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace strata {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns, bool shared) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1'000'000'000;
  ts.tv_nsec = timeout_ns % 1'000'000'000;
  // std::atomic<uint32_t> is layout-compatible with uint32_t (static_assert in the header users).
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE,
          expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word, bool shared) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE,
          INT_MAX, nullptr, nullptr, 0);
}

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word layout");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex word must be lock-free");

}  // namespace strata
