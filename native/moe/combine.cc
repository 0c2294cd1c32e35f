// Combine in two phases (DeepEP's combine, pull-style): expert ranks reduce each token's
// weighted expert rows locally, then each source rank pulls one partial row per destination.
#include <algorithm>
#include <vector>

#include "moe/moe.h"
#include "moe/rows.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace moe {
namespace {

using DT = xla::ffi::DataType;

// Phase 1 on this (expert) rank: partials[rows[g]] = sum_k w_g[k] * expert_y[slots[g, k]] for
// every global token g with a kept slot here.
template <class T>
void partial_sums(Team& t, const MoeShape& s, const T* ey, const int32_t* slots,
                  const int32_t* rows, T* partials) {
  using Acc = typename Elem<T>::Acc;
  const int64_t N = s.ranks * s.tokens, K = s.topk, H = s.hidden;
  std::vector<Acc> acc(H);
  for (int64_t g = 0; g < N; ++g) {
    const int32_t j = rows[g];
    if (j < 0) continue;
    const int32_t* sl = slots + g * K;
    const Acc* w =
        static_cast<const Acc*>(t.peer_buf(static_cast<int>(g / s.tokens), kCombWeights)) +
        (g % s.tokens) * K;
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t k = 0; k < K; ++k)
      if (sl[k] >= 0) axpy<T>(acc.data(), ey + sl[k] * H, static_cast<Acc>(w[k]), H);
    store_row<T>(partials + int64_t(j) * H, acc.data(), H);
  }
}

// Phase 2 on this (source) rank: y[t] = sum over ranks r (in rank order, so the result does
// not depend on timing) of partials_r[rows_r[me * T + t]] where that row exists.
template <class T>
void reduce_partials(Team& t, const MoeShape& s, T* y) {
  using Acc = typename Elem<T>::Acc;
  const int64_t R = s.ranks, H = s.hidden;
  const int64_t base = static_cast<int64_t>(t.rank()) * s.tokens;
  std::vector<const T*> parts(R);
  std::vector<const int32_t*> rows(R);
  for (int64_t r = 0; r < R; ++r) {
    parts[r] = static_cast<const T*>(t.peer_buf(static_cast<int>(r), kCombPartials));
    rows[r] = static_cast<const int32_t*>(t.peer_buf(static_cast<int>(r), kCombRows));
    if (rows[r]) rows[r] += base;
  }
  std::vector<Acc> acc(H);
  for (int64_t tok = 0; tok < s.tokens; ++tok) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t r = 0; r < R; ++r) {
      const int32_t j = rows[r] ? rows[r][tok] : -1;
      if (j >= 0) add<T>(acc.data(), parts[r] + int64_t(j) * H, H);
    }
    store_row<T>(y + tok * H, acc.data(), H);
  }
}

}  // namespace

std::string combine(Team& t, const MoeShape& s, const void* expert_y, const int32_t* slots,
                    const int32_t* rows, void* y) {
  // Where peers see this rank's partials (its own buffer, or its bounce copy when staged).
  void* partials = const_cast<void*>(t.peer_buf(t.rank(), kCombPartials));
  with_row_type(s.dtype, [&](auto tag) {
    using T = decltype(tag);
    partial_sums<T>(t, s, static_cast<const T*>(expert_y), slots, rows, static_cast<T*>(partials));
  });
  // Every rank's partials are complete and visible after this barrier (acq_rel arrivals).
  std::string err = t.barrier("combine partials");
  if (!err.empty()) return err;
  with_row_type(s.dtype, [&](auto tag) {
    using T = decltype(tag);
    reduce_partials<T>(t, s, static_cast<T*>(y));
  });
  return {};
}

namespace {
template <class V>
void gather_typed(Team& t, const MoeShape& s, const int32_t* topk_idx, V* out) {
  const int64_t El = s.local_experts, K = s.topk;
  const int64_t E = El * t.size();
  const int64_t base = static_cast<int64_t>(t.rank()) * s.tokens;
  for (int64_t tok = 0; tok < s.tokens; ++tok) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = topk_idx[tok * K + k];
      V v = 0;
      if (e >= 0 && e < E) {
        const int owner = static_cast<int>(e / El);
        const int32_t slot =
            static_cast<const int32_t*>(t.peer_buf(owner, kGathSlots))[(base + tok) * K + k];
        if (slot >= 0) v = static_cast<const V*>(t.peer_buf(owner, kGathValues))[slot];
      }
      out[tok * K + k] = v;
    }
  }
}
}  // namespace

std::string gather_values(Team& t, const MoeShape& s, const int32_t* topk_idx, void* out) {
  if (static_cast<DT>(s.dtype) == DT::F64)
    gather_typed(t, s, topk_idx, static_cast<double*>(out));
  else
    gather_typed(t, s, topk_idx, static_cast<float*>(out));
  return {};
}

}  // namespace moe
}  // namespace strata
