// Settings read from the environment by the native library.
#pragma once

#include <cstdint>

namespace strata {

// A byte count from the environment: digits with an optional K/M/G suffix (KiB, MiB, GiB), or
// `dflt` when unset, empty or not such a count. strata_jax refuses values this cannot read with
// a ValueError at the first strata call (runtime._check_native_env), so `dflt` on a malformed
// value is only what a process that skipped that check gets.
int64_t env_bytes(const char* name, int64_t dflt);

// A whole number >= 0 from the environment (digits only: spin and yield rounds), or `dflt` when
// unset, empty or not such a number (strata_jax refuses those at the first strata call:
// runtime.env_count).
int env_count(const char* name, int dflt);

// An on/off setting from the environment: "1" on, "0" off, `dflt` when unset, empty or anything
// else (strata_jax refuses other values at the first strata call: runtime.env_bool).
bool env_flag(const char* name, bool dflt);

}  // namespace strata
