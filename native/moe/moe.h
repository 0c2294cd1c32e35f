// MoE expert-parallel token movement over a Team: dispatch (tokens to the ranks of their
// experts) and combine (expert outputs back to the tokens' ranks, weighted and summed).
//
// The routing plan (which token goes to which expert slot, capacity drops) is computed in JAX
// before the call (strata_jax/moe/_dispatch.py); the native side only moves rows. This follows
// DeepEP's split into a layout phase and the data phases, with its traffic rules:
//   * dispatch: a token row crosses the fabric at most once per destination rank, however many
//     of its experts live there. The destination pulls it from the source rank's own XLA buffer
//     (zero-copy) into the first of its slots, then copies it locally into the other slots.
//   * combine: every source rank pulls, for each of its tokens, the expert rows of the token's
//     kept choices straight from the expert ranks' own expert_y buffers (zero-copy), weights
//     them with its own weights and sums them: one pass, no intermediate buffer, no barrier
//     between phases. Inside one fabric every rank reads every peer's memory at the same cost
//     as its own, so DeepEP's two-phase combine (expert ranks pre-sum per token, then the
//     source pulls one partial row per rank) only adds a write and a read of the partial rows
//     and a barrier: it measured 2x the time of this one. Across fabrics the pre-sum is what
//     saves link bytes, and the hierarchical lowering does it (strata_jax/_src/hierarchy/).
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

// The buffers every rank publishes at arrival (Team::arrive_multi), by index for
// Team::peer_buf(j, i). peer_buf translates each into this process's address space, so the same
// kernels run on the in-process and the shared-memory fabric.
enum DispatchBuf : int {
  kDispX = 0,        // [T, H] source rows
  kDispWeights = 1,  // weighted only: [T, K] in the rows' accumulator type (f64 for f64 rows,
                     // f32 otherwise), so float64 models are weighted in float64
  kDispBufs = 2,
};
enum CombineBuf : int {
  kCombExpertY = 0,  // [E_local, C, H] the owner's expert outputs, read by the tokens' ranks
  kCombSlots = 1,    // [N, K] int32: the owner's slots plan
  kCombBufs = 2,
};
enum GatherBuf : int {
  kGathValues = 0,  // [E_local * C] float32 or float64 (s.dtype)
  kGathSlots = 1,   // [N, K] int32: the owner's slots plan
  kGathBufs = 2,
};

struct MoeShape {
  int64_t ranks = 0;          // R
  int64_t tokens = 0;         // T per rank
  int64_t topk = 0;           // K
  int64_t hidden = 0;         // H
  int64_t local_experts = 0;  // E_local
  int64_t capacity = 0;       // C
  int32_t dtype = 0;          // xla::ffi::DataType of the rows
  int esize = 0;              // bytes per element
  int64_t row_bytes() const { return hidden * esize; }
};

// Supported row dtypes: float32, float64, bfloat16, float16.
bool row_dtype_supported(int32_t dtype);

// out[E_local, C, H] on this rank: slot rows filled from the sources' x (weighted: scaled by
// the sum of the token's weights that name the slot's expert, read from the source's
// weights), rows past counts[e] zeroed. Reads the peers' kDispX (and kDispWeights).
// *peer_bytes: the bytes of rows read from other ranks' buffers (for memory_stats()).
std::string dispatch(Team& t, const MoeShape& s, const int32_t* slots, const int32_t* counts,
                     bool weighted, void* out, uint64_t* peer_bytes);

// y[t] = sum over expert ranks r in rank order and, within one, k in order, of w[t, k] *
// expert_y_r[slots_r[g, k]] where slots_r[g, k] >= 0 (g = me * T + t), accumulated in the rows'
// accumulator type and rounded once. Reads the peers' kCombExpertY and kCombSlots; `w` [T, K]
// is this rank's weights in the accumulator type.
// *peer_bytes: the bytes of rows read from other ranks' buffers.
std::string combine(Team& t, const MoeShape& s, const void* w, void* y, uint64_t* peer_bytes);

// out[T, K] (float32 or float64, as the values) = for each choice e = topk_idx[t, k] >= 0, the
// value of the token's slot on the expert's rank (read from that rank's kGathSlots and
// kGathValues); 0 for -1 or dropped.
std::string gather_values(Team& t, const MoeShape& s, const int32_t* topk_idx, void* out);

// ---- Low-latency mode (DeepEP's low_latency_dispatch/combine, for decode) ----
// Static shapes for any routing: recv [E_local, R * M, H] (M = max tokens per rank >= T), so
// no capacity plan and no planning collective. Every rank publishes its x and sanitized
// topk_idx at arrival; after that one synchronisation every rank derives from the published
// ids what it needs (its receive counts, and where each of its own choices lands on the
// expert's rank), so the counts travel with the data. Rows of local expert e are packed in
// (source rank, source token) order, as in the normal mode; rows past counts[e] are zeroed.
enum LowLatencyDispatchBuf : int {
  kLLX = 0,     // [T, H] source rows
  kLLIdx = 1,   // [T, K] int32 sanitized expert ids (-1 = none)
  kLLRecv = 2,  // [E_local, R * M, H] this rank's receive buffer (written by the sources
                // when pushing, by its owner when pulling)
  kLLDispBufs = 3,
};
enum LowLatencyCombineBuf : int {
  kLLExpertY = 0,  // [E_local, R * M, H] expert outputs, read by the tokens' ranks
  kLLCombBufs = 1,
};

// out [E_local, R * M, H], counts [E_local], src_slots [T, K] (row of each of this rank's
// choices in the expert rank's flattened [E_local * R * M] rows; -1 for -1 choices; a repeated
// expert points at the same row). push: every source writes its rows into the destinations'
// published kLLRecv buffers; else every destination pulls them from the sources' kLLX.
// *peer_bytes: the bytes of rows read from (pull) or written to (push) other ranks' buffers.
std::string low_latency_dispatch(Team& t, const MoeShape& s, int64_t max_tokens, bool push,
                                 void* out, int32_t* counts, int32_t* src_slots,
                                 uint64_t* peer_bytes);

// y[t] = sum_k w[t, k] * expert_y_owner(k)[src_slots[t, k]] (k in order, accumulated in the
// rows' accumulator type): this rank pulls its tokens' expert rows from the expert ranks'
// published kLLExpertY. Weights are read locally; a repeated expert adds its row once per
// choice, i.e. with the summed weight. w is [T, K] in the rows' accumulator type.
// *peer_bytes: the bytes of rows read from other ranks' buffers.
std::string low_latency_combine(Team& t, const MoeShape& s, int64_t max_tokens, const void* w,
                                const int32_t* topk_idx, const int32_t* src_slots, void* y,
                                uint64_t* peer_bytes);

}  // namespace moe
}  // namespace strata
