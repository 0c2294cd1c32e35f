#include "common/settings.h"

#include <cstdlib>

#include "common/env.h"

namespace strata {

Settings& settings() {
  static Settings* s = [] {
    auto* st = new Settings();
    if (const char* t = std::getenv("STRATA_TIMEOUT_S")) {
      double v = std::atof(t);
      if (v > 0) st->timeout_ms.store(static_cast<int64_t>(v * 1000));
    }
    st->two_shot_bytes.store(env_bytes("STRATA_TWO_SHOT_BYTES", st->two_shot_bytes.load()));
    return st;
  }();
  return *s;
}

}  // namespace strata
