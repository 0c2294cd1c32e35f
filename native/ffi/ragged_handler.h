#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {
XLA_FFI_DECLARE_HANDLER_SYMBOL(RaggedAllToAllHandler);
}  // namespace strata
