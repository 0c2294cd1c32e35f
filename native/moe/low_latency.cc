// Low-latency dispatch/combine (DeepEP's low-latency mode, for decode): static receive buffers
// [E_local, R * M, H], one arrival per phase, no planning collective. Every rank reads the
// published [T, K] ids of all ranks (R * T * K int32: a few KiB at decode sizes) and derives its
// receive counts and its choices' rows itself, which is cheaper than a separate all_gather
// round (two more barriers) at T = 1..128.
#include <algorithm>
#include <cstring>
#include <vector>

#include "coll/kernels.h"
#include "moe/moe.h"
#include "moe/rows.h"

namespace strata {
namespace moe {
namespace {

// Choice k of a token is the first occurrence of a valid expert (in [0, E)) among its K ids.
// (Python sanitizes the ids; the range check keeps a bad id from indexing out of bounds.)
inline bool first_choice(const int32_t* ids, int64_t k, int64_t E) {
  if (ids[k] < 0 || ids[k] >= E) return false;
  for (int64_t j = 0; j < k; ++j)
    if (ids[j] == ids[k]) return false;
  return true;
}

const int32_t* ids_of(Team& t, int r) { return static_cast<const int32_t*>(t.peer_buf(r, kLLIdx)); }

}  // namespace

std::string low_latency_dispatch(Team& t, const MoeShape& s, int64_t max_tokens, bool push,
                                 void* out_v, int32_t* counts, int32_t* src_slots,
                                 uint64_t* peer_bytes) {
  const int R = t.size(), me = t.rank();
  const int64_t T = s.tokens, K = s.topk, El = s.local_experts, E = El * R;
  const int64_t rows_per_expert = R * max_tokens, rb = s.row_bytes();
  char* out = static_cast<char*>(out_v);

  // Next free row of every expert (global id) as seen from this rank's position in the
  // (source rank, token) order: tokens of ranks before me first.
  std::vector<int64_t> next(E, 0);
  for (int r = 0; r < me; ++r) {
    const int32_t* ids = ids_of(t, r);
    for (int64_t i = 0; i < T * K; ++i)
      if (first_choice(ids + (i / K) * K, i % K, E)) ++next[ids[i]];
  }
  // This rank's own choices: their rows on the experts' ranks (and, pushing, the rows).
  const int32_t* my_ids = ids_of(t, me);
  const char* my_x = static_cast<const char*>(t.peer_buf(me, kLLX));
  for (int64_t tok = 0; tok < T; ++tok) {
    const int32_t* ids = my_ids + tok * K;
    for (int64_t k = 0; k < K; ++k) {
      int32_t slot = -1;
      if (first_choice(ids, k, E)) {
        const int32_t e = ids[k];
        const int64_t pos = next[e]++;
        if (pos >= rows_per_expert)
          return "strata_jax moe.low_latency_dispatch: internal error: receive row out of range";
        slot = static_cast<int32_t>((e % El) * rows_per_expert + pos);
        if (push) {
          char* dst = static_cast<char*>(const_cast<void*>(t.peer_buf(e / El, kLLRecv)));
          copy_bytes(dst + slot * rb, my_x + tok * rb, rb);
          if (e / El != me) *peer_bytes += rb;
        }
      } else if (ids[k] >= 0 && ids[k] < E) {
        for (int64_t j = 0; j < k; ++j)
          if (ids[j] == ids[k]) slot = src_slots[tok * K + j];
      }
      src_slots[tok * K + k] = slot;
    }
  }

  // This rank as a destination: counts (and, pulling, the rows) of its local experts over all
  // sources in (rank, token) order; a token's row crosses the fabric once per destination.
  std::fill(counts, counts + El, 0);
  const int64_t lo = static_cast<int64_t>(me) * El;
  for (int r = 0; r < R; ++r) {
    const int32_t* ids_r = ids_of(t, r);
    const char* x_r = push ? nullptr : static_cast<const char*>(t.peer_buf(r, kLLX));
    for (int64_t tok = 0; tok < T; ++tok) {
      const int32_t* ids = ids_r + tok * K;
      int64_t first = -1;
      for (int64_t k = 0; k < K; ++k) {
        if (!first_choice(ids, k, E) || ids[k] < lo || ids[k] >= lo + El) continue;
        const int64_t le = ids[k] - lo;
        const int64_t slot = le * rows_per_expert + counts[le]++;
        if (push) continue;
        if (first < 0) {
          copy_bytes(out + slot * rb, x_r + tok * rb, rb);
          if (r != me) *peer_bytes += rb;
          first = slot;
        } else {
          copy_bytes(out + slot * rb, out + first * rb, rb);
        }
      }
    }
  }
  // Rows past the counts are zeroed (the normal mode's contract). Left as they were, they hold
  // stale floats (denormals, NaN) that the experts then compute on: one serve_moe.py prefill
  // went from 329 to 246 ms when they were masked (loaded machine, one run each), and a NaN
  // there would poison any reduction over all rows. Sources never write past the counts, so
  // this does not race with pushes.
  // When pushing, this rank's receive buffer is where the peers see it (a bounce buffer when
  // the fabric staged it, copied back over `out` at departure): zero it there.
  char* mine = push ? static_cast<char*>(const_cast<void*>(t.peer_buf(me, kLLRecv))) : out;
  for (int64_t le = 0; le < El && rb > 0; ++le)
    zero_bytes(mine + (le * rows_per_expert + counts[le]) * rb,
               (rows_per_expert - counts[le]) * rb);
  // Non-temporal stores are weakly ordered: fence before the departure barrier publishes them.
  copy_fence();
  return {};
}

namespace {
template <class T>
void ll_combine_typed(Team& t, const MoeShape& s, int64_t max_tokens, const void* w_v,
                      const int32_t* topk_idx, const int32_t* src_slots, T* y,
                      uint64_t* peer_bytes) {
  using Acc = typename Elem<T>::Acc;
  const int64_t K = s.topk, H = s.hidden, El = s.local_experts;
  const Acc* w = static_cast<const Acc*>(w_v);
  std::vector<const T*> ey(t.size());
  for (int r = 0; r < t.size(); ++r) ey[r] = static_cast<const T*>(t.peer_buf(r, kLLExpertY));
  // A token's expert rows and weights in the normal mode's order (combine.cc): expert ranks
  // ascending, a rank's choices in k order. Both modes then sum a token's rows in one order and
  // give bitwise the same y (the order matters in floating point: 1e8 + -1e8 + 1 is not
  // 1 + 1e8 + -1e8). At most K rows: an insertion by owner rank, stable for equal owners.
  const int me = t.rank();
  std::vector<int> owner_of(K);
  auto sources = [&](int64_t tok, const T** rows, Acc* wts) {
    int64_t m = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t slot = src_slots[tok * K + k];
      if (slot < 0) continue;
      const int owner = topk_idx[tok * K + k] / El;
      if (owner != me) *peer_bytes += H * sizeof(T);
      int64_t at = m++;
      for (; at > 0 && owner_of[at - 1] > owner; --at) {
        rows[at] = rows[at - 1];
        wts[at] = wts[at - 1];
        owner_of[at] = owner_of[at - 1];
      }
      rows[at] = ey[owner] + int64_t(slot) * H;
      wts[at] = static_cast<Acc>(w[tok * K + k]);
      owner_of[at] = owner;
    }
    return m;
  };
  std::vector<const T*> rows(K), next_rows(K);
  std::vector<Acc> wts(K), next_wts(K);
  int64_t m = s.tokens > 0 ? sources(0, rows.data(), wts.data()) : 0;
  for (int64_t tok = 0; tok < s.tokens; ++tok) {
    const int64_t mn = tok + 1 < s.tokens ? sources(tok + 1, next_rows.data(), next_wts.data()) : 0;
    weighted_sum_rows<T>(y + tok * H, rows.data(), wts.data(), m, H, next_rows.data(), mn);
    std::swap(rows, next_rows);
    std::swap(wts, next_wts);
    m = mn;
  }
}
}  // namespace

std::string low_latency_combine(Team& t, const MoeShape& s, int64_t max_tokens, const void* w,
                                const int32_t* topk_idx, const int32_t* src_slots, void* y,
                                uint64_t* peer_bytes) {
  with_row_type(s.dtype, [&](auto tag) {
    using T = decltype(tag);
    ll_combine_typed<T>(t, s, max_tokens, w, topk_idx, src_slots, static_cast<T*>(y), peer_bytes);
  });
  return {};
}

}  // namespace moe
}  // namespace strata
