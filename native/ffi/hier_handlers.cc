#include "ffi/hier_handlers.h"

#include <cstring>

#include "fabric/stats.h"

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OrderHandler, OrderImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CountInterFabricHandler, CountImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("bytes"));

}  // namespace strata
