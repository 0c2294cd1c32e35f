// XLA FFI handlers of the collectives: one per operator family. Each decodes its buffers and
// attributes, joins the call on the fabric, runs the algorithm from coll/ and leaves.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace strata {
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllReduceHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllReduceListHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterRowsHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherRowsHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterPlacedHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherPlacedHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherReduceHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherPartHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherPartIntoHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllToAllHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllToAllDivertHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterPlacedDivertHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PermuteHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BroadcastHandler);
}  // namespace strata
