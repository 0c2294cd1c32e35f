#include "coll/ragged.h"

#include <sstream>

#include "coll/kernels.h"

namespace strata {

std::string ragged_all_to_all(Team& t, const RaggedShape& s, char* result,
                              uint64_t* peer_bytes) {
  uint64_t from_peers = 0;
  const int n = t.size(), r = t.rank();
  const int64_t K = s.slices, per = K / n;
  const auto* mine = static_cast<const int64_t*>(t.peer_buf(r, kRaggedPlan));
  const int64_t* my_recv = mine + 3 * K;
  // Start with the own slices, then the peers in rotated order so that concurrent receivers
  // do not all read rank 0 first.
  for (int step = 0; step < n; ++step) {
    const int j = (r + step) % n;
    const auto* plan = static_cast<const int64_t*>(t.peer_buf(j, kRaggedPlan));
    const auto* src = static_cast<const char*>(t.peer_buf(j, kRaggedOperand));
    for (int64_t sl = 0; sl < per; ++sl) {
      const int64_t i = r * per + sl;  // index in the sender's plan
      const int64_t in_off = plan[i], size = plan[K + i], out_off = plan[2 * K + i];
      const int64_t expect = my_recv[j * per + sl];
      std::string what;
      if (size != expect)
        what = "rank " + std::to_string(j) + " sends " + std::to_string(size) +
               " rows but this rank's recv_sizes[" + std::to_string(j * per + sl) + "] is " +
               std::to_string(expect);
      else if (size < 0)
        what = "negative send size " + std::to_string(size);
      else if (in_off < 0 || in_off > s.operand_rows - size)
        what = "rows [" + std::to_string(in_off) + ", " + std::to_string(in_off + size) +
               ") of rank " + std::to_string(j) + "'s operand are outside its " +
               std::to_string(s.operand_rows) + " rows";
      else if (out_off < 0 || out_off > s.output_rows - size)
        what = "rows [" + std::to_string(out_off) + ", " + std::to_string(out_off + size) +
               ") are outside the output's " + std::to_string(s.output_rows) + " rows";
      if (!what.empty()) {
        std::ostringstream os;
        os << "strata_jax ragged_all_to_all: slice " << i << " from rank " << j << " to rank "
           << r << ": " << what;
        return os.str();
      }
      if (size == 0 || s.row_bytes == 0) continue;
      const size_t nbytes = static_cast<size_t>(size) * s.row_bytes;
      copy_bytes(result + out_off * s.row_bytes, src + in_off * s.row_bytes, nbytes);
      if (j != r) from_peers += nbytes;
    }
  }
  copy_fence();
  if (peer_bytes) *peer_bytes = from_peers;
  return "";
}

}  // namespace strata
