// Collective algorithms over a Team (see fabric/team.h). Every algorithm reads its peers'
// input buffers and writes its own output buffer directly: no staging copy. The caller has
// already run the arrival barrier (buffers published) and runs the departure barrier after.
//
// Work is split evenly across ranks in cache-line-aligned chunks (the paper's balanced
// operators): in a two-shot all-reduce rank r reduces chunk r only, then gathers the other
// reduced chunks straight from the peers' outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "coll/kernels.h"
#include "fabric/team.h"

namespace strata {

// [begin, end) element range of chunk j of `count` elements split across n ranks, with chunk
// boundaries on 64-byte lines.
void chunk_range(size_t count, int esize, int n, int j, size_t* begin, size_t* end);

// Which all-reduce algorithm this rank proposes for `bytes` per rank (one-shot below the
// threshold); every rank then follows rank 0's proposal.
bool use_two_shot(size_t bytes);
// Whether a team of `n` ranks runs an all-reduce of `bytes` per rank two-shot, given that
// use_two_shot() chose it (rank 0's choice): always with more than 2 ranks; with 2 from
// kTwoShotPairBytes on. Two ranks read each other's whole input one-shot, 1.5x the bytes of
// two-shot, which only pays once the outputs no longer stay in the cache: 2 processes under
// mpirun, psum/pmax/pmean two-shot against one-shot 0.66-0.81x the time at 16-64 MiB, 0.87-1.17x
// at 4 MiB, 0.79-1.33x at 64 KiB-1 MiB (three alternated runs, docs/guide/hosts.md).
constexpr size_t kTwoShotPairBytes = size_t{16} << 20;
inline bool two_shot_for(int n, size_t bytes) { return n > 2 || bytes >= kTwoShotPairBytes; }
// The all-reduce algorithm a team of n ranks runs for `bytes` per rank (rank 0's proposal,
// use_two_shot, as every team takes it, two_shot_for), unless the fabric's path cannot run
// two-shot (a low-latency team: one-shot). What strata_jax's debug log reports.
inline bool all_reduce_two_shot(int n, size_t bytes) {
  return use_two_shot(bytes) && two_shot_for(n, bytes);
}

// Bytes one rank of an all-reduce of `bytes` per rank over n ranks reads from or writes to its
// peers' buffers (comm_stats' zero_copy_bytes / peer_bounce_bytes): one-shot reads every peer's
// whole input, (n - 1) x bytes; two-shot reads its 1/n chunk of every peer's input and writes
// the reduced chunk into every peer's output, 2 x (n - 1) x bytes / n.
inline uint64_t all_reduce_peer_bytes(int n, uint64_t bytes, bool two_shot) {
  const uint64_t peers = n > 1 ? static_cast<uint64_t>(n - 1) : 0;
  return two_shot ? 2 * peers * bytes / static_cast<uint64_t>(n) : peers * bytes;
}

// `two_shot` must be the same on every rank: callers take rank 0's published choice.
std::string all_reduce(Team& t, int32_t dtype, ReduceOp op, size_t count, bool two_shot);
// Whether a call writes its output of `out_bytes` per rank with non-temporal stores: decided on
// what the call's ranks in this process write together (coll/kernels.h stream_output), since
// they share its cores' caches: 8 in-process devices writing 1 MiB each leave them all the same.
bool stream_for(const Team& t, size_t out_bytes);
// `bytes` rounded up to a whole number of 64-byte lines.
size_t line_up(size_t bytes);
// One operand of a multi-operand all-reduce: its element type and count (every rank alike).
struct Operand {
  int32_t dtype = 0;
  size_t count = 0;
};
// All-reduce of `nops` operands in one call (a pytree's leaves; the team came from arrive_list),
// each reduced like all_reduce. One-shot: every rank reduces every operand into its own output.
// Two-shot: the operands laid end to end (each from a line boundary) are split into n even,
// line-aligned byte ranges, whatever operands they cross; rank r reduces range r and pushes it
// into every rank's outputs, so the work is balanced for any mix of leaf sizes and dtypes.
std::string all_reduce_list(Team& t, ReduceOp op, const Operand* ops, int nops, bool two_shot);
// psum_scatter over a non-leading dimension, in place: every input is `rows` rows of n blocks
// of `run` elements (the dimensions before the scattered one, then block j of it with the
// dimensions after it), and rank r reduces block r of each row of every input into row a of its
// output (strided reads, no transpose before or after).
std::string reduce_scatter_rows(Team& t, int32_t dtype, ReduceOp op, size_t rows, size_t run);
// all_gather along a non-leading dimension, in place: every input is `rows` rows of `run_bytes`,
// and row a of rank j's input lands at block j of row a of every output (strided writes).
std::string all_gather_rows(Team& t, size_t rows, size_t run_bytes);
// `placement` (n * parts entries, a permutation; null: the identity): each output is `parts`
// equal sub-blocks, and sub-block f of rank r reduces input block placement[r * parts + f] of
// every rank (blocks of out_count / parts elements); the hierarchical psum_scatter takes its
// (local index, fabric) blocks this way instead of reordering the input in one more pass.
// `divert_part` >= 0: that sub-block is written to `out2` instead (left unwritten in the
// output); the two-fabric psum_scatter hands it to XLA's collective-permute as it is.
std::string reduce_scatter(Team& t, int32_t dtype, ReduceOp op, size_t out_count,
                           const int64_t* placement = nullptr, int parts = 1, int divert_part = -1,
                           char* out2 = nullptr);
// `push` (the team publishes every rank's output): rank r copies its input into block r of every
// output, tile by tile while the tile is in cache, so each input byte is read from memory once
// (the floor; measured 1.06-1.4x faster than pulling at 16-64 MiB on 8 in-process devices).
// Otherwise every rank pulls the n blocks into its own output.
// `placement` (n * parts entries, a permutation; null: the identity): each input is `parts`
// equal sub-blocks, and sub-block f of rank j lands at output block placement[j * parts + f]
// (blocks of in_bytes / parts bytes). The hierarchical all_gather (hierarchy/) puts its
// (local index, fabric) blocks straight into group order this way instead of reordering the
// whole output in one more pass.
std::string all_gather(Team& t, size_t in_bytes, bool push, const int64_t* placement = nullptr,
                       int parts = 1);
// All-gather of a op b (two inputs of `count` elements each, combined in that order): rank r
// reduces its block once, tile by tile, and stores it straight into every rank's output at
// `block` (push; r in the plain form). The last two steps of a two-fabric all-reduce in one pass
// (hierarchy/): the partner fabric's shard is combined on the way out instead of in a
// separate pass.
std::string all_gather_reduce(Team& t, int32_t dtype, ReduceOp op, const void* a, const void* b,
                              size_t count, int block);
// The same from packed inputs (pull): every rank published [a | b] (2 * count elements) as its
// input, and each rank reduces every peer's pair into its own output block. For teams whose
// peers' outputs are not writable (the low-latency path). `b_first(j)`: rank j's pair is
// combined as b op a. `a_from(j)`: the rank whose a pairs with rank j's b (j itself in the plain
// form), and the output block the pair lands in.
template <class BFirst, class AFrom>
std::string all_gather_reduce_packed(Team& t, int32_t dtype, ReduceOp op, size_t count,
                                     BFirst b_first, AFrom a_from) {
  const int n = t.size();
  const size_t block = count * dtype_size(dtype);
  char* out = static_cast<char*>(t.peer_out(t.rank()));
  for (int k = 0; k < n; ++k) {
    const int j = (t.rank() + k) % n;
    const int i = a_from(j);
    const void* srcs[2] = {t.peer_in(i), static_cast<const char*>(t.peer_in(j)) + block};
    if (b_first(j)) std::swap(srcs[0], srcs[1]);
    reduce_n(dtype, op, srcs, 2, out + i * block, 0, count);
  }
  return {};
}
// Tiled all-to-all of an array of `shape` (row-major) split along `split` and concatenated along
// `concat`; esize bytes per element.
//
// `divert` (optional): the output's index `divert->index` along `divert->axis` (neither the split
// nor the concat axis) is written to `divert->out` instead, a row-major array of the output's
// shape with that axis of size 1, and left unwritten in the output. The two-fabric all_to_all
// (strata_jax/_src/hierarchy/) diverts the partner fabric's aggregate, which then crosses as
// one buffer with no copy taken out of the output. `move_to`: the output is written with `axis`
// moved to that position (row-major in that order, as jnp.moveaxis(output, axis, move_to)
// would lay it out), so that the caller needs no transpose; divert->out is the same either way
// (the axis has size 1 there). `dest` >= 0: the diverted part gathers, from every rank, the block
// for destination rank `dest` instead of this rank's (the two-fabric ring: a member sends on the
// aggregate of the member it sends to); the kept indices stay this rank's.
struct Divert {
  int axis = -1;
  int64_t index = 0;
  char* out = nullptr;
  int move_to = -1;   // -1: axis stays where it is
  int64_t dest = -1;  // -1: this rank
};
// `only_src` >= 0: copy only the block that comes from rank `only_src`, without the closing
// copy_fence() (InProcTeam::arrive_pairs copies block by block and fences itself).
std::string all_to_all(Team& t, int esize, const std::vector<int64_t>& shape, int split, int concat,
                       const Divert* divert = nullptr, int only_src = -1);
// Output = input of rank `src` (zeros when src < 0).
std::string permute(Team& t, size_t bytes, int src);
// `push` (the team publishes every rank's output; the same on every rank): rank r copies chunk r
// of the root's input into every output (balanced: each rank reads 1/n of the input once),
// else every rank copies the whole input into its own output.
std::string broadcast(Team& t, size_t bytes, int root, bool push);

// Copies a block of extent `shape` between two strided arrays (strides in elements); `stream`:
// non-temporal stores (stream_output() of the whole output the block is part of).
void copy_strided(char* dst, const int64_t* dst_strides, const char* src,
                  const int64_t* src_strides, const int64_t* shape, int ndim, int esize,
                  bool stream);

}  // namespace strata
