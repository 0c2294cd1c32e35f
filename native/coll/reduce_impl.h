// The reduce kernels, compiled once per instruction set: kernels.cc includes this file for the
// baseline x86-64 build and kernels_avx2.cc for AVX2+F16C (chosen at run time by reduce_n_to,
// kernels.cc). Everything here has internal linkage, so the two builds never merge at link time
// (Elem's functions are always inlined for the same reason).
//
// Structure: a tile of the result stays in L1 in the accumulator type while the sources stream
// through it, four at a time (one pass over the tile per four sources, not per source). Every
// loop takes __restrict pointers and has no cross-iteration dependence, so the compiler
// vectorizes it; the fold order is rank 0, 1, ..., n-1 for every element, whichever rank
// computes it.
#pragma once

#include <cstddef>
#include <type_traits>

#include "coll/elem.h"
#include "coll/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace {

template <class A>
inline A op_sum(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
// IEEE-754 maximum/minimum: NaN if either operand is NaN; on ties (+0 vs -0) the first operand,
// like std::max. Floats: take b when b is greater (less) or NaN. How that is written decides
// whether GCC vectorizes the loops (measured on 8 x 64 Ki floats, AVX2): GCC 12 turns two selects
// in a row (`b > a ? b : a`, then `b != b ? b : r`) into maxps + a blend (47 us) but leaves them
// scalar with GCC 14, Debian trixie's, where JAX 0.12 runs (106 us: pmax of 256 KiB over 8
// devices 0.82x jax.lax); one select on the OR of both compares vectorizes with both (cmpps,
// or, blendvps: 52 us with GCC 14, 51 us with GCC 12, where it cost pmax 1-3 % at 256 KiB).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#define STRATA_MINMAX_TWO_SELECTS 1
#else
#define STRATA_MINMAX_TWO_SELECTS 0
#endif
template <class A>
inline A op_max(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
#if STRATA_MINMAX_TWO_SELECTS
    const A r = b > a ? b : a;  // a NaN: the compare is false -> a
    return b != b ? b : r;      // b NaN -> b
#else
    const bool take_b = (b > a) | (b != b);
    return take_b ? b : a;
#endif
  } else {
    return b > a ? b : a;
  }
}
template <class A>
inline A op_min(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
#if STRATA_MINMAX_TWO_SELECTS
    const A r = b < a ? b : a;
    return b != b ? b : r;
#else
    const bool take_b = (b < a) | (b != b);
    return take_b ? b : a;
#endif
  } else {
    return b < a ? b : a;
  }
}

// Integer products wrap like sums, computed in an unsigned type at least as wide as int (two
// uint16 would be promoted to int, whose overflow is undefined); bool's (bytes 0/1) is AND.
template <class A>
inline A op_prod(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <ReduceOp OP, class A>
inline A op_apply(A a, A b) {
  if constexpr (OP == ReduceOp::kSum || OP == ReduceOp::kMean) {
    return op_sum<A>(a, b);
  } else if constexpr (OP == ReduceOp::kMax) {
    return op_max<A>(a, b);
  } else if constexpr (OP == ReduceOp::kMin) {
    return op_min<A>(a, b);
  } else {
    return op_prod<A>(a, b);
  }
}

// Elements per tile: 1 KiB of float accumulators (measured on this machine with 8 rank threads
// on 2 cores: 8 KiB tiles were 25-40% slower than 1 KiB ones, the whole-chunk loop in between).
constexpr size_t kTile = 256;

template <class T, ReduceOp OP>
void fold4(typename Elem<T>::Acc* __restrict acc, const T* __restrict s0, const T* __restrict s1,
           const T* __restrict s2, const T* __restrict s3, size_t len) {
  using E = Elem<T>;
  for (size_t i = 0; i < len; ++i) {
    auto a = op_apply<OP>(acc[i], E::load(s0[i]));
    a = op_apply<OP>(a, E::load(s1[i]));
    a = op_apply<OP>(a, E::load(s2[i]));
    acc[i] = op_apply<OP>(a, E::load(s3[i]));
  }
}

template <class T, ReduceOp OP>
void fold3(typename Elem<T>::Acc* __restrict acc, const T* __restrict s0, const T* __restrict s1,
           const T* __restrict s2, size_t len) {
  using E = Elem<T>;
  for (size_t i = 0; i < len; ++i) {
    auto a = op_apply<OP>(acc[i], E::load(s0[i]));
    a = op_apply<OP>(a, E::load(s1[i]));
    acc[i] = op_apply<OP>(a, E::load(s2[i]));
  }
}

template <class T, ReduceOp OP>
void fold2(typename Elem<T>::Acc* __restrict acc, const T* __restrict s0, const T* __restrict s1,
           size_t len) {
  using E = Elem<T>;
  for (size_t i = 0; i < len; ++i)
    acc[i] = op_apply<OP>(op_apply<OP>(acc[i], E::load(s0[i])), E::load(s1[i]));
}

template <class T, ReduceOp OP>
void fold1(typename Elem<T>::Acc* __restrict acc, const T* __restrict s, size_t len) {
  using E = Elem<T>;
  for (size_t i = 0; i < len; ++i) acc[i] = op_apply<OP>(acc[i], E::load(s[i]));
}

// pmean's factor 1/n as XLA CPU multiplies by it (see reduce_typed): jax's `y / n` makes n a
// constant of y's type first (rounded: bfloat16 holds integers exactly only to 256, float16 to
// 2048), and XLA replaces the divide by a multiply by that constant's reciprocal, rounded to T
// (bfloat16: kept in float32, where XLA computes bfloat16 arithmetic).
template <class T>
typename Elem<T>::Acc mean_scale(int n) {
  using A = typename Elem<T>::Acc;
  using E = Elem<T>;
  const A n_t = E::load(E::store(static_cast<A>(n)));
  if constexpr (std::is_same_v<T, bf16>) {
    return 1.0f / n_t;
  } else {
    return E::load(E::store(A(1) / n_t));
  }
}

// Writes element i to dst_at_begin[i - begin].
template <class T, ReduceOp OP>
void reduce_typed(const void* const* srcs, int n, void* dst_at_begin, size_t begin, size_t end) {
  using E = Elem<T>;
  using A = typename E::Acc;
  T* __restrict dst = static_cast<T*>(dst_at_begin) - begin;
  alignas(64) A acc[kTile];
  auto src = [&](int k, size_t t0) { return static_cast<const T*>(srcs[k]) + t0; };
  for (size_t t0 = begin; t0 < end; t0 += kTile) {
    const size_t len = (end - t0 < kTile) ? end - t0 : kTile;
    const T* __restrict s0 = src(0, t0);
    for (size_t i = 0; i < len; ++i) acc[i] = E::load(s0[i]);
    int k = 1;
    for (; k + 4 <= n; k += 4)
      fold4<T, OP>(acc, src(k, t0), src(k + 1, t0), src(k + 2, t0), src(k + 3, t0), len);
    // The 1-3 sources left in one explicit pass. A loop of fold1 here was unrolled by two and
    // jammed by GCC into one scalar loop over source pairs (vaddss / vmaxss with branches):
    // with 8 ranks, 3 of the 7 folds ran scalar.
    switch (n - k) {
      case 3:
        fold3<T, OP>(acc, src(k, t0), src(k + 1, t0), src(k + 2, t0), len);
        break;
      case 2:
        fold2<T, OP>(acc, src(k, t0), src(k + 1, t0), len);
        break;
      case 1:
        fold1<T, OP>(acc, src(k, t0), len);
        break;
      default:
        break;
    }
    T* __restrict d = dst + t0;
    if constexpr (OP == ReduceOp::kMean) {
      // The sum rounded to T first, then scaled: bitwise psum(x) / n as XLA CPU computes it
      // (jaxlib 0.10.2, checked by tests/test_collectives.py), which turns the divide by the
      // constant n into a multiply by its reciprocal, rounded to T (bfloat16: to float32,
      // where XLA computes bfloat16 arithmetic).
      const A scale = mean_scale<T>(n);
      for (size_t i = 0; i < len; ++i) d[i] = E::store(E::load(E::store(acc[i])) * scale);
    } else {
      for (size_t i = 0; i < len; ++i) d[i] = E::store(acc[i]);
    }
  }
}

template <class T>
void reduce_dispatch_op(ReduceOp op, const void* const* srcs, int n, void* dst, size_t b,
                        size_t e) {
  switch (op) {
    case ReduceOp::kSum:
      return reduce_typed<T, ReduceOp::kSum>(srcs, n, dst, b, e);
    case ReduceOp::kMax:
      return reduce_typed<T, ReduceOp::kMax>(srcs, n, dst, b, e);
    case ReduceOp::kMin:
      return reduce_typed<T, ReduceOp::kMin>(srcs, n, dst, b, e);
    case ReduceOp::kMean:
      if constexpr (std::is_floating_point_v<typename Elem<T>::Acc>)
        return reduce_typed<T, ReduceOp::kMean>(srcs, n, dst, b, e);
      return;  // integers: reduce_supported refuses them
    case ReduceOp::kProd:
      return reduce_typed<T, ReduceOp::kProd>(srcs, n, dst, b, e);
  }
}

// reduce_n_to for one instruction set (the dtype switch of kernels.h's reduce_n_to).
void reduce_n_to_isa(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                     size_t b, size_t e) {
  using DT = xla::ffi::DataType;
  switch (static_cast<DT>(dtype)) {
    case DT::PRED:  // bool max/min = OR/AND on 0/1 bytes; psum of bool is int32 (Python side)
    case DT::U8:
      return reduce_dispatch_op<uint8_t>(op, srcs, n, dst, b, e);
    case DT::S8:
      return reduce_dispatch_op<int8_t>(op, srcs, n, dst, b, e);
    case DT::S16:
      return reduce_dispatch_op<int16_t>(op, srcs, n, dst, b, e);
    case DT::U16:
      return reduce_dispatch_op<uint16_t>(op, srcs, n, dst, b, e);
    case DT::S32:
      return reduce_dispatch_op<int32_t>(op, srcs, n, dst, b, e);
    case DT::U32:
      return reduce_dispatch_op<uint32_t>(op, srcs, n, dst, b, e);
    case DT::S64:
      return reduce_dispatch_op<int64_t>(op, srcs, n, dst, b, e);
    case DT::U64:
      return reduce_dispatch_op<uint64_t>(op, srcs, n, dst, b, e);
    case DT::F32:
      return reduce_dispatch_op<float>(op, srcs, n, dst, b, e);
    case DT::F64:
      return reduce_dispatch_op<double>(op, srcs, n, dst, b, e);
    case DT::BF16:
      return reduce_dispatch_op<bf16>(op, srcs, n, dst, b, e);
    case DT::F16:
      return reduce_dispatch_op<f16>(op, srcs, n, dst, b, e);
    // complex sums are sums of the real and imaginary parts
    case DT::C64:
      return reduce_dispatch_op<float>(ReduceOp::kSum, srcs, n, dst, 2 * b, 2 * e);
    case DT::C128:
      return reduce_dispatch_op<double>(ReduceOp::kSum, srcs, n, dst, 2 * b, 2 * e);
    default:
      return;
  }
}

}  // namespace
}  // namespace strata
