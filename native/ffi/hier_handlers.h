// Handlers of the hierarchical collectives (strata_jax/_src/hierarchy.py): XLA's own
// collectives move the bytes between fabrics; this custom call, emitted next to each of them,
// only counts what was handed over, so comm_stats() can split intra- from inter-fabric bytes.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CountInterFabricHandler);

}  // namespace strata
