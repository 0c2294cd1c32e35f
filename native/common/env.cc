#include "common/env.h"

#include <cerrno>
#include <climits>
#include <cstdlib>

namespace strata {

int64_t env_bytes(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (end == v || x < 0 || errno) return dflt;
  int64_t scale = 1;
  switch (*end) {
    case 'k':
    case 'K':
      scale = int64_t{1} << 10;
      ++end;
      break;
    case 'm':
    case 'M':
      scale = int64_t{1} << 20;
      ++end;
      break;
    case 'g':
    case 'G':
      scale = int64_t{1} << 30;
      ++end;
      break;
    default:
      break;
  }
  return *end ? dflt : static_cast<int64_t>(x) * scale;
}

int env_count(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (*v < '0' || *v > '9' || *end || errno || x > INT_MAX) return dflt;
  return static_cast<int>(x);
}

bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (v && v[0] == '1' && !v[1]) return true;
  if (v && v[0] == '0' && !v[1]) return false;
  return dflt;
}

}  // namespace strata
