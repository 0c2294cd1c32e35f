// Ragged all-to-all (jax.lax.ragged_all_to_all) over a Team.
//
// Every rank publishes two buffers with Team::arrive_multi: its operand (buffer kRaggedOperand)
// and its plan (kRaggedPlan), an int64 [4, K] block holding input_offsets, send_sizes,
// output_offsets and recv_sizes (K = group size * slices per peer). The receiver pulls: rank r
// reads, for every peer j and every slice s, the rows
//   operand_j[input_offsets_j[r*S + s] : + send_sizes_j[r*S + s]]
// straight from peer j's operand into its own result at output_offsets_j[r*S + s]. No staging
// copy; the result is the (aliased) `output` operand, so rows nobody writes keep its values.
// Pulling means each rank only writes its own memory: no two ranks ever write one buffer, and
// the only cross-rank ordering needed is the arrival barrier (operands and plans published)
// and the departure barrier (nobody reads a peer that has already left).
#pragma once

#include <cstdint>
#include <string>

#include "fabric/team.h"

namespace strata {

constexpr int kRaggedOperand = 0;
constexpr int kRaggedPlan = 1;
constexpr int kRaggedBufs = 2;

struct RaggedShape {
  int64_t operand_rows = 0;  // N (equal on every rank: checked through OpDesc)
  int64_t output_rows = 0;   // M
  uint64_t row_bytes = 0;    // bytes of one leading-axis row (same for operand and output)
  int64_t slices = 0;        // K, a multiple of the group size
  // Optional [4, K] per-slice row bounds (operand lo, hi; output lo, hi), set when vmap merged
  // a batch into the rows: each slice must stay inside its own batch element's rows.
  const int64_t* bounds = nullptr;
};

// Pulls this rank's received slices into `result` (which already holds `output`). First checks
// every rank's plan (bounds, each send size equal to the receiver's recv size) in one fixed
// order, so a fault gives the same error on every rank and nothing is written anywhere.
// *peer_bytes (optional) gets the bytes read from other ranks' operands.
std::string ragged_all_to_all(Team& t, const RaggedShape& s, char* result,
                              uint64_t* peer_bytes = nullptr);

// What a rank publishes on the in-process pairs path (InProcTeam::arrive_pairs: one pointer per
// rank), in its own frame, which outlives every copy from it.
struct RaggedPub {
  const void* operand = nullptr;
  const int64_t* plan = nullptr;  // int64 [4, K]
};

// The pairs path's block: checks sender j's slices to rank r against r's plan (`my_plan`; the
// same checks as ragged_all_to_all, on this pair alone) and copies them into r's `result`;
// *moved gets the bytes copied. A fault of another pair may be reported by another rank first
// (the call fails on every rank with the first fault found).
std::string ragged_block(const RaggedShape& s, const RaggedPub& from, const int64_t* my_plan, int j,
                         int r, int n, char* result, uint64_t* moved);

}  // namespace strata
