// Element kernels of the collectives: reductions over the inputs of all ranks, and copies.
//
// Every reduction folds the ranks in rank order 0, 1, ..., n-1 whatever rank computes it, so
// every rank gets bitwise the same result. bfloat16 and float16 accumulate in float32 and round
// once. pmax/pmin propagate NaN (IEEE-754 maximum/minimum) whatever the rank order. Integer sums
// wrap (computed in the unsigned type of the same width, like XLA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/ops.h"

namespace strata {

// The reductions (ReduceOp) are rows of common/ops.h's STRATA_REDUCTIONS. kMean: the sum over
// the n sources divided by n (pmean), on floating types only: the sum is rounded to the element
// type, then multiplied by 1/n (and rounded again), bitwise what psum followed by XLA CPU's
// divide gives, but inside the reduction's own pass over the output instead of in one more.

// Element types as XLA FFI numbers them (xla::ffi::DataType).
int dtype_size(int32_t dtype);  // bytes per element, 0 if unsupported
const char* dtype_name(int32_t dtype);
bool reduce_supported(int32_t dtype, ReduceOp op);

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[n-1][i] for i in [begin, end).
// Pointers are to whole buffers; begin/end are element indices. dst may alias no src.
void reduce_n(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst, size_t begin,
              size_t end);

// Like reduce_n, but writes element i to dst_tile[i - begin] (dst points at element `begin`).
void reduce_n_to(int32_t dtype, ReduceOp op, const void* const* srcs, int n, void* dst_tile,
                 size_t begin, size_t end);

// memcpy through the "copy engine" (CPU here; an SDMA/copy engine on accelerators). Copies of
// at least kStreamBytes use non-temporal stores: the destination is not read for ownership and
// not cached, which saves a third of the memory traffic of a copy whose result cannot stay in
// the cache anyway. Below that, plain (cached) stores: the output stays in this core's cache for
// the op that reads it next, and a buffer written again soon (a pool's reused output) is written
// in cache instead of in memory. The threshold is 2 MiB, twice the 1 MiB L2 of a core here:
// measured between two processes copying 1 MiB from each other into a reused buffer, plain
// stores 36-40 us, non-temporal 90-95; at 2 MiB with inputs rewritten between calls,
// non-temporal 190 us against 282 (collectives.py under mpirun: docs/guide/hosts.md).
// Callers must call copy_fence() before publishing the data to another thread (non-temporal
// stores are weakly ordered).
constexpr size_t kStreamBytes = size_t{2} << 20;
// A two-shot all-reduce's tiles, which each rank pushes into every rank's output, keep
// non-temporal stores from this size per tile, whatever the output's size: a line the owner
// still holds in its cache (last step's gradients, read by its optimizer) would otherwise be
// taken from it for ownership, and the owner then reads it back from this core's cache.
// train_moe.py --preset paper under launch -n 4, whose gradient pmean is such an all-reduce,
// runs 1.44-1.50x xla_sort's speed so, 1.38-1.42x with plain stores there. Pushed copies
// (all_gather, pbroadcast) follow stream_output instead: under this rule they run at 0.92x XLA
// over MPI's speed (all_gather 1 MiB, 2 processes), under stream_output at 1.52x.
constexpr size_t kPeerStreamBytes = 32 * 1024;
// zero_bytes' threshold (MoE dispatch's unused capacity rows, zeroed with non-temporal stores
// from this size on).
constexpr size_t kZeroStreamBytes = 32 * 1024;
void copy_bytes(void* dst, const void* src, size_t bytes);
// The threshold: STRATA_STREAM_BYTES (K/M/G suffixes), else kStreamBytes.
size_t stream_bytes();
// Whether the copies into an output of `out_bytes` (the whole buffer that one call writes, of
// which each copy is a part) use non-temporal stores: out_bytes >= stream_bytes(). A
// collective decides once for its output, not per block: the blocks of a large output are
// small (a rank's share, a 64 KiB tile) but together leave the caches all the same.
bool stream_output(size_t out_bytes);
// copy_bytes with the store kind decided by the caller (stream_output of the whole output).
void copy_out(void* dst, const void* src, size_t bytes, bool stream);
// Non-temporal stores whatever the size: for many small copies (rows) into a large buffer that
// is only written here, where copy_bytes would take each one as a small, cached copy.
void copy_bytes_stream(void* dst, const void* src, size_t bytes);
// copy_bytes_stream that also prefetches `next` (the source of the copy that follows, as many
// bytes, or null) one line per line copied: for rows gathered from unpredictable addresses, where
// each row would otherwise start with a full memory round trip.
void copy_bytes_stream_prefetch(void* dst, const void* src, size_t bytes, const void* next);
// Zeroes `bytes` at dst, with non-temporal stores from kZeroStreamBytes on (a large region that
// is only written here, e.g. the unused capacity rows of a MoE receive buffer): no read for
// ownership. Callers fence with copy_fence() before publishing, as after copy_bytes.
void zero_bytes(void* dst, size_t bytes);
void copy_fence();

// Outputs of at least kHugeOutputBytes: before a call writes its output, prepare_output asks the
// kernel for transparent huge pages on the buffer's 2 MiB-aligned interior (madvise
// MADV_HUGEPAGE). XLA CPU allocates each large output with posix_memalign; glibc serves every
// request of 32 MiB or more (its largest mmap threshold) from a fresh mmap and unmaps it at free,
// so the first write faults every 4 KiB page in: 131,072 faults (~2 us each here) per 512 MiB of
// outputs, more than the copy itself. With the advice the same first write takes one fault per
// 2 MiB. Below 32 MiB glibc may hand out reused, already populated heap memory, where the advice
// measured harmful (a 16 MiB psum 2-5x slower: huge-page collapse and compaction on reuse), so
// the threshold is glibc's. Off with STRATA_THP=0; a no-op where the kernel has no THP or the
// memory is not anonymous (a pool segment).
constexpr size_t kHugeOutputBytes = size_t{32} << 20;
void prepare_output(void* dst, size_t bytes);

}  // namespace strata
