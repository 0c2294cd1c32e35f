#include "ffi/hier_handlers.h"

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CountInterFabricHandler, CountImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("bytes"));

}  // namespace strata
