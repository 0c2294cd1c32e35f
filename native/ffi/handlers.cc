// XLA FFI handlers of the collectives inside one fabric: each decodes its buffers and
// attributes, joins the call on the fabric (ffi/collective.h: run_collective), runs the
// algorithm from coll/ and leaves. The two-fabric forms of the hierarchical collectives are in
// hier_handlers.cc; both call the operators' implementations defined here.
#include "ffi/handlers.h"

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "coll/collectives.h"
#include "common/ops.h"
#include "fabric/inproc.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/stats.h"
#include "ffi/collective.h"
#include "ffi/common.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

// As peers_publish_outputs, for a call of several operands (arrive_list): its outputs are
// published per operand (peer_out_at), never as the single buffer peer_out reads, so that test
// would always say no and pin every list call to one-shot (every rank reducing every byte).
bool peers_publish_list_outputs(const Team& t, const Operand* ops, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    if (ops[k].count)
      return t.peer_out_at((t.rank() + 1) % t.size(), static_cast<int>(k)) != nullptr;
  return false;
}

ffi::Error AllReduceImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                         ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                         int64_t group_size, I64s device_ids, int32_t reduce) {
  const ReduceOp op = static_cast<ReduceOp>(reduce);
  const Op kind = op_of_reduce(reduce);
  const char* name = op_info(kind).api;
  if (auto e = check_dtype(name, x, true, op); e.failure()) return e;
  const int32_t dt = static_cast<int32_t>(x.element_type());
  const size_t count = x.element_count();
  OpDesc d = make_desc(kind, Target::all_reduce, dt, x.size_bytes(), x.size_bytes());
  d.reduce = reduce;
  d.algo = use_two_shot(x.size_bytes()) ? 1 : 0;
  return run_collective(
      name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d, x.untyped_data(),
      y->untyped_data(), [&](Team& t, const Placement&) {
        // Every rank follows rank 0's choice, even if the threshold changed
        // while the call was in flight. Two-shot writes into the peers' outputs, which a team
        // of the low-latency path does not publish (all its ranks see the same: one-shot).
        const bool two = two_shot_for(t.size(), x.size_bytes()) && t.peer_desc(0).algo == 1 &&
                         peers_publish_outputs(t);
        (two ? stats().two_shot : stats().one_shot).fetch_add(1, std::memory_order_relaxed);
        count_peer_bytes(t, all_reduce_peer_bytes(t.size(), x.size_bytes(), two));
        return all_reduce(t, dt, op, count, two);
      });
}

// psum/pmax/pmin of several operands (a pytree's leaves) in one call: operands
// (x_0 .. x_{n-1}, partition id, optional After), results (y_0 .. y_{n-1}, optional Done), n =
// `num_operands`. One rendezvous for all; each operand keeps its own dtype, reduced as
// all_reduce does; one-shot or two-shot by the total bytes (collectives.h all_reduce_list).
ffi::Error AllReduceListImpl(ffi::RunId run, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                             int32_t reduce, int64_t num_operands) {
  const ReduceOp op = static_cast<ReduceOp>(reduce);
  const Op kind = op_of_reduce(reduce);
  const char* name = op_info(kind).api;
  const int64_t n = num_operands;
  if (n < 1 || args.size() < static_cast<size_t>(n + 1) ||
      args.size() > static_cast<size_t>(n + 2) || rets.size() < static_cast<size_t>(n) ||
      rets.size() > static_cast<size_t>(n + 1))
    return to_error(std::string("strata_jax ") + name +
                    ": internal error: operand and result counts do not match num_operands");
  std::vector<OperandRef> ops(n);
  std::vector<Operand> meta(n);
  // The call's signature (every operand's dtype and size), compared across ranks at arrival.
  uint64_t sig = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t v) { sig = (sig ^ v) * 0x100000001b3ull; };
  mix(static_cast<uint64_t>(n));
  uint64_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    auto x = args.get<ffi::AnyBuffer>(k);
    auto y = rets.get<ffi::AnyBuffer>(k);
    if (!x.has_value() || !y.has_value())
      return to_error(std::string("strata_jax ") + name + ": internal error: bad operand");
    if (auto e = check_dtype(name, *x, true, op); e.failure()) return e;
    ffi::AnyBuffer out = **y;
    if (out.element_type() != x->element_type() || out.size_bytes() != x->size_bytes())
      return to_error(std::string("strata_jax ") + name +
                      ": internal error: a result differs from its operand");
    ops[k] = OperandRef{x->untyped_data(), out.untyped_data(), x->size_bytes(), x->size_bytes()};
    meta[k] = Operand{static_cast<int32_t>(x->element_type()), x->element_count()};
    mix(static_cast<uint64_t>(meta[k].dtype));
    mix(x->size_bytes());
    total += x->size_bytes();
  }
  auto pid = args.get<ffi::AnyBuffer>(n);
  if (!pid.has_value())
    return to_error(std::string("strata_jax ") + name + ": internal error: no partition id");
  Placement pl;
  std::string err = placement(*pid, GroupAttrs{groups, group_size, device_ids}, &pl);
  if (!err.empty()) return to_error(std::string("strata_jax ") + name + ": " + err);
  if (total == 0 && !ShmFabric::active()) return ffi::Error::Success();
  OpDesc d = make_desc(kind, Target::all_reduce_list, meta[0].dtype, total, total);
  d.name = name;
  d.reduce = reduce;
  d.params.signature = sig;
  d.algo = use_two_shot(total) ? 1 : 0;
  stats().calls.fetch_add(1, std::memory_order_relaxed);
  OpTimer timer(name, total, d.algo);  // comm_stats()["ops"] (fabric/op_stats.h)
  // Across processes a small pytree takes the low-latency path (fabric/shm_ll.h) as one input:
  // the leaves packed end to end, each from a line boundary; every rank then reduces each leaf
  // from the peers' slots straight into its own output (one-shot). Every rank packs alike, so
  // all choose the same path.
  std::vector<size_t> at(n);
  size_t packed = 0;
  for (int64_t k = 0; k < n; ++k) {
    at[k] = packed;
    packed += line_up(ops[k].in_bytes);
  }
  OpDesc ll = d;
  ll.in_bytes = ll.out_bytes = packed;
  std::vector<char> packed_in;
  bool on_ll = false;
  return join_and_run_with<true>(
      name, run.run_id, op_id, pl, /*cross_process=*/true,
      [&](auto& team) -> std::string {
        std::string e;
        if constexpr (std::is_same_v<std::decay_t<decltype(team)>, ShmLlTeam>) {
          packed_in.assign(packed, 0);
          for (int64_t k = 0; k < n; ++k)
            if (ops[k].in_bytes) std::memcpy(packed_in.data() + at[k], ops[k].in, ops[k].in_bytes);
          on_ll = true;
          e = team.arrive(ll, packed_in.data(), ops[0].out);
        } else {
          for (int64_t k = 0; k < n; ++k) prepare_output(ops[k].out, ops[k].out_bytes);
          e = team.arrive_list(d, ops.data(), static_cast<int>(n));
        }
        OpTimer::arrived();  // wait vs move in comm_stats() (fabric/op_stats.h)
        return e;
      },
      [&](Team& t) -> std::string {
        if (on_ll) {
          count_peer_bytes(t, total * (t.size() - 1));
          stats().one_shot.fetch_add(1, std::memory_order_relaxed);
          std::vector<const void*> srcs(t.size());
          for (int64_t k = 0; k < n; ++k) {
            if (!meta[k].count) continue;
            for (int j = 0; j < t.size(); ++j)
              srcs[j] = static_cast<const char*>(t.peer_in(j)) + at[k];
            reduce_n(meta[k].dtype, op, srcs.data(), t.size(), ops[k].out, 0, meta[k].count);
          }
          return {};
        }
        // As AllReduceImpl: every rank follows rank 0's choice.
        const bool two = two_shot_for(t.size(), total) && t.peer_desc(0).algo == 1 &&
                         peers_publish_list_outputs(t, meta.data(), n);
        (two ? stats().two_shot : stats().one_shot).fetch_add(1, std::memory_order_relaxed);
        count_peer_bytes(t, all_reduce_peer_bytes(t.size(), total, two));
        return all_reduce_list(t, op, meta.data(), static_cast<int>(n), two);
      },
      ShmFabric::active() ? &ll : nullptr);
}

// The rows and run of an array of `dims` split at `dimension` into n blocks (collectives.h
// reduce_scatter_rows / all_gather_rows): rows = the product of the dimensions before it, run =
// the elements of one block of it times those of the dimensions after it. False if the
// dimension is out of range or not divisible by n.
bool rows_and_run(ffi::Span<const int64_t> dims, int64_t dimension, int n, size_t* rows,
                  size_t* run) {
  const int64_t nd = static_cast<int64_t>(dims.size());
  if (dimension < 0 || dimension >= nd || n < 1 || dims[dimension] % n) return false;
  size_t before = 1, after = 1;
  for (int64_t k = 0; k < dimension; ++k) before *= dims[k];
  for (int64_t k = dimension + 1; k < nd; ++k) after *= dims[k];
  *rows = before;
  *run = static_cast<size_t>(dims[dimension] / n) * after;
  return true;
}

// psum_scatter over `dimension` in place (collectives.h reduce_scatter_rows): the output keeps
// the input's layout with that dimension n times smaller, so the program needs no transpose.
ffi::Error PsumScatterRowsImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                               ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                               int64_t group_size, I64s device_ids, int32_t reduce,
                               int64_t dimension) {
  const ReduceOp op = static_cast<ReduceOp>(reduce);
  if (auto e = check_dtype("psum_scatter", x, true, op); e.failure()) return e;
  const int32_t dt = static_cast<int32_t>(x.element_type());
  OpDesc d =
      make_desc(Op::psum_scatter, Target::psum_scatter_rows, dt, x.size_bytes(), y->size_bytes());
  d.params.dimension = dimension;
  d.reduce = reduce;
  return run_collective(
      "psum_scatter", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement&) -> std::string {
        size_t rows = 0, run_elems = 0;
        if (!rows_and_run(x.dimensions(), dimension, t.size(), &rows, &run_elems) ||
            y->element_count() * t.size() != x.element_count())
          return "strata_jax psum_scatter: the scattered dimension's size is not a multiple of "
                 "the group size, or the output is not the input's block";
        count_peer_bytes(t, y->size_bytes() * (t.size() - 1));
        return reduce_scatter_rows(t, dt, op, rows, run_elems);
      });
}

// all_gather along `dimension` in place (collectives.h all_gather_rows): the transpose of
// PsumScatterRowsImpl, with no transpose in the program either.
ffi::Error AllGatherRowsImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                             ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                             int64_t group_size, I64s device_ids, int64_t dimension) {
  if (auto e = check_dtype("all_gather", x, false, ReduceOp::kSum); e.failure()) return e;
  OpDesc d = make_desc(Op::all_gather, Target::all_gather_rows,
                       static_cast<int32_t>(x.element_type()), x.size_bytes(), y->size_bytes());
  d.params.dimension = dimension;
  const int es = dtype_size(d.dtype);
  return run_collective(
      "all_gather", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement&) -> std::string {
        // Rows: the input's dimensions before `dimension`; run: those from it on (an untiled
        // gather inserts its axis there, so `dimension` may be the input's rank).
        auto dims = x.dimensions();
        const int64_t nd = static_cast<int64_t>(dims.size());
        if (dimension < 0 || dimension > nd || x.size_bytes() * t.size() != y->size_bytes())
          return "strata_jax all_gather: output size is not the group size times the input size";
        size_t rows = 1, run_elems = 1;
        for (int64_t k = 0; k < nd; ++k) (k < dimension ? rows : run_elems) *= dims[k];
        count_peer_bytes(t, x.size_bytes() * (t.size() - 1));
        return all_gather_rows(t, rows, run_elems * es);
      });
}

}  // namespace

// Whether `place` (nb entries) is a permutation of [0, nb). The placement tables are written by
// hierarchy/ and checked anyway: a wrong one would read or write outside the buffers.
namespace {
bool is_permutation(const int64_t* place, size_t len, int64_t nb) {
  if (static_cast<int64_t>(len) != nb) return false;
  std::vector<char> seen(nb, 0);
  for (int64_t i = 0; i < nb; ++i) {
    if (place[i] < 0 || place[i] >= nb || seen[place[i]]) return false;
    seen[place[i]] = 1;
  }
  return true;
}
}  // namespace

// The sub-blocks per rank of a placement table with one row per group (`groups` has
// groups.size() / group_size rows; every row holds group_size * parts entries).
int placement_parts(I64s placement, I64s groups, int64_t group_size) {
  if (group_size <= 0 || !placement.size() || groups.size() < static_cast<size_t>(group_size))
    return 1;
  return static_cast<int>(placement.size() / groups.size());
}

// This group's row of a placement table (nullptr: none), or an error when the table is not one
// row per group of permutations of [0, t.size() * parts).
std::string placement_row(I64s placement, I64s groups, const Team& t, const Placement& pl,
                          int parts, const char* name, const int64_t** row) {
  *row = nullptr;
  if (!placement.size()) return {};
  const size_t width = static_cast<size_t>(t.size()) * parts;
  const size_t rows = groups.size() / static_cast<size_t>(t.size());
  if (placement.size() != rows * width || pl.group < 0 || static_cast<size_t>(pl.group) >= rows ||
      !is_permutation(placement.begin() + pl.group * width, width, static_cast<int64_t>(width)))
    return std::string("strata_jax ") + name +
           ": internal error: the block placement is not one permutation of the group's "
           "sub-blocks per group";
  *row = placement.begin() + pl.group * width;
  return {};
}

// `placement`: empty, or per group (one row per row of `groups`) the input block of each
// (rank, sub-block) (collectives.h reduce_scatter).
// `divert` (per partition; empty: none): the sub-block of this rank's output written to `y2`
// instead (collectives.h reduce_scatter).
ffi::Error psum_scatter_impl(Target form, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid,
                             ffi::Result<ffi::AnyBuffer> y, int64_t op_id, I64s groups,
                             int64_t group_size, I64s device_ids, int32_t reduce, I64s placement,
                             I64s divert, void* y2, size_t y2_bytes) {
  const ReduceOp op = static_cast<ReduceOp>(reduce);
  if (auto e = check_dtype("psum_scatter", x, true, op); e.failure()) return e;
  const int32_t dt = static_cast<int32_t>(x.element_type());
  const int parts = placement_parts(placement, groups, group_size);
  OpDesc d = make_desc(Op::psum_scatter, form, dt, x.size_bytes(), y->size_bytes());
  d.params.parts = parts;
  d.reduce = reduce;
  const size_t out_count = y->element_count();
  return run_collective(
      "psum_scatter", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement& pl) -> std::string {
        if (out_count * t.size() != x.element_count())
          return "strata_jax psum_scatter: input size is not the group size times the output "
                 "size";
        const int64_t* place = nullptr;
        if (auto err = placement_row(placement, groups, t, pl, parts, "psum_scatter", &place);
            !err.empty())
          return err;
        if (place && out_count % parts)
          return "strata_jax psum_scatter: internal error: the output is not a whole number of "
                 "sub-blocks";
        int part = -1;
        if (divert.size()) {
          if (pl.partition < 0 || static_cast<size_t>(pl.partition) >= divert.size() ||
              divert[pl.partition] < 0 || divert[pl.partition] >= parts ||
              y2_bytes * parts != y->size_bytes())
            return "strata_jax psum_scatter: internal error: bad divert table or second output";
          part = static_cast<int>(divert[pl.partition]);
        }
        count_peer_bytes(t, y->size_bytes() * (t.size() - 1));
        return reduce_scatter(t, dt, op, out_count, place, parts, part, static_cast<char*>(y2));
      });
}

// `placement`: empty, or per group (one row per row of `groups`) the output block of each
// (rank, sub-block) (collectives.h all_gather).
ffi::Error all_gather_impl(Target form, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid,
                           ffi::Result<ffi::AnyBuffer> y, int64_t op_id, I64s groups,
                           int64_t group_size, I64s device_ids, I64s placement) {
  if (auto e = check_dtype("all_gather", x, false, ReduceOp::kSum); e.failure()) return e;
  const int parts = placement_parts(placement, groups, group_size);
  OpDesc d = make_desc(Op::all_gather, form, static_cast<int32_t>(x.element_type()), x.size_bytes(),
                       y->size_bytes());
  d.params.parts = parts;
  return run_collective(
      "all_gather", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement& pl) -> std::string {
        if (x.size_bytes() * t.size() != y->size_bytes())
          return "strata_jax all_gather: output size is not the group size times the input size";
        const int64_t* place = nullptr;
        if (auto err = placement_row(placement, groups, t, pl, parts, "all_gather", &place);
            !err.empty())
          return err;
        if (place && x.size_bytes() % parts)
          return "strata_jax all_gather: internal error: the input is not a whole number of "
                 "sub-blocks";
        count_peer_bytes(t, x.size_bytes() * (t.size() - 1));
        return all_gather(t, x.size_bytes(), peers_publish_outputs(t), place, parts);
      });
}

// `divert` (per partition; empty: none): index divert[p] of the output's `divert_axis` goes to
// `y2` instead, and the output is laid out with that axis at `move_to` (collectives.h: Divert).
// The two-fabric all_to_all (strata_jax/_src/hierarchy/) hands y2, the partner fabric's
// aggregate, to XLA's collective-permute and puts what comes back into y in place.
ffi::Error all_to_all_impl(Target form, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid,
                           ffi::Result<ffi::AnyBuffer> y, int64_t op_id, I64s groups,
                           int64_t group_size, I64s device_ids, int64_t split_axis,
                           int64_t concat_axis, int64_t divert_axis, int64_t move_to, I64s divert,
                           void* y2, size_t y2_bytes, I64s divert_dest) {
  if (auto e = check_dtype("all_to_all", x, false, ReduceOp::kSum); e.failure()) return e;
  const bool diverted = divert.size() != 0;
  OpDesc d = make_desc(Op::all_to_all, form, static_cast<int32_t>(x.element_type()), x.size_bytes(),
                       y->size_bytes());
  d.params.split_axis = split_axis;
  d.params.concat_axis = concat_axis;
  if (diverted) {
    d.params.divert_axis = divert_axis;
    d.params.move_to = move_to;
  }
  auto dims = x.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  const int es = dtype_size(d.dtype);
  // The checks of the block shapes, the same for every rank (its shape and the group size).
  auto check = [&](const Team& t, const Placement& pl) -> std::string {
    const int nd = static_cast<int>(shape.size());
    if (split_axis < 0 || split_axis >= nd || concat_axis < 0 || concat_axis >= nd ||
        shape[split_axis] % t.size() != 0)
      return "strata_jax all_to_all: split axis size must be divisible by the group size";
    if (diverted &&
        (pl.partition < 0 || static_cast<size_t>(pl.partition) >= divert.size() ||
         divert_axis < 0 || divert_axis >= nd || shape[divert_axis] == 0 || move_to < -1 ||
         move_to >= nd || y2_bytes != y->size_bytes() / shape[divert_axis] ||
         (divert_dest.size() && divert_dest.size() != divert.size())))
      return "strata_jax all_to_all: internal error: bad divert table or second output";
    return {};
  };
  auto body = [&](Team& t, const Placement& pl) -> std::string {
    if (std::string e = check(t, pl); !e.empty()) return e;
    count_peer_bytes(t, x.size_bytes() / t.size() * (t.size() - 1));
    const Divert dv{static_cast<int>(divert_axis), diverted ? divert[pl.partition] : 0,
                    static_cast<char*>(y2), static_cast<int>(move_to),
                    divert_dest.size() ? divert_dest[pl.partition] : -1};
    return all_to_all(t, es, shape, static_cast<int>(split_axis), static_cast<int>(concat_axis),
                      diverted ? &dv : nullptr);
  };
  const GroupAttrs ga{groups, group_size, device_ids};
  if (diverted)
    return run_collective("all_to_all", run, op_id, pid, ga, d, x.untyped_data(), y->untyped_data(),
                          body);
  // One block per source (InProcTeam::arrive_pairs); a peer's thread may run it.
  auto block = [&](Team& t, const Placement& pl, int src) -> std::string {
    if (std::string e = check(t, pl); !e.empty()) return e;
    if (src != t.rank()) count_peer_bytes(t, x.size_bytes() / t.size());
    return all_to_all(t, es, shape, static_cast<int>(split_axis), static_cast<int>(concat_axis),
                      nullptr, src);
  };
  return run_collective("all_to_all", run, op_id, pid, ga, d, x.untyped_data(), y->untyped_data(),
                        body, /*peers_write=*/false, block);
}

namespace {

ffi::Error PsumScatterImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                           ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                           int64_t group_size, I64s device_ids, int32_t reduce) {
  return psum_scatter_impl(Target::psum_scatter, run, x, pid, y, op_id, groups, group_size,
                           device_ids, reduce, I64s());
}

ffi::Error AllGatherImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                         ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                         int64_t group_size, I64s device_ids) {
  return all_gather_impl(Target::all_gather, run, x, pid, y, op_id, groups, group_size, device_ids,
                         I64s());
}

ffi::Error AllToAllImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                        ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                        int64_t group_size, I64s device_ids, int64_t split_axis,
                        int64_t concat_axis) {
  return all_to_all_impl(Target::all_to_all, run, x, pid, y, op_id, groups, group_size, device_ids,
                         split_axis, concat_axis);
}

ffi::Error PpermuteImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                        ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                        int64_t group_size, I64s device_ids, I64s sources) {
  if (auto e = check_dtype("ppermute", x, false, ReduceOp::kSum); e.failure()) return e;
  OpDesc d = make_desc(Op::ppermute, Target::ppermute, static_cast<int32_t>(x.element_type()),
                       x.size_bytes(), x.size_bytes());
  // The permutation is compared across the group like the shape: ranks that reach a ppermute
  // with different permutations (a rank-dependent branch) fail instead of each following its
  // own. FNV-1a of the source table.
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < sources.size(); ++i) {
    h ^= static_cast<uint64_t>(sources[i]) + 2;
    h *= 0x100000001b3ull;
  }
  d.params.signature = h;
  return run_collective("ppermute", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
                        x.untyped_data(), y->untyped_data(),
                        [&](Team& t, const Placement& pl) -> std::string {
                          if (static_cast<int>(sources.size()) != t.size())
                            return "strata_jax ppermute: permutation size mismatch";
                          const int src = static_cast<int>(sources[pl.rank]);
                          if (src >= 0) count_peer_bytes(t, x.size_bytes());
                          return permute(t, x.size_bytes(), src);
                        });
}

ffi::Error PbroadcastImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                          ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                          int64_t group_size, I64s device_ids, int64_t root) {
  if (auto e = check_dtype("pbroadcast", x, false, ReduceOp::kSum); e.failure()) return e;
  OpDesc d = make_desc(Op::pbroadcast, Target::pbroadcast, static_cast<int32_t>(x.element_type()),
                       x.size_bytes(), x.size_bytes());
  d.params.root = root;
  return run_collective(
      "pbroadcast", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement&) -> std::string {
        if (root < 0 || root >= t.size()) return "strata_jax pbroadcast: source out of range";
        count_peer_bytes(t, x.size_bytes());
        return broadcast(t, x.size_bytes(), static_cast<int>(root), peers_publish_outputs(t));
      });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceHandler, AllReduceImpl,
                              STRATA_BIND_CALL(1, 1).Attr<int32_t>("reduce"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceListHandler, AllReduceListImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .STRATA_GROUP_ATTRS.Attr<int32_t>("reduce")
                                  .Attr<int64_t>("num_operands"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PsumScatterRowsHandler, PsumScatterRowsImpl,
    STRATA_BIND_CALL(1, 1).Attr<int32_t>("reduce").Attr<int64_t>("dimension"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherRowsHandler, AllGatherRowsImpl,
                              STRATA_BIND_CALL(1, 1).Attr<int64_t>("dimension"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PsumScatterHandler, PsumScatterImpl,
                              STRATA_BIND_CALL(1, 1).Attr<int32_t>("reduce"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherHandler, AllGatherImpl, STRATA_BIND_CALL(1, 1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllToAllHandler, AllToAllImpl,
    STRATA_BIND_CALL(1, 1).Attr<int64_t>("split_axis").Attr<int64_t>("concat_axis"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PpermuteHandler, PpermuteImpl,
                              STRATA_BIND_CALL(1, 1).Attr<I64s>("sources"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PbroadcastHandler, PbroadcastImpl,
                              STRATA_BIND_CALL(1, 1).Attr<int64_t>("root"));

}  // namespace strata
