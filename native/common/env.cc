#include "common/env.h"

#include <cerrno>
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

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

}  // namespace strata
