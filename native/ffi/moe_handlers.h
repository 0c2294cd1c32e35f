// XLA FFI handlers of MoE dispatch/combine (native/moe/): decode buffers and attributes, join
// the call on the fabric as the collectives do (ffi/handlers.cc), move the rows, leave.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeDispatchHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeCombineHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeGatherHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePlanHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeLowLatencyDispatchHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeLowLatencyCombineHandler);
}  // namespace strata
