// Handlers of the hierarchical collectives (strata_jax/_src/hierarchy/): the two-fabric forms
// of strata's collectives (blocks placed in group order, the partner fabric's block diverted to a
// result of its own that XLA's collective sends as it is, the partner's shard combined on the way
// out), and three calls around XLA's own collectives between fabrics: one that counts what was
// handed over, one that compares the call across fabrics before any byte moves, one that orders
// a cond or while loop holding strata calls after the previous strata call.
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "coll/collectives.h"
#include "common/ops.h"
#include "fabric/stats.h"
#include "ffi/collective.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

// Operand: the inter-fabric collective's input (a dependency only; never read). `bytes`: what
// the step hands to XLA's collective on this device.
ffi::Error CountImpl(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, int64_t bytes) {
  stats().inter_fabric_calls.fetch_add(1, std::memory_order_relaxed);
  stats().inter_fabric_bytes.fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
  return ffi::Error::Success();
}

// strata_order(x, after) -> x: hands x on (its result aliases x; copies only if XLA gave it a
// buffer of its own) and reads nothing of `after`, the previous strata call's Done: it puts a
// cond or while loop holding strata calls after that call in XLA's thunk graph
// (program_order.py: _order_control_flow).
ffi::Error OrderImpl(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y) {
  if (y->size_bytes() != x.size_bytes())
    return ffi::Error(ffi::ErrorCode::kInternal, "strata_order: operand and result differ in size");
  if (y->untyped_data() != x.untyped_data() && x.size_bytes() > 0)
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

// The call descriptor of a hierarchical collective (strata_jax/_src/hierarchy/checks.py:
// _descriptor): int32 words, self-describing so that a rank can print a peer's call: the
// first operand's ndim, dims and dtype, the op name, a crc of the rest (kDescAttrs), then a
// second operand's ndim (0: none), dims and dtype.
constexpr int kDescWords = 24;
constexpr int32_t kDescMagic = 0x53545231;  // "STR1"
constexpr int kDescDims = 8, kDescDtype = 10, kDescOp = 12, kDescAttrs = 16;
constexpr int kDesc2 = 17, kDesc2Dims = 4, kDesc2Dtype = 22;

// The text in `words` words, up to its first NUL; a byte outside printable ASCII shows as '?'
// (a descriptor a peer of another program or setting sent can be any bytes, and the error text
// must stay valid UTF-8: Python raised UnicodeDecodeError on it instead of the error).
std::string chars(const int32_t* w, int words) {
  std::string s;
  for (int i = 0; i < 4 * words; ++i) {
    const auto c =
        static_cast<unsigned char>((static_cast<uint32_t>(w[i / 4]) >> (8 * (i % 4))) & 0xff);
    if (c == 0) break;
    s += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return s;
}

std::string call_text(const int32_t* d) {
  if (d[0] != kDescMagic) return "(not a strata call: another program's collective)";
  std::ostringstream os;
  os << chars(d + kDescOp, 4) << " " << chars(d + kDescDtype, 2) << "[";
  const int nd = d[1];
  for (int i = 0; i < nd && i < kDescDims; ++i) os << (i ? "," : "") << d[2 + i];
  if (nd > kDescDims) os << ",...";
  os << "]";
  const int nd2 = d[kDesc2];
  if (nd2 > 0) {
    os << ", " << chars(d + kDesc2Dtype, 2) << "[";
    for (int i = 0; i < nd2 && i < kDesc2Dims; ++i) os << (i ? "," : "") << d[kDesc2 + 1 + i];
    if (nd2 > kDesc2Dims) os << ",...";
    os << "]";
  }
  return os.str();
}

// strata_check_across_fabrics(x, descs s32[F, kDescWords], partition id[, after]) -> x
// (aliased)[, done]: `after`/`done` put it in the program-order chain of strata calls
// (program_order.py), so that the next strata call of the computation starts after it.
// descs: every member's descriptor of the call, gathered across fabrics by XLA's collective
// (in the order of the member's row of `groups`). Fails, on every member alike (they all hold
// the same rows), when two members describe different calls, naming each member and its call.
ffi::Error CheckAcrossImpl(ffi::AnyBuffer x, ffi::AnyBuffer descs, ffi::AnyBuffer pid, After,
                           ffi::Result<ffi::AnyBuffer> y, Done, std::string_view op, I64s groups,
                           int64_t group_size, I64s devices, I64s procs, I64s fabrics) {
  const auto dd = descs.dimensions();
  if (descs.element_type() != ffi::DataType::S32 || dd.size() != 2 || dd[1] != kDescWords ||
      dd[0] != group_size || y->size_bytes() != x.size_bytes() || group_size < 1)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "strata_check_across_fabrics: operands do not match the lowering");
  const int64_t me = static_cast<int64_t>(*static_cast<const uint32_t*>(pid.untyped_data()));
  int64_t row = -1;
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i] == me) row = static_cast<int64_t>(i) / group_size;
  if (row < 0)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "strata_check_across_fabrics: partition not in any group");
  const auto* d = static_cast<const int32_t*>(descs.untyped_data());
  bool same = true;
  for (int64_t j = 1; j < group_size && same; ++j)
    same = std::memcmp(d, d + j * kDescWords, kDescWords * sizeof(int32_t)) == 0;
  if (!same) {
    bool shapes_equal = true;
    for (int64_t j = 1; j < group_size; ++j) {
      const int32_t* e = d + j * kDescWords;
      shapes_equal &=
          std::memcmp(d, e, kDescAttrs * sizeof(int32_t)) == 0 &&
          std::memcmp(d + kDesc2, e + kDesc2, (kDescWords - kDesc2) * sizeof(int32_t)) == 0;
    }
    std::ostringstream os;
    os << "strata_jax." << op << ": ranks on different fabrics (hosts) disagree on the call: ";
    for (int64_t j = 0; j < group_size; ++j) {
      const int64_t k = row * group_size + j;
      os << (j ? "; " : "") << "device " << devices[k] << " (process " << procs[k] << ", fabric "
         << fabrics[k] << "): " << call_text(d + j * kDescWords);
    }
    if (shapes_equal) os << " (same shapes; other parameters differ: axes, root or operands)";
    os << ". Between fabrics the bytes cross through XLA's own collective, which compares "
          "nothing; strata compared the calls first. Give every process the same shapes.";
    return to_error(os.str());
  }
  if (y->untyped_data() != x.untyped_data() && x.size_bytes() > 0)
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

// ---- The two-fabric forms of the collectives ----

ffi::Error PsumScatterPlacedImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                                 ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                                 int64_t group_size, I64s device_ids, int32_t reduce,
                                 I64s placement) {
  return psum_scatter_impl(Target::psum_scatter_placed, run, x, pid, y, op_id, groups, group_size,
                           device_ids, reduce, placement);
}

// The two-fabric psum_scatter (strata_jax/_src/hierarchy/): the partner fabric's sub-block,
// divert[p] for partition p, goes to `y2`, which XLA's collective-permute sends as it is.
ffi::Error PsumScatterPlacedDivertImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                                       ffi::Result<ffi::AnyBuffer> y,
                                       ffi::Result<ffi::AnyBuffer> y2, Done, int64_t op_id,
                                       I64s groups, int64_t group_size, I64s device_ids,
                                       int32_t reduce, I64s placement, I64s divert) {
  if (!divert.size())
    return to_error("strata_jax psum_scatter: internal error: an empty divert table");
  return psum_scatter_impl(Target::psum_scatter_placed_divert, run, x, pid, y, op_id, groups,
                           group_size, device_ids, reduce, placement, divert, y2->untyped_data(),
                           y2->size_bytes());
}

ffi::Error AllGatherPlacedImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                               ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                               int64_t group_size, I64s device_ids, I64s placement) {
  return all_gather_impl(Target::all_gather_placed, run, x, pid, y, op_id, groups, group_size,
                         device_ids, placement);
}

// One sub-block of an all_gather whose output is `parts` sub-blocks per member: member j's input
// x lands at output block placement[j * parts + part] (blocks of x's size) of every member's
// output, and the other blocks are left as they are: unwritten (`base` null), or `base`'s, which
// the output aliases. The two-fabric all_gather (strata_jax/_src/hierarchy/) writes the own
// fabric's blocks (part 0) before its ring crossing and the blocks that crossed (part 1, into
// the same output) after it, so the first half overlaps the crossing and nothing is copied twice.
ffi::Error all_gather_part_impl(ffi::RunId run, ffi::AnyBuffer x, const ffi::AnyBuffer* base,
                                ffi::AnyBuffer pid, ffi::Result<ffi::AnyBuffer> y, int64_t op_id,
                                I64s groups, int64_t group_size, I64s device_ids, I64s placement,
                                int64_t part) {
  if (auto e = check_dtype("all_gather", x, false, ReduceOp::kSum); e.failure()) return e;
  const int parts = placement_parts(placement, groups, group_size);
  if (!placement.size() || part < 0 || part >= parts)
    return to_error("strata_jax all_gather: internal error: no placement for a sub-block");
  if (base) {
    if (base->size_bytes() != y->size_bytes())
      return to_error("strata_jax all_gather: internal error: the base differs from the output");
    if (base->untyped_data() != y->untyped_data() && y->size_bytes() > 0)
      std::memcpy(y->untyped_data(), base->untyped_data(), y->size_bytes());
  }
  OpDesc d =
      make_desc(Op::all_gather, base ? Target::all_gather_part_into : Target::all_gather_part,
                static_cast<int32_t>(x.element_type()), x.size_bytes(), y->size_bytes());
  d.params.parts = parts;
  d.params.part = part;
  return run_collective(
      "all_gather", run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      x.untyped_data(), y->untyped_data(), [&](Team& t, const Placement& pl) -> std::string {
        if (x.size_bytes() * t.size() * parts != y->size_bytes())
          return "strata_jax all_gather: output size is not the group size times the parts "
                 "times the input size";
        const int64_t* place = nullptr;
        if (auto err = placement_row(placement, groups, t, pl, parts, "all_gather", &place);
            !err.empty())
          return err;
        std::vector<int64_t> mine(t.size());  // this sub-block's output block, per member
        for (int j = 0; j < t.size(); ++j) mine[j] = place[j * parts + part];
        count_peer_bytes(t, x.size_bytes() * (t.size() - 1));
        return all_gather(t, x.size_bytes(), peers_publish_outputs(t), mine.data(), 1);
      });
}

ffi::Error AllGatherPartImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                             ffi::Result<ffi::AnyBuffer> y, Done, int64_t op_id, I64s groups,
                             int64_t group_size, I64s device_ids, I64s placement, int64_t part) {
  return all_gather_part_impl(run, x, nullptr, pid, y, op_id, groups, group_size, device_ids,
                              placement, part);
}

ffi::Error AllGatherPartIntoImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer base,
                                 ffi::AnyBuffer pid, After, ffi::Result<ffi::AnyBuffer> y, Done,
                                 int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                                 I64s placement, int64_t part) {
  return all_gather_part_impl(run, x, &base, pid, y, op_id, groups, group_size, device_ids,
                              placement, part);
}

// Shards up to this size take the packed, pull form of all_gather_reduce (the input published
// is [x | z]), which the low-latency path can run; larger ones the push form. A constant, so
// that every rank picks the same form whatever its settings.
constexpr size_t kPackedShardBytes = 512 * 1024;

// y = all_gather(x op z) over the group: the last two steps of a two-fabric all-reduce
// (strata_jax/_src/hierarchy/), where z is the partner fabric's shard. `z_first[p]` (per
// partition) puts z before x so that both partners combine the two shards in the same order and
// hold the same bits (pmax of +0 and -0, the sign of a NaN). `x_from[p]` (per partition; -1:
// p itself) names the partition whose x pairs with p's z: the two-fabric ring psum, where the
// member that receives the partner fabric's shard k is not the one holding the own shard k
// (hierarchy/algorithms.py: all_reduce); that pair's result goes to the x holder's output block.
ffi::Error AllGatherReduceImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer z,
                               ffi::AnyBuffer pid, After, ffi::Result<ffi::AnyBuffer> y, Done,
                               int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                               int32_t reduce, I64s z_first, I64s x_from) {
  const ReduceOp op = static_cast<ReduceOp>(reduce);
  const Op kind = op_of_reduce(reduce);
  const char* name = op_info(kind).api;
  if (auto e = check_dtype(name, x, true, op); e.failure()) return e;
  if (op == ReduceOp::kMean)  // a pair of shards: dividing by 2 would not be the group's mean
    return to_error(std::string("strata_jax ") + name +
                    ": internal error: all_gather_reduce takes no mean (hierarchy/ divides)");
  if (z.element_type() != x.element_type() || z.size_bytes() != x.size_bytes())
    return to_error(std::string("strata_jax ") + name +
                    ": internal error: the two shards of an all_gather_reduce differ");
  const int32_t dt = static_cast<int32_t>(x.element_type());
  const size_t bytes = x.size_bytes(), count = x.element_count();
  const bool packed = bytes <= kPackedShardBytes;
  std::vector<char> pair;  // packed: [x | z], published as this rank's input
  if (packed) {
    pair.resize(2 * bytes);
    if (bytes) {
      std::memcpy(pair.data(), x.untyped_data(), bytes);
      std::memcpy(pair.data() + bytes, z.untyped_data(), bytes);
    }
  }
  OpDesc d =
      make_desc(kind, Target::all_gather_reduce, dt, packed ? 2 * bytes : bytes, y->size_bytes());
  d.reduce = reduce;
  auto order = [&](int64_t partition) -> int {  // 1: z first, -1: no order given
    if (partition < 0 || static_cast<size_t>(partition) >= z_first.size()) return -1;
    return z_first[partition] != 0 ? 1 : 0;
  };
  // The partition whose x pairs with this partition's z (its own unless x_from says another).
  auto x_source = [&](int64_t partition) -> int64_t {
    if (partition < 0 || static_cast<size_t>(partition) >= x_from.size() || x_from[partition] < 0)
      return partition;
    return x_from[partition];
  };
  return run_collective(
      name, run, op_id, pid, GroupAttrs{groups, group_size, device_ids}, d,
      packed ? static_cast<const void*>(pair.data()) : x.untyped_data(), y->untyped_data(),
      [&](Team& t, const Placement& pl) -> std::string {
        if (bytes * t.size() != y->size_bytes())
          return "strata_jax all_gather_reduce: output size is not the group size times the "
                 "input size";
        for (int j = 0; j < t.size(); ++j)
          if (order(pl.member_parts[j]) < 0)
            return "strata_jax all_gather_reduce: internal error: no operand order for a "
                   "member";
        // x_src[j]: the member whose x pairs with member j's z; its block is where the pair
        // lands. A permutation of the members (every output block written once).
        std::vector<int> x_src(t.size(), -1);
        std::vector<char> hit(t.size(), 0);
        for (int j = 0; j < t.size(); ++j) {
          const int64_t want = x_source(pl.member_parts[j]);
          for (int k = 0; k < t.size(); ++k)
            if (pl.member_parts[k] == want) x_src[j] = k;
          if (x_src[j] < 0 || hit[x_src[j]]++)
            return "strata_jax all_gather_reduce: internal error: x_from is not a permutation "
                   "of the members";
        }
        count_peer_bytes(t, (packed ? 2 * bytes : bytes) * (t.size() - 1));
        if (packed)
          return all_gather_reduce_packed(
              t, dt, op, count, [&](int j) { return order(pl.member_parts[j]) == 1; },
              [&](int j) { return x_src[j]; });
        const int xr = x_src[t.rank()];
        const void* own_x = xr == t.rank() ? x.untyped_data() : t.peer_in(xr);
        const bool swap = order(pl.partition) == 1;
        const void* a = swap ? z.untyped_data() : own_x;
        const void* b = swap ? own_x : z.untyped_data();
        return all_gather_reduce(t, dt, op, a, b, count, xr);
      },
      /*peers_write=*/!packed);
}

ffi::Error AllToAllDivertImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer pid, After,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> y2, Done,
                              int64_t op_id, I64s groups, int64_t group_size, I64s device_ids,
                              int64_t split_axis, int64_t concat_axis, int64_t divert_axis,
                              int64_t move_to, I64s divert, I64s divert_dest) {
  if (!divert.size())
    return to_error("strata_jax all_to_all: internal error: an empty divert table");
  return all_to_all_impl(Target::all_to_all_divert, run, x, pid, y, op_id, groups, group_size,
                         device_ids, split_axis, concat_axis, divert_axis, move_to, divert,
                         y2->untyped_data(), y2->size_bytes(), divert_dest);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PsumScatterPlacedHandler, PsumScatterPlacedImpl,
    STRATA_BIND_CALL(1, 1).Attr<int32_t>("reduce").Attr<I64s>("placement"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PsumScatterPlacedDivertHandler, PsumScatterPlacedDivertImpl,
    STRATA_BIND_CALL(1, 2).Attr<int32_t>("reduce").Attr<I64s>("placement").Attr<I64s>("divert"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherPlacedHandler, AllGatherPlacedImpl,
                              STRATA_BIND_CALL(1, 1).Attr<I64s>("placement"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherReduceHandler, AllGatherReduceImpl,
    STRATA_BIND_CALL(2, 1).Attr<int32_t>("reduce").Attr<I64s>("z_first").Attr<I64s>("x_from"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherPartHandler, AllGatherPartImpl,
                              STRATA_BIND_CALL(1, 1).Attr<I64s>("placement").Attr<int64_t>("part"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherPartIntoHandler, AllGatherPartIntoImpl,
                              STRATA_BIND_CALL(2, 1).Attr<I64s>("placement").Attr<int64_t>("part"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllToAllDivertHandler, AllToAllDivertImpl,
                              STRATA_BIND_CALL(1, 2)
                                  .Attr<int64_t>("split_axis")
                                  .Attr<int64_t>("concat_axis")
                                  .Attr<int64_t>("divert_axis")
                                  .Attr<int64_t>("move_to")
                                  .Attr<I64s>("divert")
                                  .Attr<I64s>("divert_dest"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CheckAcrossFabricsHandler, CheckAcrossImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .OptionalArg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .OptionalRet<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("op")
                                  .Attr<I64s>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<I64s>("devices")
                                  .Attr<I64s>("procs")
                                  .Attr<I64s>("fabrics"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OrderHandler, OrderImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CountInterFabricHandler, CountImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("bytes"));

}  // namespace strata
