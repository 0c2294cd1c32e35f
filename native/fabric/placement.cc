#include <string>
#include <vector>

#include "fabric/team.h"

namespace strata {

std::string place(int64_t partition, const std::vector<int64_t>& mesh_shape,
                  const std::vector<int64_t>& axes, Placement* out) {
  const int nd = static_cast<int>(mesh_shape.size());
  int64_t total = 1;
  for (int64_t s : mesh_shape) total *= s;
  if (partition < 0 || partition >= total)
    return "partition id " + std::to_string(partition) + " is outside the mesh of " +
           std::to_string(total) + " devices";
  std::vector<int64_t> coord(nd);
  int64_t p = partition;
  for (int d = nd - 1; d >= 0; --d) {
    coord[d] = p % mesh_shape[d];
    p /= mesh_shape[d];
  }
  std::vector<bool> in_axes(nd, false);
  int64_t rank = 0, size = 1;
  for (int64_t a : axes) {
    if (a < 0 || a >= nd || in_axes[a]) return "invalid or repeated mesh axis in collective";
    in_axes[a] = true;
    rank = rank * mesh_shape[a] + coord[a];
    size *= mesh_shape[a];
  }
  int64_t group = 0;
  for (int d = 0; d < nd; ++d)
    if (!in_axes[d]) group = group * mesh_shape[d] + coord[d];
  out->group = group;
  out->rank = static_cast<int>(rank);
  out->size = static_cast<int>(size);
  out->partition = partition;
  return {};
}

}  // namespace strata
