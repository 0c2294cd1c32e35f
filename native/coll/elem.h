// Element types and their accumulators, shared by the reduce kernels and the MoE row kernels:
// 16-bit floats load into float32 and store with one round-to-nearest-even; other types
// accumulate in themselves. Always inlined: kernels built for several instruction sets
// (reduce_impl.h) must not share one out-of-line copy.
#pragma once

#include <cstdint>
#include <cstring>

namespace strata {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

template <class T>
struct Elem {
  using Acc = T;
  [[gnu::always_inline]] static Acc load(T v) { return v; }
  [[gnu::always_inline]] static T store(Acc v) { return v; }
};

template <>
struct Elem<bf16> {
  using Acc = float;
  [[gnu::always_inline]] static float load(bf16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  [[gnu::always_inline]] static bf16 store(float f) {
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
  [[gnu::always_inline]] static float load(f16 v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return static_cast<float>(h);
  }
  [[gnu::always_inline]] static f16 store(float f) {
    _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    f16 r;
    std::memcpy(&r.bits, &h, 2);
    return r;
  }
};

}  // namespace strata
