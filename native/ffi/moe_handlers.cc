// XLA FFI handlers of MoE dispatch/combine (native/moe/): decode buffers and attributes, join
// the call on the fabric as the collectives do (ffi/common.h), move the rows, leave.
#include <algorithm>
#include <string>
#include <vector>

#include "coll/kernels.h"
#include "fabric/inproc.h"
#include "fabric/stats.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "moe/moe.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

ffi::Error invalid(const char* name, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("strata_jax ") + name + ": " + what);
}

// Joins the call like run_collective in ffi/handlers.cc; arrival publishes this rank's buffers
// (Team::arrive_multi; the kernels find the peers' ones with Team::peer_buf), so MoE runs on
// the in-process and the shared-memory fabric alike.
// `may_ll`: see join_and_run_multi (the low-latency mode's pull kernels).
template <class Body>
ffi::Error run_moe(const char* name, ffi::RunId run, int64_t op_id, ffi::AnyBuffer pid,
                   const GroupAttrs& ga, OpDesc desc, const BufRef* bufs, int nbufs, Body body,
                   bool may_ll = false) {
  Placement pl;
  std::string err = placement(pid, ga, &pl);
  if (!err.empty()) return invalid(name, err);
  desc.name = name;
  stats().moe_calls.fetch_add(1, std::memory_order_relaxed);
  OpTimer timer(name, desc.in_bytes, 0);  // comm_stats()["ops"] (fabric/op_stats.h)
  return join_and_run_multi(name, run.run_id, op_id, pl, desc, bufs, nbufs, body, may_ll);
}

bool is_i32(ffi::AnyBuffer b) { return b.element_type() == ffi::DataType::S32; }

// The rows of every MoE call: a dtype the row kernels move (moe/moe.h), or an error naming it.
ffi::Error check_rows(const char* name, int32_t dt) {
  if (moe::row_dtype_supported(dt)) return ffi::Error::Success();
  return invalid(name, std::string("unsupported dtype ") + dtype_name(dt));
}

// The shape of one MoE call (moe/moe.h) from its operands' sizes (ranks: once the team is known).
moe::MoeShape moe_shape(int64_t tokens, int64_t hidden, int64_t topk, int64_t local_experts,
                        int64_t capacity, int32_t dtype) {
  moe::MoeShape s;
  s.tokens = tokens;
  s.hidden = hidden;
  s.topk = topk;
  s.local_experts = local_experts;
  s.capacity = capacity;
  s.dtype = dtype;
  s.esize = dtype_size(dtype);
  return s;
}

// Weights come in the rows' accumulator type: float64 for float64 rows, float32 otherwise.
ffi::DataType acc_type(ffi::DataType rows) {
  return rows == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// x [T, H], weights [T, K] (f64 for f64 rows, else f32) (empty unless weighted), slots [N, K] i32,
// counts [E_local] i32
// -> out [E_local, C, H].
ffi::Error MoeDispatchImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                           ffi::AnyBuffer slots, ffi::AnyBuffer counts, ffi::AnyBuffer pid, After,
                           ffi::Result<ffi::AnyBuffer> out, Done, int64_t op_id, I64s groups,
                           int64_t group_size, I64s device_ids, int64_t weighted) {
  const char* name = "moe.dispatch";
  const int32_t dt = static_cast<int32_t>(x.element_type());
  if (auto e = check_rows(name, dt); e.failure()) return e;
  auto xd = x.dimensions(), sd = slots.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || sd.size() != 2 || od.size() != 3 || !is_i32(slots) || !is_i32(counts) ||
      out->element_type() != x.element_type() || counts.element_count() != size_t(od[0]) ||
      od[2] != xd[1] ||
      (weighted && (weights.element_type() != acc_type(x.element_type()) ||
                    weights.element_count() != size_t(xd[0] * sd[1]))))
    return invalid(name, "internal error: operand shapes or dtypes do not match the plan");
  moe::MoeShape s = moe_shape(xd[0], xd[1], sd[1], od[0], od[1], dt);
  if (out->size_bytes() == 0) return ffi::Error::Success();  // same on every rank
  BufRef bufs[moe::kDispBufs];
  bufs[moe::kDispX] = BufRef{x.untyped_data(), x.size_bytes(), false};
  if (weighted)
    bufs[moe::kDispWeights] = BufRef{weights.untyped_data(), weights.size_bytes(), false};
  OpDesc d =
      make_desc(Op::moe_dispatch, Target::moe_dispatch, dt, x.size_bytes(), out->size_bytes());
  d.params.weighted = weighted;
  d.params.topk = s.topk;
  return run_moe(name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, bufs,
                 moe::kDispBufs, [&](Team& t) -> std::string {
                   s.ranks = t.size();
                   if (sd[0] != s.ranks * s.tokens)
                     return "strata_jax moe.dispatch: internal error: plan has the wrong "
                            "number of tokens";
                   uint64_t moved = 0;
                   std::string e =
                       moe::dispatch(t, s, static_cast<const int32_t*>(slots.untyped_data()),
                                     static_cast<const int32_t*>(counts.untyped_data()),
                                     weighted != 0, out->untyped_data(), &moved);
                   count_peer_bytes(t, moved);
                   return e;
                 });
}

// expert_y [E_local, C, H], weights [T, K] (f64 for f64 rows, else f32), slots [N, K] i32, rows [N]
// i32 -> y [T, H], partials [J, H] (J = 0 from the Python side: the one-pass combine needs no
// scratch; the result stays for the hierarchical lowering's signature).
ffi::Error MoeCombineImpl(ffi::RunId run, ffi::AnyBuffer ey, ffi::AnyBuffer weights,
                          ffi::AnyBuffer slots, ffi::AnyBuffer rows, ffi::AnyBuffer pid, After,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> partials, Done,
                          int64_t op_id, I64s groups, int64_t group_size, I64s device_ids) {
  const char* name = "moe.combine";
  const int32_t dt = static_cast<int32_t>(ey.element_type());
  if (auto e = check_rows(name, dt); e.failure()) return e;
  auto ed = ey.dimensions(), wd = weights.dimensions(), sd = slots.dimensions(),
       yd = y->dimensions(), pd = partials->dimensions();
  if (ed.size() != 3 || wd.size() != 2 || sd.size() != 2 || yd.size() != 2 || pd.size() != 2 ||
      weights.element_type() != acc_type(ey.element_type()) || !is_i32(slots) || !is_i32(rows) ||
      y->element_type() != ey.element_type() || partials->element_type() != ey.element_type() ||
      yd[0] != wd[0] || yd[1] != ed[2] || sd[1] != wd[1] || pd[1] != ed[2] ||
      rows.element_count() != size_t(sd[0]))
    return invalid(name, "internal error: operand shapes or dtypes do not match the plan");
  moe::MoeShape s = moe_shape(wd[0], ed[2], wd[1], ed[0], ed[1], dt);
  if (y->size_bytes() == 0) return ffi::Error::Success();  // T = 0 on every rank (static shapes)
  BufRef bufs[moe::kCombBufs];
  bufs[moe::kCombExpertY] = BufRef{ey.untyped_data(), ey.size_bytes(), false};
  bufs[moe::kCombSlots] = BufRef{slots.untyped_data(), slots.size_bytes(), false};
  OpDesc d = make_desc(Op::moe_combine, Target::moe_combine, dt, ey.size_bytes(), y->size_bytes());
  d.params.topk = s.topk;
  d.may_stage = true;  // every rank reads its tokens' rows from the peers' expert_y
  return run_moe(name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, bufs,
                 moe::kCombBufs, [&](Team& t) -> std::string {
                   s.ranks = t.size();
                   if (sd[0] != s.ranks * s.tokens)
                     return "strata_jax moe.combine: internal error: plan does not match the "
                            "group size";
                   uint64_t moved = 0;
                   std::string e =
                       moe::combine(t, s, weights.untyped_data(), y->untyped_data(), &moved);
                   count_peer_bytes(t, moved);
                   return e;
                 });
}

// The destination-side routing plan of one rank (no communication): g_idx [N, K] i32, every
// rank's sanitized choices in (source rank, token) order (-1 = none); base [] i32, this rank's
// first expert id -> counts [E_local] i32 (rows kept per local expert), dropped [E_local] i32
// (pairs past the capacity), slots [N, K] i32 (e_local * C + position, or -1), rows [N] i32
// (token g's row among the tokens with a kept slot here, in g order, or -1). A token's pair with
// a local expert takes that expert's next position in g order; a token naming the expert again
// gets the same slot; pairs past `capacity` are dropped (slot -1, counted). One pass over the
// N * K ids: the same plan XLA computed from one-hot tensors and cumulative sums (about 8 ms of
// CPU per call in benchmarks/moe.py's shape, against microseconds here).
ffi::Error MoePlanImpl(ffi::AnyBuffer g_idx, ffi::AnyBuffer base,
                       ffi::Result<ffi::AnyBuffer> counts, ffi::Result<ffi::AnyBuffer> dropped,
                       ffi::Result<ffi::AnyBuffer> slots, ffi::Result<ffi::AnyBuffer> rows,
                       int64_t capacity) {
  const char* name = "moe.dispatch (plan)";
  auto gd = g_idx.dimensions(), sd = slots->dimensions();
  if (gd.size() != 2 || sd.size() != 2 || gd[0] != sd[0] || gd[1] != sd[1] || !is_i32(g_idx) ||
      !is_i32(base) || base.element_count() != 1 || counts->element_type() != ffi::DataType::S32 ||
      dropped->element_type() != ffi::DataType::S32 ||
      slots->element_type() != ffi::DataType::S32 || rows->element_type() != ffi::DataType::S32 ||
      rows->element_count() != size_t(gd[0]) ||
      counts->element_count() != dropped->element_count() || capacity < 0)
    return invalid(name, "internal error: operand shapes or dtypes do not match the plan");
  const int64_t N = gd[0], K = gd[1], El = static_cast<int64_t>(counts->element_count());
  const int32_t* idx = static_cast<const int32_t*>(g_idx.untyped_data());
  const int64_t first = *static_cast<const int32_t*>(base.untyped_data());
  int32_t* out = static_cast<int32_t*>(slots->untyped_data());
  int32_t* row = static_cast<int32_t*>(rows->untyped_data());
  std::vector<int64_t> total(static_cast<size_t>(El), 0);
  int32_t next_row = 0;
  for (int64_t g = 0; g < N; ++g) {
    const int32_t* e = idx + g * K;
    int32_t* sl = out + g * K;
    bool kept = false;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t le = int64_t(e[k]) - first;
      sl[k] = -1;
      if (e[k] < 0 || le < 0 || le >= El) continue;
      int64_t j = 0;
      while (j < k && e[j] != e[k]) ++j;
      if (j < k) {  // a repeated expert: the slot of its first occurrence (or dropped with it)
        sl[k] = sl[j];
        continue;
      }
      const int64_t pos = total[static_cast<size_t>(le)]++;
      if (pos < capacity) {
        sl[k] = static_cast<int32_t>(le * capacity + pos);
        kept = true;
      }
    }
    row[g] = kept ? next_row++ : -1;
  }
  int32_t* c = static_cast<int32_t*>(counts->untyped_data());
  int32_t* d = static_cast<int32_t*>(dropped->untyped_data());
  for (int64_t e = 0; e < El; ++e) {
    const int64_t k = std::min<int64_t>(total[static_cast<size_t>(e)], capacity);
    c[e] = static_cast<int32_t>(k);
    d[e] = static_cast<int32_t>(total[static_cast<size_t>(e)] - k);
  }
  return ffi::Error::Success();
}

// values [E_local, C] f32 or f64 (this rank's per-slot values), slots [N, K] i32 (this rank's
// plan), topk_idx [T, K] i32 -> out [T, K] (values' dtype): each choice's slot value, read from the
// expert's rank.
ffi::Error MoeGatherImpl(ffi::RunId run, ffi::AnyBuffer values, ffi::AnyBuffer slots,
                         ffi::AnyBuffer topk_idx, ffi::AnyBuffer pid, After,
                         ffi::Result<ffi::AnyBuffer> out, Done, int64_t op_id, I64s groups,
                         int64_t group_size, I64s device_ids) {
  const char* name = "moe.combine (weights cotangent)";
  auto vd = values.dimensions(), sd = slots.dimensions(), td = topk_idx.dimensions();
  if (vd.size() != 2 || sd.size() != 2 || td.size() != 2 ||
      (values.element_type() != ffi::DataType::F32 &&
       values.element_type() != ffi::DataType::F64) ||
      out->element_type() != values.element_type() || !is_i32(slots) || !is_i32(topk_idx) ||
      sd[1] != td[1] || out->element_count() != topk_idx.element_count())
    return invalid(name, "internal error: operand shapes or dtypes do not match the plan");
  moe::MoeShape s =
      moe_shape(td[0], 0, td[1], vd[0], vd[1], static_cast<int32_t>(values.element_type()));
  if (out->size_bytes() == 0) return ffi::Error::Success();
  BufRef bufs[moe::kGathBufs];
  bufs[moe::kGathValues] = BufRef{values.untyped_data(), values.size_bytes(), false};
  bufs[moe::kGathSlots] = BufRef{slots.untyped_data(), slots.size_bytes(), false};
  OpDesc d = make_desc(Op::moe_gather, Target::moe_gather, s.dtype, values.size_bytes(),
                       out->size_bytes());
  return run_moe(name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, bufs,
                 moe::kGathBufs, [&](Team& t) -> std::string {
                   s.ranks = t.size();
                   if (sd[0] != s.ranks * s.tokens)
                     return "strata_jax moe.combine: internal error: plan does not match the "
                            "group size";
                   return moe::gather_values(t, s,
                                             static_cast<const int32_t*>(topk_idx.untyped_data()),
                                             out->untyped_data());
                 });
}

// Low-latency dispatch: x [T, H], topk_idx [T, K] i32 (sanitized) -> recv [E_local, R * M, H],
// counts [E_local] i32, src_slots [T, K] i32. `push`: sources write into the destinations'
// receive buffers; else destinations pull from the sources' x.
ffi::Error MoeLowLatencyDispatchImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer idx,
                                     ffi::AnyBuffer pid, After, ffi::Result<ffi::AnyBuffer> recv,
                                     ffi::Result<ffi::AnyBuffer> counts,
                                     ffi::Result<ffi::AnyBuffer> src_slots, Done, int64_t op_id,
                                     I64s groups, int64_t group_size, I64s device_ids,
                                     int64_t max_tokens, int64_t push) {
  const char* name = "moe.low_latency_dispatch";
  const int32_t dt = static_cast<int32_t>(x.element_type());
  if (auto e = check_rows(name, dt); e.failure()) return e;
  auto xd = x.dimensions(), id = idx.dimensions(), rd = recv->dimensions();
  if (xd.size() != 2 || id.size() != 2 || rd.size() != 3 || !is_i32(idx) ||
      recv->element_type() != x.element_type() || id[0] != xd[0] || rd[2] != xd[1] ||
      counts->element_type() != ffi::DataType::S32 || counts->element_count() != size_t(rd[0]) ||
      src_slots->element_type() != ffi::DataType::S32 ||
      src_slots->element_count() != idx.element_count() || max_tokens < xd[0])
    return invalid(name, "internal error: operand shapes or dtypes do not match");
  moe::MoeShape s = moe_shape(xd[0], xd[1], id[1], rd[0], rd[1], dt);
  BufRef bufs[moe::kLLDispBufs];
  bufs[moe::kLLX] = BufRef{x.untyped_data(), x.size_bytes(), false};
  bufs[moe::kLLIdx] = BufRef{idx.untyped_data(), idx.size_bytes(), false};
  bufs[moe::kLLRecv] = BufRef{recv->untyped_data(), push ? recv->size_bytes() : 0, true};
  OpDesc d = make_desc(Op::moe_low_latency_dispatch, Target::moe_low_latency_dispatch, dt,
                       x.size_bytes(), recv->size_bytes());
  d.params.push = push;
  d.params.topk = s.topk;
  d.params.max_tokens = max_tokens;
  d.algo = static_cast<int32_t>(push);
  // Pull: destinations read the sources' rows and ids, each writes its own outputs, so across
  // processes the call may take the low-latency path, staged when large (fabric/shm_ll.h).
  d.may_stage = true;
  return run_moe(
      name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, bufs, moe::kLLDispBufs,
      [&](Team& t) -> std::string {
        s.ranks = t.size();
        if (rd[1] != s.ranks * max_tokens)
          return "strata_jax moe.low_latency_dispatch: internal error: receive "
                 "buffer does not match the group size";
        uint64_t moved = 0;
        std::string e =
            moe::low_latency_dispatch(t, s, max_tokens, push != 0, recv->untyped_data(),
                                      static_cast<int32_t*>(counts->untyped_data()),
                                      static_cast<int32_t*>(src_slots->untyped_data()), &moved);
        count_peer_bytes(t, moved);
        return e;
      },
      /*may_ll=*/push == 0);
}

// Low-latency combine: expert_y [E_local, R * M, H], weights [T, K] (f64 for f64 rows, else
// f32), topk_idx [T, K] i32, src_slots [T, K] i32 -> y [T, H].
ffi::Error MoeLowLatencyCombineImpl(ffi::RunId run, ffi::AnyBuffer ey, ffi::AnyBuffer weights,
                                    ffi::AnyBuffer idx, ffi::AnyBuffer src_slots,
                                    ffi::AnyBuffer pid, After, ffi::Result<ffi::AnyBuffer> y, Done,
                                    int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                                    int64_t max_tokens) {
  const char* name = "moe.low_latency_combine";
  const int32_t dt = static_cast<int32_t>(ey.element_type());
  if (auto e = check_rows(name, dt); e.failure()) return e;
  auto ed = ey.dimensions(), wd = weights.dimensions(), yd = y->dimensions();
  if (ed.size() != 3 || wd.size() != 2 || yd.size() != 2 ||
      weights.element_type() != acc_type(ey.element_type()) || !is_i32(idx) || !is_i32(src_slots) ||
      y->element_type() != ey.element_type() || yd[0] != wd[0] || yd[1] != ed[2] ||
      idx.element_count() != weights.element_count() ||
      src_slots.element_count() != weights.element_count())
    return invalid(name, "internal error: operand shapes or dtypes do not match");
  moe::MoeShape s = moe_shape(wd[0], ed[2], wd[1], ed[0], ed[1], dt);
  BufRef bufs[moe::kLLCombBufs];
  bufs[moe::kLLExpertY] = BufRef{ey.untyped_data(), ey.size_bytes(), false};
  OpDesc d = make_desc(Op::moe_low_latency_combine, Target::moe_low_latency_combine, dt,
                       ey.size_bytes(), y->size_bytes());
  d.params.topk = s.topk;
  d.params.max_tokens = max_tokens;
  d.may_stage = true;  // every rank reads its tokens' rows from the peers' expert_y
  return run_moe(
      name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, bufs, moe::kLLCombBufs,
      [&](Team& t) -> std::string {
        s.ranks = t.size();
        if (ed[1] != s.ranks * max_tokens)
          return "strata_jax moe.low_latency_combine: internal error: expert "
                 "rows do not match the group size";
        uint64_t moved = 0;
        std::string e = moe::low_latency_combine(
            t, s, max_tokens, weights.untyped_data(),
            static_cast<const int32_t*>(idx.untyped_data()),
            static_cast<const int32_t*>(src_slots.untyped_data()), y->untyped_data(), &moved);
        count_peer_bytes(t, moved);
        return e;
      },
      /*may_ll=*/true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeDispatchHandler, MoeDispatchImpl,
                              STRATA_BIND_CALL(4, 1).Attr<int64_t>("weighted"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeCombineHandler, MoeCombineImpl, STRATA_BIND_CALL(4, 2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePlanHandler, MoePlanImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("capacity"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGatherHandler, MoeGatherImpl, STRATA_BIND_CALL(3, 1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeLowLatencyDispatchHandler, MoeLowLatencyDispatchImpl,
    STRATA_BIND_CALL(2, 3).Attr<int64_t>("max_tokens").Attr<int64_t>("push"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeLowLatencyCombineHandler, MoeLowLatencyCombineImpl,
                              STRATA_BIND_CALL(4, 1).Attr<int64_t>("max_tokens"));

}  // namespace strata
