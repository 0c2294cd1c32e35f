#include "ffi/hier_handlers.h"

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>

#include "fabric/stats.h"
#include "ffi/common.h"

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

std::string chars(const int32_t* w, int words) {
  std::string s;
  for (int i = 0; i < 4 * words; ++i) {
    const char c = static_cast<char>((static_cast<uint32_t>(w[i / 4]) >> (8 * (i % 4))) & 0xff);
    if (c == 0) break;
    s += c;
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

}  // namespace

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
