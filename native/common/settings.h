// The process-wide settings every layer reads on every call (atomics: written rarely, from Python
// or once from the environment): the timeout of a call that waits for its peers, and the size
// from which an all-reduce runs two-shot. A neutral place: the algorithms (coll/) and the fabrics
// read them without including each other's headers.
#pragma once

#include <atomic>
#include <cstdint>

namespace strata {

struct Settings {
  // STRATA_TIMEOUT_S (seconds), else 300 s.
  std::atomic<int64_t> timeout_ms{300'000};
  // STRATA_TWO_SHOT_BYTES, else 1 KiB. Measured with benchmarks/allreduce_switch.py on 8
  // in-process devices (2 cores): two-shot wins at every size from 1 KiB per rank; below it the
  // two are equal within noise.
  std::atomic<int64_t> two_shot_bytes{1024};
};
// The settings, read from the environment at the first call.
Settings& settings();

}  // namespace strata
