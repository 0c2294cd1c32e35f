// Row kernels of the MoE data phases, typed by element: load into an accumulator (float32 for
// 16-bit floats and float32, float64 for float64), scale-add, store with one rounding.
#pragma once

#include <cstdint>

#include "coll/elem.h"

namespace strata {
namespace moe {

using strata::bf16;
using strata::Elem;
using strata::f16;

// acc[i] += w * row[i]
template <class T>
inline void axpy(typename Elem<T>::Acc* acc, const T* row, typename Elem<T>::Acc w, int64_t n) {
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
