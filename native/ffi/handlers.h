// The XLA FFI handlers, one per target of common/ops.h (STRATA_TARGETS): declared here from the
// table, defined where their operator's code is (handlers.cc, hier_handlers.cc, moe_handlers.cc,
// ragged_handler.cc), registered with XLA from the table (native/python/module.cc).
#pragma once

#include "common/ops.h"
#include "xla/ffi/api/ffi.h"

namespace strata {
#define STRATA_DECLARE_HANDLER(target, handler) XLA_FFI_DECLARE_HANDLER_SYMBOL(handler);
STRATA_TARGETS(STRATA_DECLARE_HANDLER)
#undef STRATA_DECLARE_HANDLER
}  // namespace strata
