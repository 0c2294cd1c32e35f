// What the handlers of the collectives share (handlers.cc: the forms inside one fabric;
// hier_handlers.cc: the two-fabric forms of the hierarchical collectives): one call's way
// through the fabric, the checks every call makes, and the operators' implementations that
// several forms call with their own arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "coll/kernels.h"
#include "common/ops.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"
#include "fabric/stats.h"
#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace strata {

// `peers_write`: the algorithm writes into the peers' outputs, which the low-latency path of the
// shared-memory fabric (shm_ll.h: slots hold copies of the inputs only) does not offer.
// `block` (optional): the call's per-source copy (team, src) for InProcTeam::arrive_pairs.
template <class Body, class Block = std::nullptr_t>
xla::ffi::Error run_collective(const char* name, xla::ffi::RunId run, int64_t op_id,
                               xla::ffi::AnyBuffer pid, const GroupAttrs& ga, OpDesc desc,
                               const void* in, void* out, Body body, bool peers_write = false,
                               Block block = nullptr) {
  Placement pl;
  std::string err = placement(pid, ga, &pl);
  if (!err.empty()) return to_error(std::string("strata_jax ") + name + ": " + err);
  // Nothing to move. In one process every rank has the same shapes (one SPMD program), so all
  // skip together; across processes a rank's shapes may differ from its peers' (different
  // programs), so the call still meets them and a zero-vs-nonzero mismatch fails at once.
  if (desc.in_bytes == 0 && desc.out_bytes == 0 && !ShmFabric::active())
    return xla::ffi::Error::Success();
  desc.name = name;
  // The staged low-latency form (fabric/shm_ll.h) runs every algorithm one-shot from copies of
  // the inputs: for exchanges that costs one copy of the input; an all-reduce would read every
  // peer's whole input instead of a share of it (two-shot), and a broadcast would copy every
  // rank's input for the root's alone, so those take it only up to the slots' largest size.
  desc.may_stage =
      (desc.params.form != Target::all_reduce && desc.params.form != Target::pbroadcast) ||
      desc.in_bytes <= kLlMaxBytes;
  stats().calls.fetch_add(1, std::memory_order_relaxed);
  OpTimer timer(name, desc.in_bytes, desc.algo);  // comm_stats()["ops"] (fabric/op_stats.h)
  if constexpr (!std::is_same_v<Block, std::nullptr_t>) {
    if (!ShmFabric::active() && pairs_in_process(desc, pl.size))
      return join_and_run_pairs(name, run.run_id, op_id, pl, desc, in, out,
                                [&](Team& t, int src) { return block(t, pl, src); });
  }
  return join_and_run(
      name, run.run_id, op_id, pl, desc, in, out, /*cross_process=*/true,
      [&](Team& t) { return body(t, pl); }, /*may_ll=*/!peers_write);
}

inline xla::ffi::Error check_dtype(const char* name, xla::ffi::AnyBuffer x, bool reduce,
                                   ReduceOp op) {
  namespace ffi = xla::ffi;
  const int32_t dt = static_cast<int32_t>(x.element_type());
  if (dtype_size(dt) == 0 || (reduce && !reduce_supported(dt, op)))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("strata_jax ") + name + ": unsupported dtype " + dtype_name(dt));
  return ffi::Error::Success();
}

// Whether the algorithms may write into the peers' outputs: every team publishes them except
// the low-latency path of the shared-memory fabric (shm_ll.h: its slots hold copies of the
// inputs only). All ranks of a team are on the same path, so they all choose alike.
inline bool peers_publish_outputs(const Team& t) {
  return t.peer_out((t.rank() + 1) % t.size()) != nullptr;
}

// The number of sub-blocks per rank of a placement table with one row per group (1 without a
// table), and this group's row of it (nullptr: none) or an error when the table is not one row
// per group of permutations of [0, t.size() * parts) (handlers.cc).
int placement_parts(I64s placement, I64s groups, int64_t group_size);
std::string placement_row(I64s placement, I64s groups, const Team& t, const Placement& pl,
                          int parts, const char* name, const int64_t** row);

// The operators' implementations behind several forms (handlers.cc), each with the form the
// call came through (OpParams::form).
// psum_scatter: `placement` (empty: none) the input block of each (rank, sub-block) per group;
// `divert` (per partition; empty: none) the sub-block of this rank's output written to `y2`.
xla::ffi::Error psum_scatter_impl(Target form, xla::ffi::RunId run, xla::ffi::AnyBuffer x,
                                  xla::ffi::AnyBuffer pid, xla::ffi::Result<xla::ffi::AnyBuffer> y,
                                  int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                                  int32_t reduce, I64s placement, I64s divert = I64s(),
                                  void* y2 = nullptr, size_t y2_bytes = 0);
// all_gather: `placement` (empty: none) the output block of each (rank, sub-block) per group.
xla::ffi::Error all_gather_impl(Target form, xla::ffi::RunId run, xla::ffi::AnyBuffer x,
                                xla::ffi::AnyBuffer pid, xla::ffi::Result<xla::ffi::AnyBuffer> y,
                                int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                                I64s placement);
// all_to_all: with `divert` (per partition; empty: none) index divert[p] of the output's
// `divert_axis` goes to `y2` and the output is laid out with that axis at `move_to`.
xla::ffi::Error all_to_all_impl(Target form, xla::ffi::RunId run, xla::ffi::AnyBuffer x,
                                xla::ffi::AnyBuffer pid, xla::ffi::Result<xla::ffi::AnyBuffer> y,
                                int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                                int64_t split_axis, int64_t concat_axis, int64_t divert_axis = -1,
                                int64_t move_to = -1, I64s divert = I64s(), void* y2 = nullptr,
                                size_t y2_bytes = 0, I64s divert_dest = I64s());

}  // namespace strata
