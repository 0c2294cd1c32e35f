// The reduce kernels built for AVX2 + F16C (CMakeLists.txt compiles this file with -mavx2 -mf16c);
// kernels.cc calls it only where the CPU reports both. Same source as the baseline build
// (reduce_impl.h), so both give bitwise the same results.
#include "coll/reduce_impl.h"

namespace strata {

void reduce_n_to_avx2(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                      size_t b, size_t e) {
  reduce_n_to_isa(dtype, op, srcs, n, dst, b, e);
}

}  // namespace strata
