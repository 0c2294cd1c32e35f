#include "coll/kernels.h"

#include <emmintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "coll/elem.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace {

using DT = xla::ffi::DataType;

template <class T>
using Traits = Elem<T>;

template <class A>
inline A op_sum(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <class A>
inline A op_max(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    A r = a > b ? a : b;
    return (a != a || b != b) ? a + b : r;  // NaN if either is NaN (a+b is NaN then)
  } else {
    return a > b ? a : b;
  }
}
template <class A>
inline A op_min(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    A r = a < b ? a : b;
    return (a != a || b != b) ? a + b : r;
  } else {
    return a < b ? a : b;
  }
}

// Tiles keep the partial result in L1 while every input streams through once.
constexpr size_t kTile = 2048;

// Writes element i to dst_at_begin[i - begin].
template <class T, ReduceOp OP>
void reduce_typed(const void* const* srcs, int n, void* dst_at_begin, size_t begin, size_t end) {
  using Tr = Traits<T>;
  using A = typename Tr::Acc;
  T* dst = static_cast<T*>(dst_at_begin) - begin;
  A acc[kTile];
  for (size_t t0 = begin; t0 < end; t0 += kTile) {
    const size_t len = (end - t0 < kTile) ? end - t0 : kTile;
    const T* s0 = static_cast<const T*>(srcs[0]) + t0;
    for (size_t i = 0; i < len; ++i) acc[i] = Tr::load(s0[i]);
    for (int k = 1; k < n; ++k) {
      const T* s = static_cast<const T*>(srcs[k]) + t0;
      if constexpr (OP == ReduceOp::kSum) {
        for (size_t i = 0; i < len; ++i) acc[i] = op_sum<A>(acc[i], Tr::load(s[i]));
      } else if constexpr (OP == ReduceOp::kMax) {
        for (size_t i = 0; i < len; ++i) acc[i] = op_max<A>(acc[i], Tr::load(s[i]));
      } else {
        for (size_t i = 0; i < len; ++i) acc[i] = op_min<A>(acc[i], Tr::load(s[i]));
      }
    }
    T* d = dst + t0;
    for (size_t i = 0; i < len; ++i) d[i] = Tr::store(acc[i]);
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
  }
}

}  // namespace

int dtype_size(int32_t dtype) {
  switch (static_cast<DT>(dtype)) {
    case DT::PRED:
    case DT::S8:
    case DT::U8:
      return 1;
    case DT::S16:
    case DT::U16:
    case DT::F16:
    case DT::BF16:
      return 2;
    case DT::S32:
    case DT::U32:
    case DT::F32:
      return 4;
    case DT::S64:
    case DT::U64:
    case DT::F64:
    case DT::C64:
      return 8;
    case DT::C128:
      return 16;
    default:
      return 0;
  }
}

const char* dtype_name(int32_t dtype) {
  switch (static_cast<DT>(dtype)) {
    case DT::PRED:
      return "bool";
    case DT::S8:
      return "int8";
    case DT::U8:
      return "uint8";
    case DT::S16:
      return "int16";
    case DT::U16:
      return "uint16";
    case DT::F16:
      return "float16";
    case DT::BF16:
      return "bfloat16";
    case DT::S32:
      return "int32";
    case DT::U32:
      return "uint32";
    case DT::F32:
      return "float32";
    case DT::S64:
      return "int64";
    case DT::U64:
      return "uint64";
    case DT::F64:
      return "float64";
    case DT::C64:
      return "complex64";
    case DT::C128:
      return "complex128";
    default:
      return "unsupported";
  }
}

bool reduce_supported(int32_t dtype, ReduceOp op) {
  auto t = static_cast<DT>(dtype);
  if (t == DT::C64 || t == DT::C128) return op == ReduceOp::kSum;
  return dtype_size(dtype) != 0;
}

void reduce_n(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst, size_t b,
              size_t e) {
  if (b >= e) return;
  const int es = dtype_size(dtype);
  reduce_n_to(dtype, op, srcs, n, static_cast<char*>(dst) + b * es, b, e);
}

void reduce_n_to(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst, size_t b,
                 size_t e) {
  if (b >= e) return;
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

namespace {
size_t stream_bytes() {
  // STRATA_STREAM_BYTES overrides the streaming-store threshold (for measurements).
  static const size_t v = [] {
    const char* e = std::getenv("STRATA_STREAM_BYTES");
    return e ? static_cast<size_t>(std::atoll(e)) : kStreamBytes;
  }();
  return v;
}
}  // namespace

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes < stream_bytes()) {
    if (bytes) std::memcpy(dst, src, bytes);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const size_t body = bytes & ~static_cast<size_t>(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, bytes - body);
}

// Orders this thread's non-temporal stores before its later stores (the barrier's release).
void copy_fence() { _mm_sfence(); }

}  // namespace strata
