// What fabric/team.h declares beyond the Team interface: a rank's placement in its group, and
// the words every fabric's timeout message starts with.
#include "fabric/team.h"

#include <sstream>
#include <string>

#include "common/settings.h"

namespace strata {

namespace {
// splitmix64 finalizer: a cheap, well-mixed 64-bit hash step.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

std::string place_in_groups(int64_t partition, const int64_t* groups, size_t groups_len,
                            int64_t group_size, const int64_t* device_ids, size_t num_devices,
                            Placement* out) {
  if (group_size < 1 || groups_len % static_cast<size_t>(group_size) != 0)
    return "internal error: groups attribute is not a whole number of rows";
  if (partition < 0 || static_cast<size_t>(partition) >= num_devices)
    return "partition id " + std::to_string(partition) + " is outside the program's " +
           std::to_string(num_devices) + " devices";
  for (size_t i = 0; i < groups_len; ++i) {
    if (groups[i] != partition) continue;
    const size_t row = i / static_cast<size_t>(group_size);
    const int64_t* members = groups + row * static_cast<size_t>(group_size);
    uint64_t h = mix(static_cast<uint64_t>(group_size));
    for (int64_t r = 0; r < group_size; ++r) {
      const int64_t p = members[r];
      if (p < 0 || static_cast<size_t>(p) >= num_devices)
        return "internal error: group member outside the program's devices";
      h = mix(h ^ static_cast<uint64_t>(device_ids[p]));
    }
    out->group = static_cast<int64_t>(row);
    out->rank = static_cast<int>(i % static_cast<size_t>(group_size));
    out->size = static_cast<int>(group_size);
    out->partition = partition;
    out->device = device_ids[partition];
    out->comm = h;
    out->member_parts = members;
    out->device_ids = device_ids;
    return {};
  }
  return "partition id " + std::to_string(partition) + " is in none of the collective's groups";
}

std::string timed_out_waiting(const char* op, const char* phase, const std::vector<int>& missing) {
  std::ostringstream os;
  os << "strata_jax " << op << ": timed out after " << settings().timeout_ms.load() / 1000.0
     << " s in phase '" << phase << "' waiting for rank(s) [";
  for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
  os << "]";
  return os.str();
}

}  // namespace strata
