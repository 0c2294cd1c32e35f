#include "fabric/stats.h"

#include <mutex>

namespace strata {
Stats& stats() {
  static Stats* s = new Stats();
  return *s;
}
namespace {
std::mutex hint_mu;
std::string& hint_text() {
  static std::string h;
  return h;
}
}  // namespace

void set_timeout_hint(const std::string& hint) {
  std::lock_guard<std::mutex> lock(hint_mu);
  hint_text() = hint;
}

std::string timeout_hint() {
  std::lock_guard<std::mutex> lock(hint_mu);
  return hint_text();
}

}  // namespace strata
