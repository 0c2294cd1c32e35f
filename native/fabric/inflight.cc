#include "fabric/inflight.h"

#include <mutex>
#include <unordered_map>
#include <vector>

#include "fabric/stats.h"

namespace strata {
namespace {

struct Table {
  std::mutex mu;
  // device -> (run id, calls of that run in flight on the device)
  std::unordered_map<int64_t, std::vector<std::pair<int64_t, int>>> by_device;
};
Table& table() {
  static Table* t = new Table();  // never destroyed: XLA threads may outlive exit
  return *t;
}

void raise_max(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

InFlight::InFlight(int64_t device, int64_t run_id) : device_(device), run_id_(run_id) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto& runs = t.by_device[device];
  bool found = false;
  for (auto& r : runs) {
    if (r.first == run_id) {
      ++r.second;
      found = true;
    }
    calls_ += r.second;
  }
  if (!found) {
    runs.emplace_back(run_id, 1);
    calls_ += 1;
  }
  runs_ = static_cast<int>(runs.size());
  raise_max(stats().max_calls_in_flight, static_cast<uint64_t>(calls_));
  raise_max(stats().max_runs_in_flight, static_cast<uint64_t>(runs_));
}

InFlight::~InFlight() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto& runs = t.by_device[device_];
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].first != run_id_) continue;
    if (--runs[i].second == 0) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
}

}  // namespace strata
