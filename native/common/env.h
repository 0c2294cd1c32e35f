// Settings read from the environment by the native library.
#pragma once

#include <cstdint>

namespace strata {

// A byte count from the environment: digits with an optional K/M/G suffix (KiB, MiB, GiB), or
// `dflt` when unset, empty or not such a count. strata_jax refuses values this cannot read with
// a ValueError at the first strata call (runtime._check_native_env), so `dflt` on a malformed
// value is only what a process that skipped that check gets.
int64_t env_bytes(const char* name, int64_t dflt);

// An integer setting from the environment (`dflt` when unset or empty).
int env_int(const char* name, int dflt);

}  // namespace strata
