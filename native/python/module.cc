// The nanobind module strata_jax._strata: FFI handler capsules, settings and counters.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "fabric/inproc.h"
#include "fabric/stats.h"
#include "ffi/handlers.h"
#include "ffi/moe_handlers.h"

namespace nb = nanobind;

namespace {
template <class T>
nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_strata, m) {
  m.doc() = "strata_jax native core: XLA FFI handlers of the collectives";
  m.def("handlers", [] {
    nb::dict d;
    d["strata_all_reduce"] = capsule(strata::AllReduceHandler);
    d["strata_reduce_scatter"] = capsule(strata::ReduceScatterHandler);
    d["strata_all_gather"] = capsule(strata::AllGatherHandler);
    d["strata_all_to_all"] = capsule(strata::AllToAllHandler);
    d["strata_permute"] = capsule(strata::PermuteHandler);
    d["strata_broadcast"] = capsule(strata::BroadcastHandler);
    d["strata_moe_dispatch"] = capsule(strata::MoeDispatchHandler);
    d["strata_moe_combine"] = capsule(strata::MoeCombineHandler);
    d["strata_moe_gather"] = capsule(strata::MoeGatherHandler);
    return d;
  });
  m.def(
      "set_timeout", [](double s) { strata::settings().timeout_ms.store(int64_t(s * 1000)); },
      nb::arg("seconds"));
  m.def("get_timeout", [] { return strata::settings().timeout_ms.load() / 1000.0; });
  m.def(
      "set_two_shot_bytes", [](int64_t b) { strata::settings().two_shot_bytes.store(b); },
      nb::arg("nbytes"));
  m.def("get_two_shot_bytes", [] { return strata::settings().two_shot_bytes.load(); });
  m.def("comm_stats", [] {
    auto& s = strata::stats();
    nb::dict d;
    d["calls"] = s.calls.load(std::memory_order_relaxed);
    d["zero_copy_bytes"] = s.zero_copy_bytes.load(std::memory_order_relaxed);
    d["staged_bytes"] = s.staged_bytes.load(std::memory_order_relaxed);
    d["one_shot_all_reduce"] = s.one_shot.load(std::memory_order_relaxed);
    d["two_shot_all_reduce"] = s.two_shot.load(std::memory_order_relaxed);
    d["timeouts"] = s.timeouts.load(std::memory_order_relaxed);
    d["moe_calls"] = s.moe_calls.load(std::memory_order_relaxed);
    return d;
  });
}
