#include "coll/collectives.h"

#include <cstring>

#include "common/settings.h"

namespace strata {

void chunk_range(size_t count, int esize, int n, int j, size_t* begin, size_t* end) {
  const size_t line = esize >= 64 ? 1 : static_cast<size_t>(64 / esize);
  size_t c = (count + n - 1) / n;
  c = (c + line - 1) / line * line;
  size_t b = c * j, e = c * (j + 1);
  *begin = b < count ? b : count;
  *end = e < count ? e : count;
}

size_t line_up(size_t bytes) { return (bytes + 63) / 64 * 64; }

bool stream_for(const Team& t, size_t out_bytes) {
  return stream_output(out_bytes * static_cast<size_t>(t.local_ranks()));
}

bool use_two_shot(size_t bytes) {
  return bytes >= static_cast<size_t>(settings().two_shot_bytes.load());
}

namespace {
// Reduces elements [begin, end) of the n_srcs sources tile by tile, while the tile is still in
// cache, and stores each reduced tile into every rank's output (outs[j], one per rank) at byte
// out_offset + (i - begin) * esize: every source byte read once, every output byte written once
// (streaming stores: no read for ownership).
void reduce_push(Team& t, int32_t dtype, ReduceOp op, const void* const* srcs, int n_srcs,
                 void* const* outs, size_t begin, size_t end, size_t out_offset, bool stream) {
  const int n = t.size(), r = t.rank(), es = dtype_size(dtype);
  constexpr size_t kTileBytes = 64 * 1024;
  alignas(64) static thread_local unsigned char tile[kTileBytes];
  const size_t tile_elems = kTileBytes / es;
  for (size_t t0 = begin; t0 < end; t0 += tile_elems) {
    const size_t t1 = (end - t0 < tile_elems) ? end : t0 + tile_elems;
    reduce_n_to(dtype, op, srcs, n_srcs, tile, t0, t1);
    const size_t at = out_offset + (t0 - begin) * es;
    for (int k = 0; k < n; ++k) {
      const int j = (r + k) % n;  // staggered so ranks do not all write one peer at once
      copy_out(static_cast<char*>(outs[j]) + at, tile, (t1 - t0) * es,
               stream || (t1 - t0) * es >= kPeerStreamBytes);
    }
  }
  copy_fence();
}

std::vector<void*> peer_outs(Team& t) {
  std::vector<void*> outs(t.size());
  for (int j = 0; j < t.size(); ++j) outs[j] = t.peer_out(j);
  return outs;
}
}  // namespace

std::string all_reduce(Team& t, int32_t dtype, ReduceOp op, size_t count, bool two_shot) {
  const int n = t.size(), r = t.rank(), es = dtype_size(dtype);
  std::vector<const void*> srcs(n);
  for (int j = 0; j < n; ++j) srcs[j] = t.peer_in(j);
  char* out = static_cast<char*>(t.peer_out(r));
  if (!two_shot) {
    // One-shot: every rank reduces everything from the peers' inputs (latency-bound sizes:
    // no extra synchronization, each rank touches only its own output).
    reduce_n(dtype, op, srcs.data(), n, out, 0, count);
    return {};
  }
  // Two-shot over a shared address space: rank r reduces chunk r of all inputs once (the
  // reduce-scatter shot) and stores the reduced chunk straight into every rank's output (the
  // gather shot), tile by tile while the tile is still in cache. Every input byte is read once
  // and every output byte written once (streaming stores: no read for ownership), the minimum
  // traffic, and no barrier between the shots.
  size_t b, e;
  chunk_range(count, es, n, r, &b, &e);
  reduce_push(t, dtype, op, srcs.data(), n, peer_outs(t).data(), b, e, b * es,
              stream_for(t, count * es));
  return {};
}

std::string all_reduce_list(Team& t, ReduceOp op, const Operand* ops, int nops, bool two_shot) {
  const int n = t.size(), r = t.rank();
  std::vector<const void*> srcs(n);
  std::vector<void*> outs(n);
  if (!two_shot) {
    for (int k = 0; k < nops; ++k) {
      if (!ops[k].count) continue;
      for (int j = 0; j < n; ++j) srcs[j] = t.peer_in_at(j, k);
      reduce_n(ops[k].dtype, op, srcs.data(), n, t.peer_out_at(r, k), 0, ops[k].count);
    }
    return {};
  }
  // Two-shot over the operands laid end to end, each from a 64-byte boundary: rank r reduces
  // the r-th of n even, line-aligned byte ranges of that virtual buffer, whichever operands it
  // covers, and pushes each reduced tile into every rank's output of that operand. A range
  // boundary is a multiple of 64 bytes from an operand's start, so an element boundary of
  // every dtype.
  size_t total = 0;
  for (int k = 0; k < nops; ++k) total += line_up(ops[k].count * dtype_size(ops[k].dtype));
  size_t b, e;
  chunk_range(total, 1, n, r, &b, &e);
  size_t start = 0;
  for (int k = 0; k < nops && start < e; ++k) {
    const int es = dtype_size(ops[k].dtype);
    const size_t bytes = ops[k].count * es;
    const size_t lo = b > start ? b : start, hi = e < start + bytes ? e : start + bytes;
    if (lo < hi) {
      for (int j = 0; j < n; ++j) {
        srcs[j] = t.peer_in_at(j, k);
        outs[j] = t.peer_out_at(j, k);
      }
      reduce_push(t, ops[k].dtype, op, srcs.data(), n, outs.data(), (lo - start) / es,
                  (hi - start) / es, lo - start, stream_for(t, total));
    }
    start += line_up(bytes);
  }
  return {};
}

std::string reduce_scatter_rows(Team& t, int32_t dtype, ReduceOp op, size_t rows, size_t run) {
  const int n = t.size(), r = t.rank(), es = dtype_size(dtype);
  std::vector<const void*> srcs(n);
  char* out = static_cast<char*>(t.peer_out(r));
  // Row by row: a row's block r lies between the blocks of the other ranks in every input.
  for (size_t a = 0; a < rows; ++a) {
    const size_t from = (a * n + r) * run * es;
    for (int j = 0; j < n; ++j) srcs[j] = static_cast<const char*>(t.peer_in(j)) + from;
    reduce_n(dtype, op, srcs.data(), n, out + a * run * es, 0, run);
  }
  return {};
}

std::string all_gather_rows(Team& t, size_t rows, size_t run_bytes) {
  const int n = t.size(), r = t.rank();
  char* out = static_cast<char*>(t.peer_out(r));
  const bool stream = stream_for(t, rows * n * run_bytes);
  for (int k = 0; k < n; ++k) {
    const int j = (r + k) % n;
    const char* in = static_cast<const char*>(t.peer_in(j));
    for (size_t a = 0; a < rows; ++a)
      copy_out(out + (a * n + j) * run_bytes, in + a * run_bytes, run_bytes, stream);
  }
  copy_fence();
  return {};
}

std::string reduce_scatter(Team& t, int32_t dtype, ReduceOp op, size_t out_count,
                           const int64_t* placement, int parts, int divert_part, char* out2) {
  const int n = t.size(), r = t.rank(), es = dtype_size(dtype);
  const size_t sub = out_count / parts;
  std::vector<const void*> srcs(n);
  for (int f = 0; f < parts; ++f) {
    const size_t block = placement ? placement[r * parts + f] : r * parts + f;
    for (int j = 0; j < n; ++j) srcs[j] = static_cast<const char*>(t.peer_in(j)) + block * sub * es;
    char* dst = f == divert_part ? out2 : static_cast<char*>(t.peer_out(r)) + f * sub * es;
    reduce_n(dtype, op, srcs.data(), n, dst, 0, sub);
  }
  return {};
}

namespace {
// Copies src[0, bytes) to byte `at` of every rank's output, tile by tile: the tile is read from
// memory once and stays in cache for the n copies (streaming stores: no read for ownership).
void copy_push(Team& t, const char* src, size_t bytes, size_t at, bool stream) {
  const int n = t.size(), r = t.rank();
  constexpr size_t kTileBytes = 64 * 1024;
  for (size_t t0 = 0; t0 < bytes; t0 += kTileBytes) {
    const size_t len = bytes - t0 < kTileBytes ? bytes - t0 : kTileBytes;
    for (int k = 0; k < n; ++k) {
      const int j = (r + k) % n;  // staggered so ranks do not all write one peer at once
      copy_out(static_cast<char*>(t.peer_out(j)) + at + t0, src + t0, len, stream);
    }
  }
  copy_fence();
}
}  // namespace

std::string all_gather(Team& t, size_t in_bytes, bool push, const int64_t* placement, int parts) {
  const int n = t.size(), r = t.rank();
  const size_t sub = in_bytes / parts;
  // Output byte offset of sub-block f of rank j's input.
  auto at = [&](int j, int f) {
    return static_cast<size_t>(placement ? placement[j * parts + f] : j * parts + f) * sub;
  };
  const char* mine = static_cast<const char*>(t.peer_in(r));
  const bool stream = stream_for(t, in_bytes * n);
  if (push) {
    for (int f = 0; f < parts; ++f) copy_push(t, mine + f * sub, sub, at(r, f), stream);
    return {};
  }
  char* out = static_cast<char*>(t.peer_out(r));
  for (int k = 0; k < n; ++k) {
    const int j = (r + k) % n;
    const char* in = static_cast<const char*>(t.peer_in(j));
    for (int f = 0; f < parts; ++f) copy_out(out + at(j, f), in + f * sub, sub, stream);
  }
  copy_fence();
  return {};
}

std::string all_gather_reduce(Team& t, int32_t dtype, ReduceOp op, const void* a, const void* b,
                              size_t count, int block) {
  const void* srcs[2] = {a, b};
  const size_t bytes = count * dtype_size(dtype);
  reduce_push(t, dtype, op, srcs, 2, peer_outs(t).data(), 0, count,
              static_cast<size_t>(block) * bytes, stream_for(t, bytes * t.size()));
  return {};
}

void copy_strided(char* dst, const int64_t* dst_strides, const char* src,
                  const int64_t* src_strides, const int64_t* shape, int ndim, int esize,
                  bool stream) {
  // Merge trailing dimensions that are contiguous in both arrays into one run.
  int64_t run = 1;
  int d = ndim;
  while (d > 0 && dst_strides[d - 1] == run && src_strides[d - 1] == run) {
    run *= shape[d - 1];
    --d;
  }
  const size_t run_bytes = static_cast<size_t>(run) * esize;
  if (d == 0) {
    copy_out(dst, src, run_bytes, stream);
    return;
  }
  // Iterate the remaining outer index space with an odometer.
  int64_t idx[16] = {0};
  for (;;) {
    int64_t so = 0, doff = 0;
    for (int k = 0; k < d; ++k) {
      so += idx[k] * src_strides[k];
      doff += idx[k] * dst_strides[k];
    }
    copy_out(dst + doff * esize, src + so * esize, run_bytes, stream);
    int k = d - 1;
    while (k >= 0 && ++idx[k] == shape[k]) idx[k--] = 0;
    if (k < 0) break;
  }
}

std::string all_to_all(Team& t, int esize, const std::vector<int64_t>& shape, int split, int concat,
                       const Divert* divert, int only_src) {
  const int n = t.size(), r = t.rank(), nd = static_cast<int>(shape.size());
  if (nd > 16) return "all_to_all supports at most 16 dimensions";
  std::vector<int64_t> b(shape);
  b[split] /= n;
  std::vector<int64_t> o(b);
  o[concat] *= n;
  std::vector<int64_t> ss(nd), ds(nd);
  int64_t acc = 1, acc2 = 1;
  for (int k = nd - 1; k >= 0; --k) {
    ss[k] = acc;
    ds[k] = acc2;
    acc *= shape[k];
    acc2 *= o[k];
  }
  for (int64_t v : b)
    if (v == 0) return {};
  // Diverted: one block of extent `b` with divert->axis of size 1 goes to each of the two
  // destinations per source, the kept indices to `out`, the diverted one to divert->out.
  const int dax = divert ? divert->axis : -1;
  if (divert && (dax < 0 || dax >= nd || dax == split || dax == concat || divert->index < 0 ||
                 divert->index >= shape[dax] || divert->dest >= n))
    return "internal error: all_to_all divert axis, index or destination out of range";
  const int64_t gather_for = divert && divert->dest >= 0 ? divert->dest : r;
  std::vector<int64_t> ds2(nd);  // strides of divert->out: the output's shape, dax of size 1
  if (divert) {
    if (divert->move_to >= nd) return "internal error: all_to_all divert move_to out of range";
    int64_t a = 1;
    for (int k = nd - 1; k >= 0; --k) {
      ds2[k] = a;
      a *= k == dax ? 1 : o[k];
    }
    if (divert->move_to >= 0 && divert->move_to != dax) {
      // The output's memory order: its dims with dax taken out and put back at move_to; the
      // stride of each logical dim is that of its place in this order.
      std::vector<int> order;
      for (int k = 0; k < nd; ++k)
        if (k != dax) order.push_back(k);
      order.insert(order.begin() + divert->move_to, dax);
      int64_t m = 1;
      for (int i = nd - 1; i >= 0; --i) {
        ds[order[i]] = m;
        m *= o[order[i]];
      }
    }
  }
  std::vector<int64_t> one(b);  // a block with dax of size 1 (the diverted form's unit)
  if (divert) one[dax] = 1;
  char* out = static_cast<char*>(t.peer_out(r));
  size_t out_bytes = esize;
  for (int64_t v : o) out_bytes *= static_cast<size_t>(v);
  const bool stream = stream_for(t, out_bytes);
  if (only_src >= n) return "internal error: all_to_all source rank out of range";
  for (int k = 0; k < n; ++k) {
    const int j = (r + k) % n;
    if (only_src >= 0 && j != only_src) continue;
    const char* src = static_cast<const char*>(t.peer_in(j)) + r * b[split] * ss[split] * esize;
    char* dst = out + j * b[concat] * ds[concat] * esize;
    if (!divert) {
      copy_strided(dst, ds.data(), src, ss.data(), b.data(), nd, esize, stream);
      continue;
    }
    for (int64_t i = 0; i < shape[dax]; ++i) {
      const char* s = src + i * ss[dax] * esize;
      if (i == divert->index)
        copy_strided(divert->out + j * b[concat] * ds2[concat] * esize, ds2.data(),
                     s + (gather_for - r) * b[split] * ss[split] * esize, ss.data(), one.data(), nd,
                     esize, stream);
      else
        copy_strided(dst + i * ds[dax] * esize, ds.data(), s, ss.data(), one.data(), nd, esize,
                     stream);
    }
  }
  if (only_src < 0) copy_fence();
  return {};
}

std::string permute(Team& t, size_t bytes, int src) {
  void* out = t.peer_out(t.rank());
  if (src < 0) {
    if (bytes) std::memset(out, 0, bytes);
  } else {
    copy_out(out, t.peer_in(src), bytes, stream_for(t, bytes));
  }
  copy_fence();
  return {};
}

std::string broadcast(Team& t, size_t bytes, int root, bool push) {
  if (push) {
    size_t b, e;
    chunk_range(bytes, 1, t.size(), t.rank(), &b, &e);
    copy_push(t, static_cast<const char*>(t.peer_in(root)) + b, e - b, b, stream_for(t, bytes));
    return {};
  }
  copy_out(t.peer_out(t.rank()), t.peer_in(root), bytes, stream_for(t, bytes));
  copy_fence();
  return {};
}

}  // namespace strata
