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
  // Exact (bitwise what the F16C instruction gives, a NaN made quiet), written in integer and
  // float operations and selects that the compiler vectorizes: a load through _Float16 has no
  // vector type without AVX512-FP16, which left every loop over float16 scalar (pmax of float16
  // over 8 devices: 0.27-0.37x jax.lax). Needs -fno-trapping-math (CMakeLists.txt) to keep the
  // selects branch-free. The method: F. Giesen, "half to float done quick" (2012).
  [[gnu::always_inline]] static float load(f16 v) {
    const uint32_t h = v.bits;
    const uint32_t em = (h & 0x7fffu) << 13;  // exponent and mantissa in float's places
    const uint32_t exp = em & 0x0f800000u;
    const uint32_t normal = em + 0x38000000u;  // the exponent rebiased: + (127 - 15) << 23
    // Infinity and NaN: float's exponent all ones; a NaN quiet.
    const uint32_t special = (normal + 0x38000000u) | ((h & 0x3ffu) != 0 ? 0x00400000u : 0u);
    // Zero and subnormals: 2^-14 x (1 + m) - 2^-14, exact.
    const uint32_t sub_biased = normal + 0x00800000u;
    float sub;
    std::memcpy(&sub, &sub_biased, 4);
    sub -= 6.103515625e-05f;
    uint32_t sub_bits;
    std::memcpy(&sub_bits, &sub, 4);
    uint32_t u = exp == 0x0f800000u ? special : (exp == 0 ? sub_bits : normal);
    u |= (h & 0x8000u) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  [[gnu::always_inline]] static f16 store(float f) {
    _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    f16 r;
    std::memcpy(&r.bits, &h, 2);
    return r;
  }
};

}  // namespace strata
