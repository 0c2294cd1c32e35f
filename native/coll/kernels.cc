#include "coll/kernels.h"

#include <emmintrin.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "coll/elem.h"
#include "coll/reduce_impl.h"
#include "common/env.h"
#include "xla/ffi/api/ffi.h"

namespace strata {

using DT = xla::ffi::DataType;

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
  if (static_cast<int32_t>(op) < 0 || static_cast<int32_t>(op) >= kReductions) return false;
  if (op == ReduceOp::kMean) return t == DT::F32 || t == DT::F64 || t == DT::BF16 || t == DT::F16;
  return dtype_size(dtype) != 0;
}

void reduce_n(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst, size_t b,
              size_t e) {
  if (b >= e) return;
  const int es = dtype_size(dtype);
  reduce_n_to(dtype, op, srcs, n, static_cast<char*>(dst) + b * es, b, e);
}

// The AVX2 + F16C build of the kernels (kernels_avx2.cc), where the CPU has them.
void reduce_n_to_avx2(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                      size_t b, size_t e);

void reduce_n_to(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst, size_t b,
                 size_t e) {
  if (b >= e) return;
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2) return reduce_n_to_avx2(dtype, op, srcs, n, dst, b, e);
#endif
  reduce_n_to_isa(dtype, op, srcs, n, dst, b, e);
}

size_t stream_bytes() {
  static const size_t v = static_cast<size_t>(env_bytes("STRATA_STREAM_BYTES", kStreamBytes));
  return v;
}

bool stream_output(size_t out_bytes) { return out_bytes >= stream_bytes(); }

void copy_out(void* dst, const void* src, size_t bytes, bool stream) {
  if (!stream) {
    if (bytes) std::memcpy(dst, src, bytes);
    return;
  }
  copy_bytes_stream(dst, src, bytes);
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  copy_out(dst, src, bytes, stream_output(bytes));
}

void copy_bytes_stream(void* dst, const void* src, size_t bytes) {
  copy_bytes_stream_prefetch(dst, src, bytes, nullptr);
}

void copy_bytes_stream_prefetch(void* dst, const void* src, size_t bytes, const void* next) {
  if (bytes < 64) {  // under one line (and shorter than the alignment head): a plain copy
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
  const char* nx = static_cast<const char*>(next);
  for (size_t i = 0; i < body; i += 64) {
    if (nx) _mm_prefetch(nx + i, _MM_HINT_T0);
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

void zero_bytes(void* dst, size_t bytes) {
  // Under one line (shorter than the alignment head) a plain memset, whatever
  // STRATA_STREAM_BYTES says.
  if (bytes < kZeroStreamBytes || bytes < 64) {
    if (bytes) std::memset(dst, 0, bytes);
    return;
  }
  char* d = static_cast<char*>(dst);
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memset(d, 0, head);
  d += head;
  bytes -= head;
  const size_t body = bytes & ~static_cast<size_t>(63);
  const __m128i z = _mm_setzero_si128();
  for (size_t i = 0; i < body; i += 64) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), z);
  }
  std::memset(d + body, 0, bytes - body);
}

void prepare_output(void* dst, size_t bytes) {
  static const bool enabled = env_flag("STRATA_THP", true);
  if (!enabled || bytes < kHugeOutputBytes) return;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(dst) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(dst) + bytes) & ~(kHuge - 1);
  // Advice only: failure (no THP, a pool mapping that refuses it) changes nothing but speed.
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
}

// Orders this thread's non-temporal stores before its later stores (the barrier's release).
void copy_fence() { _mm_sfence(); }

}  // namespace strata
