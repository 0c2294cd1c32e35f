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

// acc[i] += w * row[i]
template <class T>
inline void axpy(typename Elem<T>::Acc* __restrict acc, const T* __restrict row,
                 typename Elem<T>::Acc w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * Elem<T>::load(row[i]);
}
// acc[i] += row[i]
template <class T>
inline void add(typename Elem<T>::Acc* acc, const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += Elem<T>::load(row[i]);
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
template <class T>
inline void store_row(T* dst, const typename Elem<T>::Acc* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::store(acc[i]);
}

}  // namespace moe
}  // namespace strata
