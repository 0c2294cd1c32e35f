// XLA FFI handler of strata_jax.ragged_all_to_all: operands (operand [N, ...], output [M, ...]
// aliased to the result, plan s64 [4, K], partition id), one result [M, ...].
#include <cstring>
#include <string>
#include <vector>

#include "coll/kernels.h"
#include "coll/ragged.h"
#include "fabric/stats.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_jax ragged_all_to_all: " + what);
}

ffi::Error RaggedAllToAllImpl(ffi::RunId run, ffi::AnyBuffer operand, ffi::AnyBuffer output,
                              ffi::AnyBuffer plan, ffi::AnyBuffer pid, After,
                              ffi::Result<ffi::AnyBuffer> result, Done, int64_t op_id, I64s groups,
                              int64_t group_size, I64s device_ids, I64s bounds) {
  const int32_t dt = static_cast<int32_t>(operand.element_type());
  if (dtype_size(dt) == 0) return invalid(std::string("unsupported dtype ") + dtype_name(dt));
  auto od = operand.dimensions(), md = output.dimensions(), pd = plan.dimensions();
  if (od.size() < 1 || md.size() != od.size() || output.element_type() != operand.element_type() ||
      result->element_type() != output.element_type() ||
      result->size_bytes() != output.size_bytes() || plan.element_type() != ffi::DataType::S64 ||
      pd.size() != 2 || pd[0] != 4)
    return invalid("internal error: operand shapes or dtypes do not match the lowering");
  for (size_t d = 1; d < od.size(); ++d)
    if (od[d] != md[d]) return invalid("operand and output rows differ in shape");
  Placement pl;
  // axis_index_groups are folded into `groups` at lowering time: each index group of each
  // axis group is a team of its own.
  std::string err = placement(pid, GroupAttrs{groups, group_size, device_ids}, &pl);
  if (!err.empty()) return invalid(err);
  RaggedShape s;
  s.operand_rows = od[0];
  s.output_rows = md[0];
  s.slices = pd[1];
  s.row_bytes = s.output_rows ? output.size_bytes() / s.output_rows
                              : (s.operand_rows ? operand.size_bytes() / s.operand_rows : 0);
  if (s.slices % pl.size)
    return invalid("the number of slices is not a multiple of the group size");
  if (bounds.size() == static_cast<size_t>(4 * s.slices))
    s.bounds = bounds.begin();
  else if (bounds.size() != 1)
    return invalid("internal error: bounds do not match the plan");
  char* res = static_cast<char*>(result->untyped_data());
  // The result starts as `output`: XLA aliases them, so normally there is nothing to copy.
  if (res != output.untyped_data() && output.size_bytes())
    std::memcpy(res, output.untyped_data(), output.size_bytes());
  stats().calls.fetch_add(1, std::memory_order_relaxed);
  if (pl.size == 1) {  // a group of one: the own slices only, no rendezvous
    struct Self final : Team {
      const void* bufs[kRaggedBufs];
      int rank() const override { return 0; }
      int size() const override { return 1; }
      const void* peer_in(int) const override { return nullptr; }
      void* peer_out(int) const override { return nullptr; }
      const void* peer_buf(int, int i) const override { return bufs[i]; }
      const OpDesc& peer_desc(int) const override { return desc; }
      std::string barrier(const char*) override { return ""; }
      OpDesc desc;
    } self;
    self.bufs[kRaggedOperand] = operand.untyped_data();
    self.bufs[kRaggedPlan] = plan.untyped_data();
    err = ragged_all_to_all(self, s, res);
    return err.empty() ? ffi::Error::Success() : invalid(err);
  }
  OpDesc d = make_desc(Op::ragged_all_to_all, Target::ragged_all_to_all, dt, operand.size_bytes(),
                       output.size_bytes());
  d.name = "ragged_all_to_all";
  d.params.slices = s.slices;
  BufRef bufs[kRaggedBufs];
  bufs[kRaggedOperand] = BufRef{operand.untyped_data(), operand.size_bytes(), false};
  bufs[kRaggedPlan] = BufRef{plan.untyped_data(), plan.size_bytes(), false};
  OpTimer timer(d.name, d.in_bytes, 0);  // comm_stats()["ops"] (fabric/op_stats.h)
  if (!ShmFabric::active() && pairs_in_process(d, pl.size)) {
    // One process, a large call: every pair of ranks' slices copied by the second of the two to
    // arrive, no departure barrier (InProcTeam::arrive_pairs). Each rank publishes one pointer
    // to its operand and plan; a peer's thread may run this rank's block.
    const RaggedPub pub{operand.untyped_data(), static_cast<const int64_t*>(plan.untyped_data())};
    return join_and_run_pairs("ragged_all_to_all", run.run_id, op_id, pl, d, &pub, res,
                              [&](Team& t, int src) -> std::string {
                                const auto* from = static_cast<const RaggedPub*>(t.peer_in(src));
                                uint64_t moved = 0;
                                std::string e = ragged_block(s, *from, pub.plan, src, t.rank(),
                                                             t.size(), res, &moved);
                                if (src != t.rank()) count_peer_bytes(t, moved);
                                return e;
                              });
  }
  return join_and_run_multi("ragged_all_to_all", run.run_id, op_id, pl, d, bufs, kRaggedBufs,
                            [&](Team& t) -> std::string {
                              uint64_t moved = 0;
                              std::string e = ragged_all_to_all(t, s, res, &moved);
                              count_peer_bytes(t, moved);
                              return e;
                            });
}

// strata_jax.empty: a result of the requested shape, left as XLA allocated it. The one output
// buffer of a ragged_all_to_all whose unreceived rows are never read, without the zero fill
// that jax.lax.empty is on XLA:CPU (8 MiB per device cost 0.7 ms; docs/guide/recsys.md).
ffi::Error EmptyImpl(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmptyHandler, EmptyImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedAllToAllHandler, RaggedAllToAllImpl,
                              STRATA_BIND_CALL(3, 1).Attr<I64s>("bounds"));

}  // namespace strata
