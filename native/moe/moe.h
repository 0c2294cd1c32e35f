// MoE expert-parallel token movement over a Team: dispatch (tokens to the ranks of their
// experts) and combine (expert outputs back to the tokens' ranks, weighted and summed).
//
// The routing plan (which token goes to which expert slot, capacity drops) is computed in JAX
// before the call (strata_jax/moe/_dispatch.py); the native side only moves rows. This follows
// DeepEP's split into a layout phase and the data phases, with its traffic rules:
//   * dispatch: a token row crosses the fabric at most once per destination rank, however many
//     of its experts live there. The destination pulls it from the source rank's own XLA buffer
//     (zero-copy) into the first of its slots, then copies it locally into the other slots.
//   * combine: every expert rank first sums, per source token, the weighted rows of all its
//     local experts into one partial row (phase 1); after a barrier each source rank pulls one
//     partial row per destination rank and sums them (phase 2).
//
// Index conventions (N = R * T global tokens, g = source_rank * T + token):
//   slots   [N, K] int32, per destination rank: slots[g, k] = e_local * C + position of token g
//           in the local expert's rows for its k-th choice, or -1 (expert elsewhere, -1 choice,
//           dropped). A token naming one expert twice has both k pointing at the same slot.
//   counts  [E_local] int32: rows in use per local expert (they are rows [0, count)).
//   rows    [N] int32, per destination rank: the row of token g in this rank's combine
//           partials (tokens with a kept slot here numbered 0, 1, ... in g order), or -1.
//   topk_idx [T, K] int32, per source rank: the token's expert ids (-1 = none).
// Sources never need their own copy of the plan: they read the destinations' slots and rows
// (published with the buffers) where they need them.
#pragma once

#include <cstdint>
#include <string>

#include "fabric/team.h"

namespace strata {
namespace moe {

// What every rank publishes at arrival (Team::peer_in(j) points at rank j's MoeBufs, which
// lives on rank j's handler stack until its departure barrier). On the in-process fabric the
// pointers are directly usable; a cross-process Team must translate each of them through its
// registration table (they all point into XLA buffers of rank j).
struct MoeBufs {
  const void* x = nullptr;         // dispatch: [T, H] source rows
  // weighted dispatch and combine: [T, K] in the rows' accumulator type (float64 for float64
  // rows, float32 otherwise), so float64 models are weighted in float64.
  const void* weights = nullptr;
  const void* partials = nullptr;  // combine: [N, H] per-token partial sums (phase 1 output)
  const void* values = nullptr;    // gather: [E_local * C] float32 or float64 (s.dtype)
  const int32_t* slots = nullptr;  // combine, gather: this rank's slots plan [N, K]
  const int32_t* rows = nullptr;   // combine: this rank's rows plan [N]
};

struct MoeShape {
  int64_t ranks = 0;     // R
  int64_t tokens = 0;    // T per rank
  int64_t topk = 0;      // K
  int64_t hidden = 0;    // H
  int64_t local_experts = 0;  // E_local
  int64_t capacity = 0;  // C
  int32_t dtype = 0;     // xla::ffi::DataType of the rows
  int esize = 0;         // bytes per element
  int64_t row_bytes() const { return hidden * esize; }
};

// Supported row dtypes: float32, float64, bfloat16, float16.
bool row_dtype_supported(int32_t dtype);

// out[E_local, C, H] on this rank: slot rows filled from the sources' x (weighted: scaled by
// the sum of the token's weights that name the slot's expert, read from the source's
// weights), rows past counts[e] zeroed. Reads peers' MoeBufs::x (and ::weights).
std::string dispatch(Team& t, const MoeShape& s, const int32_t* slots, const int32_t* counts,
                     bool weighted, void* out);

// Phase 1: partials[rows[g]] = sum_k w_g[k] * expert_y[slots[g, k]] (weights read from the
// source); barrier; phase 2: y[t] = sum over ranks r, in rank order, of partials_r[rows_r[g]]
// for g = me * T + t. `partials` [J, H] is this rank's scratch and `slots`/`rows` its plan;
// all three must be the buffers published in MoeBufs.
std::string combine(Team& t, const MoeShape& s, const void* expert_y, const int32_t* slots,
                    const int32_t* rows, void* partials, void* y);

// out[T, K] (float32 or float64, as the values) = for each choice e = topk_idx[t, k] >= 0, the value of the token's slot on the
// expert's rank (read from that rank's MoeBufs::slots and ::values); 0 for -1 or dropped.
std::string gather_values(Team& t, const MoeShape& s, const int32_t* topk_idx, void* out);

}  // namespace moe
}  // namespace strata
