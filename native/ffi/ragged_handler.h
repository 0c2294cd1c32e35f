#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {
XLA_FFI_DECLARE_HANDLER_SYMBOL(RaggedAllToAllHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmptyHandler);
}  // namespace strata
