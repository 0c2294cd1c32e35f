// The operators of strata_jax: one table that every layer derives from.
//
// STRATA_OPERATORS(X) lists one row per operator:
//   X(id, api, lax, target, stats, algorithms, reduce)
//   id          the operator's one name: its kind Op::id (compared at every rendezvous), its
//               primitive and FFI target strata_<target>
//   api         what a user calls: strata_jax.<api> ("moe.dispatch": strata_jax.moe.dispatch)
//   lax         the jax.lax primitives it runs under use_for_jax_lax() (space-separated; "":
//               none), which strata_jax/_src/lax_hooks.py hooks
//   target      its FFI target without the "strata_" prefix (the all-reduces share one and
//               tell themselves apart by their `reduce`)
//   stats       its name in comm_stats()["ops"]
//   algorithms  what comm_stats() splits its calls by: "one_shot two_shot" (the all-reduce's
//               algorithm, chosen per call) or "direct"
//   reduce      the reduction it computes (a kind of STRATA_REDUCTIONS), none otherwise
// The extension hands the table to Python (strata_jax._strata.operators(), read by
// strata_jax/_src/operators.py), which registers the FFI targets, hooks jax.lax, records
// coverage and lists the operators in the docs from it; here it becomes the kinds (enum Op) and
// the names comm_stats() counts under (fabric/op_stats.cc). A new operator is a row here.
//
// STRATA_REDUCTIONS(X) lists the reductions the all-reduce and psum_scatter kernels compute, one
// row each, in the order of their codes (ReduceOp, from 0: the `reduce` attribute of a call):
//   X(kind, name, element)
//   kind     its name in the operator rows and in the JAX primitives' `reduce` parameter
//   name     its ReduceOp enumerator (the kernels of coll/ switch on it)
//   element  the jax.lax primitive that combines two elements (<element>_p), which the
//            hierarchical forms apply between fabrics
//
// STRATA_TARGETS(X) lists every FFI target with its handler (what XLA calls):
//   X(target, handler)   registered as "strata_<target>" (native/python/module.cc)
// An operator's forms (the rows, placed and two-fabric variants of psum_scatter, say) are
// targets of their own; their calls carry the form (OpParams::form) so that ranks calling two
// forms of one operator fail instead of mixing them. The last targets make no rendezvous.
#pragma once

#include <cstdint>
#include <string>

// clang-format off
#define STRATA_OPERATORS(X)                                                                        \
  X(psum, "psum", "psum psum_invariant unreduced_psum", "all_reduce", "psum",                      \
    "one_shot two_shot", sum)                                                                      \
  X(pmax, "pmax", "pmax", "all_reduce", "pmax", "one_shot two_shot", max)                          \
  X(pmin, "pmin", "pmin", "all_reduce", "pmin", "one_shot two_shot", min)                          \
  X(pmean, "pmean", "", "all_reduce", "pmean", "one_shot two_shot", mean)                          \
  X(pprod, "pprod", "", "all_reduce", "pprod", "one_shot two_shot", prod)                          \
  X(all_gather, "all_gather", "all_gather all_gather_invariant all_gather_reduced", "all_gather",  \
    "all_gather", "direct", none)                                                                  \
  X(psum_scatter, "psum_scatter", "reduce_scatter unreduced_reduce_scatter", "psum_scatter",       \
    "psum_scatter", "direct", none)                                                                \
  X(all_to_all, "all_to_all", "all_to_all", "all_to_all", "all_to_all", "direct", none)            \
  X(ppermute, "ppermute", "ppermute", "ppermute", "ppermute", "direct", none)                      \
  X(pbroadcast, "pbroadcast", "pbroadcast", "pbroadcast", "pbroadcast", "direct", none)            \
  X(ragged_all_to_all, "ragged_all_to_all", "ragged_all_to_all", "ragged_all_to_all",              \
    "ragged_all_to_all", "direct", none)                                                           \
  X(moe_dispatch, "moe.dispatch", "", "moe_dispatch", "moe.dispatch", "direct", none)              \
  X(moe_combine, "moe.combine", "", "moe_combine", "moe.combine", "direct", none)                  \
  X(moe_gather, "moe.combine", "", "moe_gather", "moe.combine (weights cotangent)", "direct",      \
    none)                                                                                          \
  X(moe_low_latency_dispatch, "moe.low_latency_dispatch", "", "moe_low_latency_dispatch",          \
    "moe.low_latency_dispatch", "direct", none)                                                    \
  X(moe_low_latency_combine, "moe.low_latency_combine", "", "moe_low_latency_combine",             \
    "moe.low_latency_combine", "direct", none)

#define STRATA_REDUCTIONS(X) \
  X(sum, kSum, add)          \
  X(max, kMax, max)          \
  X(min, kMin, min)          \
  X(mean, kMean, add)        \
  X(prod, kProd, mul)

#define STRATA_TARGETS(X)                                             \
  X(all_reduce, AllReduceHandler)                                     \
  X(all_reduce_list, AllReduceListHandler)                            \
  X(all_gather, AllGatherHandler)                                     \
  X(all_gather_rows, AllGatherRowsHandler)                            \
  X(all_gather_placed, AllGatherPlacedHandler)                        \
  X(all_gather_part, AllGatherPartHandler)                            \
  X(all_gather_part_into, AllGatherPartIntoHandler)                   \
  X(all_gather_reduce, AllGatherReduceHandler)                        \
  X(psum_scatter, PsumScatterHandler)                                 \
  X(psum_scatter_rows, PsumScatterRowsHandler)                        \
  X(psum_scatter_placed, PsumScatterPlacedHandler)                    \
  X(psum_scatter_placed_divert, PsumScatterPlacedDivertHandler)       \
  X(all_to_all, AllToAllHandler)                                      \
  X(all_to_all_divert, AllToAllDivertHandler)                         \
  X(ppermute, PpermuteHandler)                                        \
  X(pbroadcast, PbroadcastHandler)                                    \
  X(ragged_all_to_all, RaggedAllToAllHandler)                         \
  X(moe_dispatch, MoeDispatchHandler)                                 \
  X(moe_combine, MoeCombineHandler)                                   \
  X(moe_gather, MoeGatherHandler)                                     \
  X(moe_low_latency_dispatch, MoeLowLatencyDispatchHandler)           \
  X(moe_low_latency_combine, MoeLowLatencyCombineHandler)             \
  X(moe_plan, MoePlanHandler)                                         \
  X(empty, EmptyHandler)                                              \
  X(count_inter_fabric, CountInterFabricHandler)                      \
  X(check_across_fabrics, CheckAcrossFabricsHandler)                  \
  X(order, OrderHandler)
// clang-format on

namespace strata {

// The reductions, in table order from 0 (kMean: the sum over the n sources divided by n, on
// floating types only; coll/kernels.h says how it rounds).
enum class ReduceOp : int32_t {
#define STRATA_REDUCE_ENUM(kind, name, element) name,
  STRATA_REDUCTIONS(STRATA_REDUCE_ENUM)
#undef STRATA_REDUCE_ENUM
};
constexpr int32_t kReductions = 0
#define STRATA_REDUCE_COUNT(kind, name, element) +1
    STRATA_REDUCTIONS(STRATA_REDUCE_COUNT)
#undef STRATA_REDUCE_COUNT
    ;
// The code of a reduction by its kind (reduce_code::max is ReduceOp::kMax's), as the operator
// rows name it; reduce_code::none (-1) for an operator that does not reduce.
namespace reduce_code {
enum : int32_t {
  none = -1,
#define STRATA_REDUCE_CODE(kind, name, element) kind = static_cast<int32_t>(ReduceOp::name),
  STRATA_REDUCTIONS(STRATA_REDUCE_CODE)
#undef STRATA_REDUCE_CODE
};
}  // namespace reduce_code

// The operators' kinds, in table order from 1 (0: none).
enum class Op : int32_t {
  none = 0,
#define STRATA_OP_ENUM(id, api, lax, target, stats, algorithms, reduce) id,
  STRATA_OPERATORS(STRATA_OP_ENUM)
#undef STRATA_OP_ENUM
};

// The FFI targets, in table order from 1: the form of a call (OpParams::form).
enum class Target : int32_t {
  none = 0,
#define STRATA_TARGET_ENUM(target, handler) target,
  STRATA_TARGETS(STRATA_TARGET_ENUM)
#undef STRATA_TARGET_ENUM
};

// The row of an operator, as the table spells it.
struct OpInfo {
  Op op;
  const char* id;
  const char* api;
  const char* lax;
  const char* target;
  const char* stats;
  const char* algorithms;
  int32_t reduce;  // a ReduceOp code, -1: none
};
// Every operator, in table order; `count` receives their number.
const OpInfo* op_table(int* count);
// The row of `op` (the row of Op::none is all empty strings).
const OpInfo& op_info(Op op);
// The all-reduce operator of a ReduceOp code (psum for 0 ...); Op::none for another code.
Op op_of_reduce(int32_t reduce);

// What a call's operator takes besides its buffers and their sizes, compared across the ranks
// of a call like the shapes: a rank whose call differs in any of these fails at arrival instead
// of running with another rank's plan. Unused fields stay at their defaults.
struct OpParams {
  Target form = Target::none;  // the FFI target (the operator's form) the call came through
  int64_t root = -1;           // pbroadcast: the source rank
  int64_t split_axis = -1, concat_axis = -1;  // all_to_all
  int64_t divert_axis = -1, move_to = -1;     // all_to_all across two fabrics
  int64_t dimension = -1;                     // the rows forms of all_gather and psum_scatter
  int64_t parts = 0;                          // the placed forms: sub-blocks per rank
  int64_t part = -1;                          // all_gather_part: the sub-block this call writes
  int64_t topk = 0;                           // MoE: choices per token
  int64_t weighted = 0;                       // moe_dispatch: weights applied on the way
  int64_t push = 0;        // moe_low_latency_dispatch: sources write (1) or destinations pull
  int64_t max_tokens = 0;  // the low-latency MoE pair: rows per source rank
  int64_t slices = 0;      // ragged_all_to_all: slices of the plan
  uint64_t signature = 0;  // a hash: ppermute's sources, all_reduce_list's operands
  bool operator==(const OpParams& o) const;
  bool operator!=(const OpParams& o) const { return !(*this == o); }
  // The fields set, named: "form all_to_all, split_axis 1, concat_axis 0".
  std::string describe() const;
  // A 64-bit hash of every field (FNV-1a), non-zero: what the shared-memory fabric publishes
  // for its peers to compare, in the place of the whole struct.
  uint64_t digest() const;
};

}  // namespace strata
