// Handlers of the hierarchical collectives (strata_jax/_src/hierarchy/): XLA's own
// collectives move the bytes between fabrics; this custom call, emitted next to each of them,
// only counts what was handed over, so comm_stats() can split intra- from inter-fabric bytes.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CountInterFabricHandler);
// strata_check_across_fabrics(x, descs, partition id[, after]) -> x[, done]: compares the call
// descriptors of the members of an inter-fabric group (gathered by XLA's collective just before)
// and fails naming every member's call when they differ; hands x on (aliased) otherwise.
XLA_FFI_DECLARE_HANDLER_SYMBOL(CheckAcrossFabricsHandler);
// strata_order(x, after) -> x: hands x on (its result aliases x; copies only if XLA gave it a
// buffer of its own) and reads nothing of `after`, the previous strata call's Done: it puts a
// cond or while loop holding strata calls after that call in XLA's thunk graph
// (program_order.py: _order_control_flow).
XLA_FFI_DECLARE_HANDLER_SYMBOL(OrderHandler);

}  // namespace strata
