#include "coll/ragged.h"

#include <cstdint>
#include <sstream>

#include "coll/kernels.h"

namespace strata {

namespace {

// "rows [off, off + size) are outside the <what>'s <rows> rows", the end computed without
// overflow (off and size are any int64 the caller passed; size > 0).
std::string outside(int64_t off, int64_t size, const char* what, int64_t rows) {
  const bool fits = off <= INT64_MAX - size;
  return "rows [" + std::to_string(off) + ", " +
         (fits ? std::to_string(off + size) : std::to_string(off) + " + " + std::to_string(size)) +
         ") are outside the " + what + "'s " + std::to_string(rows) + " rows";
}

// The fault of slice i of sender j (to receiver d = i / per), or "": its send size against the
// receiver's recv size, then its rows against the operand and the output (or its own batch
// element's rows under vmap). `plan` is j's, `recv` d's recv_sizes row. Under vmap (bounds set)
// the batch is merged into the slices (merged slice k * B + e: slice k of batch element e), so
// the message names the user's slice k, recv_sizes index and element e, found from the
// element's rows: element e owns rows [e * rows, (e + 1) * rows) of B * rows.
std::string check_slice(const RaggedShape& s, const int64_t* plan, const int64_t* recv, int j,
                        int64_t i, int64_t per) {
  const int64_t K = s.slices;
  const int d = static_cast<int>(i / per);
  const int64_t in_off = plan[i], size = plan[K + i], out_off = plan[2 * K + i];
  const int64_t slot = j * per + i % per, expect = recv[slot];
  const int64_t* b = s.bounds;
  const int64_t in_lo = b ? b[i] : 0, in_hi = b ? b[K + i] : s.operand_rows;
  const int64_t out_lo = b ? b[2 * K + i] : 0, out_hi = b ? b[3 * K + i] : s.output_rows;
  int64_t batch = 1, elem = -1;  // elem >= 0: under vmap, the batch element named
  if (b) {
    const bool by_in = in_hi > in_lo;
    const int64_t rows = by_in ? in_hi - in_lo : out_hi - out_lo;
    if (rows > 0) {
      elem = (by_in ? in_lo : out_lo) / rows;
      batch = (by_in ? s.operand_rows : s.output_rows) / rows;
    }
  }
  std::string what;
  if (size != expect)
    what = "rank " + std::to_string(j) + " sends " + std::to_string(size) + " rows but rank " +
           std::to_string(d) + "'s recv_sizes[" + std::to_string(slot / batch) + "] is " +
           std::to_string(expect);
  else if (size < 0)
    what = "negative send size " + std::to_string(size);
  else if (size == 0)
    return "";  // an empty slice moves nothing: its offsets are never read (as in XLA)
  else if (in_off < in_lo || in_off > in_hi - size)
    what = outside(in_off - in_lo, size, "operand", in_hi - in_lo);
  else if (out_off < out_lo || out_off > out_hi - size)
    what = outside(out_off - out_lo, size, "output", out_hi - out_lo);
  if (what.empty()) return "";
  std::ostringstream os;
  os << "strata_jax ragged_all_to_all: slice " << i / batch;
  if (elem >= 0) os << " of batch element " << elem << " (under vmap)";
  os << " of rank " << j << " (to rank " << d << "): " << what;
  return os.str();
}

// The first fault of the whole exchange, searched in one fixed order over every (sender,
// receiver) pair: every rank sees every plan after arrival, so every rank finds the same fault
// and fails the call together (a rank failing alone would leave its peers waiting for it).
std::string validate(const Team& t, const RaggedShape& s) {
  const int n = t.size();
  const int64_t K = s.slices, per = K / n;
  for (int j = 0; j < n; ++j) {
    const auto* plan = static_cast<const int64_t*>(t.peer_buf(j, kRaggedPlan));
    for (int64_t i = 0; i < K; ++i) {
      const int d = static_cast<int>(i / per);
      const auto* recv = static_cast<const int64_t*>(t.peer_buf(d, kRaggedPlan)) + 3 * K;
      std::string what = check_slice(s, plan, recv, j, i, per);
      if (!what.empty()) return what;
    }
  }
  return "";
}

// Copies sender j's slices to rank r (plan and operand j's) into r's result.
// `local`: the call's ranks in this process (their outputs share its caches: stream_output).
uint64_t copy_from(const RaggedShape& s, const int64_t* plan, const char* src, int r, int64_t per,
                   char* result, int local) {
  const int64_t K = s.slices;
  const bool stream = stream_output(static_cast<size_t>(s.output_rows) * s.row_bytes * local);
  uint64_t moved = 0;
  for (int64_t sl = 0; sl < per; ++sl) {
    const int64_t i = r * per + sl;  // index in the sender's plan
    const int64_t in_off = plan[i], size = plan[K + i], out_off = plan[2 * K + i];
    if (size == 0 || s.row_bytes == 0) continue;
    const size_t nbytes = static_cast<size_t>(size) * s.row_bytes;
    copy_out(result + out_off * s.row_bytes, src + in_off * s.row_bytes, nbytes, stream);
    moved += nbytes;
  }
  return moved;
}

}  // namespace

std::string ragged_all_to_all(Team& t, const RaggedShape& s, char* result, uint64_t* peer_bytes) {
  std::string err = validate(t, s);
  if (!err.empty()) return err;
  uint64_t from_peers = 0;
  const int n = t.size(), r = t.rank();
  const int64_t per = s.slices / n;
  // Start with the own slices, then the peers in rotated order so that concurrent receivers
  // do not all read rank 0 first.
  for (int step = 0; step < n; ++step) {
    const int j = (r + step) % n;
    const uint64_t moved = copy_from(s, static_cast<const int64_t*>(t.peer_buf(j, kRaggedPlan)),
                                     static_cast<const char*>(t.peer_buf(j, kRaggedOperand)), r,
                                     per, result, t.local_ranks());
    if (j != r) from_peers += moved;
  }
  copy_fence();
  if (peer_bytes) *peer_bytes = from_peers;
  return "";
}

std::string ragged_block(const RaggedShape& s, const RaggedPub& from, const int64_t* my_plan, int j,
                         int r, int n, char* result, uint64_t* moved) {
  const int64_t K = s.slices, per = K / n;
  for (int64_t sl = 0; sl < per; ++sl) {
    std::string what = check_slice(s, from.plan, my_plan + 3 * K, j, r * per + sl, per);
    if (!what.empty()) return what;
  }
  const uint64_t m =
      copy_from(s, from.plan, static_cast<const char*>(from.operand), r, per, result, n);
  if (moved) *moved = m;
  return "";
}

}  // namespace strata
