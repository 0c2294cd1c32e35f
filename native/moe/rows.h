// Row kernels of the MoE data phases, typed by element: load into an accumulator (float32 for
// 16-bit floats and float32, float64 for float64), scale-add, store with one rounding.
#pragma once

#include <cstdint>

#include "coll/elem.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace moe {

using strata::bf16;
using strata::Elem;
using strata::f16;

// Calls f(T{}) with T the C++ row type of an XLA FFI float dtype (no call if unsupported).
template <class F>
void with_row_type(int32_t dtype, F&& f) {
  using DT = xla::ffi::DataType;
  switch (static_cast<DT>(dtype)) {
    case DT::F32:
      return f(float{});
    case DT::F64:
      return f(double{});
    case DT::BF16:
      return f(bf16{});
    case DT::F16:
      return f(f16{});
    default:
      return;
  }
}

// dst[i] = rounded(sum over j < m of w[j] * rows[j][i]), summed in j order (bitwise the same as
// m axpy passes over a zeroed accumulator), in one pass: a line of the output is summed in
// registers from all m rows before the next. Also prefetches next[j] (the rows summed after
// these, or null; mn of them) line for line, so the prefetches are spread over the work instead
// of bursting: a MoE row starts at an unpredictable address (often a fresh 4 KiB page, where the
// hardware stream prefetcher stops), so without a hint each row begins with a memory round trip.
template <class T>
inline void weighted_sum_rows(T* __restrict dst, const T* const* rows,
                              const typename Elem<T>::Acc* w, int64_t m, int64_t n,
                              const T* const* next, int64_t mn) {
  using Acc = typename Elem<T>::Acc;
  constexpr int64_t L = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    Acc a[L] = {};
    for (int64_t j = 0; j < m; ++j) {
      if (j < mn) __builtin_prefetch(next[j] + i, 0, 3);
      const T* r = rows[j] + i;
      const Acc wj = w[j];
      for (int64_t l = 0; l < L; ++l) a[l] += wj * Elem<T>::load(r[l]);
    }
    for (int64_t l = 0; l < L; ++l) dst[i + l] = Elem<T>::store(a[l]);
  }
  for (; i < n; ++i) {
    Acc a = 0;
    for (int64_t j = 0; j < m; ++j) a += w[j] * Elem<T>::load(rows[j][i]);
    dst[i] = Elem<T>::store(a);
  }
}

// acc[i] = row[i]
template <class T>
inline void load_row(typename Elem<T>::Acc* acc, const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = Elem<T>::load(row[i]);
}
// dst[i] = w * acc[i]
template <class T>
inline void store_scaled(T* dst, const typename Elem<T>::Acc* acc, typename Elem<T>::Acc w,
                         int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::store(w * acc[i]);
}

}  // namespace moe
}  // namespace strata
