// Dispatch: every destination rank pulls the rows of the tokens routed to its experts straight
// from the source ranks' x buffers (DeepEP's dispatch, pull-style over a shared address space).
#include <cstring>
#include <vector>

#include "coll/kernels.h"
#include "moe/moe.h"
#include "moe/rows.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
namespace moe {
namespace {

using DT = xla::ffi::DataType;

// Unweighted: the token's row is read from the source once (the one fabric crossing; it stays
// in cache for the token's other slots here) and written to each distinct slot with
// non-temporal stores: recv_x is only written here, so its lines need not be read for ownership
// (a third of the traffic of a cached copy).
void dispatch_copy(Team& t, const MoeShape& s, const int32_t* slots, char* out,
                   uint64_t* peer_bytes) {
  const int64_t N = s.ranks * s.tokens, K = s.topk, rb = s.row_bytes();
  auto row_of = [&](int64_t g) {
    return static_cast<const char*>(t.peer_buf(static_cast<int>(g / s.tokens), kDispX)) +
           (g % s.tokens) * rb;
  };
  auto routed_here = [&](int64_t g) {
    for (int64_t k = 0; k < K; ++k)
      if (slots[g * K + k] >= 0) return true;
    return false;
  };
  // Tokens in global order; the next routed token's row is prefetched during the first copy
  // of this one's.
  int64_t g = 0;
  while (g < N && !routed_here(g)) ++g;
  while (g < N) {
    int64_t gn = g + 1;
    while (gn < N && !routed_here(gn)) ++gn;
    const char* next = gn < N ? row_of(gn) : nullptr;
    const char* row = row_of(g);
    if (g / s.tokens != t.rank()) *peer_bytes += rb;  // read once, copied to each slot here
    const int32_t* sl = slots + g * K;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t slot = sl[k];
      if (slot < 0) continue;
      bool seen = false;  // a token naming one expert twice has one slot
      for (int64_t j = 0; j < k; ++j) seen |= sl[j] == slot;
      if (seen) continue;
      copy_bytes_stream_prefetch(out + slot * rb, row, rb, next);
      next = nullptr;  // prefetched once
    }
    g = gn;
  }
  copy_fence();  // the departure barrier publishes the rows (non-temporal stores are weak)
}

// Weighted (the cotangent of combine w.r.t. expert_y): slot row = (sum of the token's weights
// naming the slot's expert) * x row. The source row is read once into an accumulator-typed
// buffer, then scaled into each slot.
template <class T>
void dispatch_weighted(Team& t, const MoeShape& s, const int32_t* slots, char* out,
                       uint64_t* peer_bytes) {
  using Acc = typename Elem<T>::Acc;
  const int64_t N = s.ranks * s.tokens, K = s.topk, H = s.hidden, rb = s.row_bytes();
  std::vector<Acc> row(H);
  for (int64_t g = 0; g < N; ++g) {
    const int32_t* sl = slots + g * K;
    bool any = false;
    for (int64_t k = 0; k < K; ++k) any |= sl[k] >= 0;
    if (!any) continue;
    const int src = static_cast<int>(g / s.tokens);
    const int64_t tok = g % s.tokens;
    if (src != t.rank()) *peer_bytes += rb;
    const char* x = static_cast<const char*>(t.peer_buf(src, kDispX));
    load_row<T>(row.data(), reinterpret_cast<const T*>(x + tok * rb), H);
    const Acc* w = static_cast<const Acc*>(t.peer_buf(src, kDispWeights)) + tok * K;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t slot = sl[k];
      if (slot < 0) continue;
      bool seen = false;  // a token naming one expert twice: its slot gets the summed weight
      for (int64_t j = 0; j < k; ++j) seen |= sl[j] == slot;
      if (seen) continue;
      Acc wsum = 0;
      for (int64_t j = k; j < K; ++j)
        if (sl[j] == slot) wsum += static_cast<Acc>(w[j]);
      store_scaled<T>(reinterpret_cast<T*>(out + slot * rb), row.data(), wsum, H);
    }
  }
}

}  // namespace

bool row_dtype_supported(int32_t dtype) {
  switch (static_cast<DT>(dtype)) {
    case DT::F32:
    case DT::F64:
    case DT::BF16:
    case DT::F16:
      return true;
    default:
      return false;
  }
}

std::string dispatch(Team& t, const MoeShape& s, const int32_t* slots, const int32_t* counts,
                     bool weighted, void* out_v, uint64_t* peer_bytes) {
  char* out = static_cast<char*>(out_v);
  const int64_t rb = s.row_bytes();
  // Rows of expert e are [0, counts[e]) by construction of the plan; zero the rest first so
  // the copies below stay the only writes of the used rows (non-temporal stores: the unused
  // rows are often a third of the buffer, and a cached memset reads every line first).
  for (int64_t e = 0; e < s.local_experts; ++e) {
    int64_t used = counts[e];
    if (used < 0 || used > s.capacity)
      return "strata_jax moe.dispatch: internal error: receive count out of range";
    zero_bytes(out + (e * s.capacity + used) * rb, (s.capacity - used) * rb);
  }
  if (weighted) {
    with_row_type(
        s.dtype, [&](auto tag) { dispatch_weighted<decltype(tag)>(t, s, slots, out, peer_bytes); });
    copy_fence();  // the zeroing above used non-temporal stores
  } else {
    dispatch_copy(t, s, slots, out, peer_bytes);
  }
  return {};
}

}  // namespace moe
}  // namespace strata
