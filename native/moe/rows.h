// Row kernels of the MoE data phases, typed by element: load into an accumulator (float32 for
// 16-bit floats and float32, float64 for float64), scale-add, store with one rounding.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

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
// kStream: dst is only written here and not read back soon; float rows then leave through
// non-temporal stores straight from the registers (no read for ownership of dst's lines; the
// caller fences before publishing). Other types ignore it and store normally.
template <class T, bool kStream = false>
inline void weighted_sum_rows(T* __restrict dst, const T* const* rows,
                              const typename Elem<T>::Acc* w, int64_t m, int64_t n,
                              const T* const* next, int64_t mn) {
  using Acc = typename Elem<T>::Acc;
  constexpr int64_t L = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    // Written out with SSE (the x86-64 baseline): GCC split the generic line loop below into
    // 3 vector and 4 scalar multiply-adds per row for float. Same operations, same order.
    const bool stream = kStream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
    for (; i + 16 <= n; i += 16) {
      __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps(), a2 = _mm_setzero_ps(),
             a3 = _mm_setzero_ps();
      for (int64_t j = 0; j < m; ++j) {
        if (j < mn) _mm_prefetch(reinterpret_cast<const char*>(next[j] + i), _MM_HINT_T0);
        const float* r = rows[j] + i;
        const __m128 wj = _mm_set1_ps(w[j]);
        a0 = _mm_add_ps(a0, _mm_mul_ps(wj, _mm_loadu_ps(r)));
        a1 = _mm_add_ps(a1, _mm_mul_ps(wj, _mm_loadu_ps(r + 4)));
        a2 = _mm_add_ps(a2, _mm_mul_ps(wj, _mm_loadu_ps(r + 8)));
        a3 = _mm_add_ps(a3, _mm_mul_ps(wj, _mm_loadu_ps(r + 12)));
      }
      for (int64_t j = m; j < mn; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(next[j] + i), _MM_HINT_T0);
      if (stream) {
        _mm_stream_ps(dst + i, a0);
        _mm_stream_ps(dst + i + 4, a1);
        _mm_stream_ps(dst + i + 8, a2);
        _mm_stream_ps(dst + i + 12, a3);
      } else {
        _mm_storeu_ps(dst + i, a0);
        _mm_storeu_ps(dst + i + 4, a1);
        _mm_storeu_ps(dst + i + 8, a2);
        _mm_storeu_ps(dst + i + 12, a3);
      }
    }
  } else {
    for (; i + L <= n; i += L) {
      Acc a[L] = {};
      for (int64_t j = 0; j < m; ++j) {
        if (j < mn) __builtin_prefetch(next[j] + i, 0, 3);
        const T* r = rows[j] + i;
        const Acc wj = w[j];
        for (int64_t l = 0; l < L; ++l) a[l] += wj * Elem<T>::load(r[l]);
      }
      for (int64_t j = m; j < mn; ++j) __builtin_prefetch(next[j] + i, 0, 3);
      for (int64_t l = 0; l < L; ++l) dst[i + l] = Elem<T>::store(a[l]);
    }
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
