// Row kernels of the MoE data phases, typed by element: load into an accumulator (float32 for
// 16-bit floats and float32, float64 for float64), scale-add, store with one rounding.
#pragma once

#include <cstdint>
#include <cstring>

namespace strata {
namespace moe {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

template <class T>
struct Elem {
  using Acc = T;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};
template <>
struct Elem<bf16> {
  using Acc = float;
  static float load(bf16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static bf16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return bf16{static_cast<uint16_t>(u >> 16)};
  }
};
template <>
struct Elem<f16> {
  using Acc = float;
  static float load(f16 v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return static_cast<float>(h);
  }
  static f16 store(float f) {
    _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    f16 r;
    std::memcpy(&r.bits, &h, 2);
    return r;
  }
};

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
