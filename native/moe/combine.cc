// Combine, pull-style in one pass: each source rank reads its tokens' expert rows straight from
// the expert ranks' buffers (see moe.h for why not DeepEP's two phases inside a fabric).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "coll/kernels.h"
#include "moe/moe.h"
#include "moe/rows.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace moe {
namespace {

using DT = xla::ffi::DataType;

template <class T>
void combine_typed(Team& t, const MoeShape& s, const typename Elem<T>::Acc* w, T* y,
                   uint64_t* peer_bytes) {
  using Acc = typename Elem<T>::Acc;
  const int64_t R = s.ranks, K = s.topk, H = s.hidden;
  const int me = t.rank();
  const int64_t base = static_cast<int64_t>(me) * s.tokens;
  std::vector<const T*> ey(R);
  std::vector<const int32_t*> slots(R);
  for (int64_t r = 0; r < R; ++r) {
    ey[r] = static_cast<const T*>(t.peer_buf(static_cast<int>(r), kCombExpertY));
    slots[r] = static_cast<const int32_t*>(t.peer_buf(static_cast<int>(r), kCombSlots));
  }
  // A token's expert rows and weights, expert ranks in rank order and each one's choices in k
  // order: a fixed order, so the result does not depend on timing or on which rank computes it.
  // At most K rows (a choice lives on one rank).
  auto sources = [&](int64_t tok, const T** rows, Acc* wts) {
    int64_t m = 0;
    for (int64_t r = 0; r < R; ++r) {
      if (!slots[r]) continue;
      const int32_t* sl = slots[r] + (base + tok) * K;
      for (int64_t k = 0; k < K; ++k)
        if (sl[k] >= 0) {
          if (r != me) *peer_bytes += H * sizeof(T);
          rows[m] = ey[r] + int64_t(sl[k]) * H;
          wts[m++] = w[tok * K + k];
        }
    }
    return m;
  };
  std::vector<const T*> rows(K), next_rows(K);
  std::vector<Acc> wts(K), next_wts(K);
  // y is only written here: non-temporal stores skip the read for ownership of its lines (a
  // third of the traffic of a cached store of a row that is not read back soon). float rows
  // stream out of the registers; other types through a row buffer.
  constexpr bool kDirect = std::is_same_v<T, float>;
  std::vector<T> row(kDirect ? 0 : H);
  int64_t m = s.tokens > 0 ? sources(0, rows.data(), wts.data()) : 0;
  for (int64_t tok = 0; tok < s.tokens; ++tok) {
    // The next token's rows are prefetched while this token's are summed.
    const int64_t mn = tok + 1 < s.tokens ? sources(tok + 1, next_rows.data(), next_wts.data()) : 0;
    if constexpr (kDirect) {
      weighted_sum_rows<T, true>(y + tok * H, rows.data(), wts.data(), m, H, next_rows.data(), mn);
    } else {
      weighted_sum_rows<T>(row.data(), rows.data(), wts.data(), m, H, next_rows.data(), mn);
      copy_bytes_stream(y + tok * H, row.data(), H * sizeof(T));
    }
    std::swap(rows, next_rows);
    std::swap(wts, next_wts);
    m = mn;
  }
  copy_fence();  // the departure barrier publishes y (non-temporal stores are weakly ordered)
}

}  // namespace

std::string combine(Team& t, const MoeShape& s, const void* w, void* y, uint64_t* peer_bytes) {
  with_row_type(s.dtype, [&](auto tag) {
    using T = decltype(tag);
    combine_typed<T>(t, s, static_cast<const typename Elem<T>::Acc*>(w), static_cast<T*>(y),
                     peer_bytes);
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
