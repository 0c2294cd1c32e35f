#include "fabric/stats.h"

namespace strata {
Stats& stats() {
  static Stats* s = new Stats();
  return *s;
}
}  // namespace strata
