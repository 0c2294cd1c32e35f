// The nanobind module strata_jax._strata: FFI handler capsules, settings and counters.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <utility>

#include "coll/collectives.h"
#include "coll/kernels.h"
#include "common/ops.h"
#include "common/settings.h"
#include "fabric/inproc.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"
#include "fabric/stats.h"
#include "ffi/handlers.h"
#include "mpiabi/engine.h"

namespace nb = nanobind;

namespace {
template <class T>
nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// MPI finalisation after the interpreter is gone (finalize_mpi_at_exit): MPIwrapper's entry
// points, found in the copy MPItrampoline already loaded.
using MpiIntFn = int (*)(int*);
using MpiVoidFn = int (*)();
MpiIntFn g_mpi_finalized = nullptr;
MpiVoidFn g_mpi_finalize = nullptr;

void FinalizeMpiAtExit() {
  int done = 0;
  if (g_mpi_finalized) g_mpi_finalized(&done);
  if (!done && g_mpi_finalize) g_mpi_finalize();
}
}  // namespace

#ifndef STRATA_BUILT_JAXLIB
#define STRATA_BUILT_JAXLIB "unknown"
#endif

NB_MODULE(_strata, m) {
  m.doc() = "strata_jax native core: XLA FFI handlers of the collectives";
  // The jaxlib whose XLA FFI headers the handlers were built against, and their API version:
  // a jaxlib older than that API refuses the handlers (extension.load() checks the pair).
  m.def("build_info", [] {
    nb::dict d;
    d["jaxlib"] = STRATA_BUILT_JAXLIB;
    d["ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    return d;
  });
  // XLA's MPI collectives register MPI_Finalize with Python's atexit, which runs before the
  // interpreter drops the CPU client: its communicators are then freed after MPI_Finalize and
  // Open MPI aborts the process ("MPI_Comm_free() ... after MPI_FINALIZE"). Py_AtExit functions
  // run at the very end of Py_FinalizeEx, after every object the interpreter frees is gone (as
  // mpi4py finalises MPI). `library` is the MPITRAMPOLINE_LIB that XLA's MPItrampoline loaded:
  // only that already-loaded copy is used (RTLD_NOLOAD). Returns false when it is not loaded
  // or lacks MPIABI_Finalize (the caller then keeps XLA's own finalisation).
  m.def(
      "finalize_mpi_at_exit",
      [](const std::string& library) {
        if (g_mpi_finalize) return true;
        void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
        if (!h) return false;
        auto fin = reinterpret_cast<MpiVoidFn>(dlsym(h, "MPIABI_Finalize"));
        auto finalized = reinterpret_cast<MpiIntFn>(dlsym(h, "MPIABI_Finalized"));
        if (!fin || !finalized || Py_AtExit(&FinalizeMpiAtExit) != 0) {
          dlclose(h);
          return false;
        }
        g_mpi_finalized = finalized;
        g_mpi_finalize = fin;
        return true;  // the handle stays open for the exit
      },
      nb::arg("library"));
  // ---- strata's engine for XLA's MPI collectives (native/mpiabi; strata_jax/_src/engine.py) ----
  m.def(
      "mpi_engine_attach",
      [](const std::string& library) {
        std::string why;
        const bool ok = strata::mpiabi::engine_attach(library.c_str(), &why);
        return nb::make_tuple(ok, why);
      },
      nb::arg("library"));
  m.def(
      "mpi_engine_configure",
      [](int rank, int size) { strata::mpiabi::engine_configure(rank, size); }, nb::arg("rank"),
      nb::arg("size"));
  m.def(
      "mpi_engine_set_world",
      [](const std::vector<int64_t>& devices, const std::vector<int>& procs) {
        std::string err = strata::mpiabi::engine_set_world(devices, procs);
        if (!err.empty()) throw std::runtime_error("strata_jax MPI engine: " + err);
      },
      nb::arg("devices"), nb::arg("processes"));
  m.def("mpi_engine_info", [] {
    const auto i = strata::mpiabi::engine_info();
    nb::dict d;
    d["attached"] = i.attached;
    d["configured"] = i.configured;
    d["initialized"] = i.initialized;
    d["finalized"] = i.finalized;
    d["rank"] = i.rank;
    d["size"] = i.size;
    d["communicators"] = i.communicators;
    return d;
  });
  // Every FFI target of the table (common/ops.h), as "strata_<target>" -> handler capsule.
  m.def("handlers", [] {
    nb::dict d;
#define STRATA_HANDLER_ENTRY(target, handler) d["strata_" #target] = capsule(strata::handler);
    STRATA_TARGETS(STRATA_HANDLER_ENTRY)
#undef STRATA_HANDLER_ENTRY
    return d;
  });
  // The operator table (common/ops.h), one dict per operator in table order; `kind` is the
  // number its calls carry (strata_jax/_src/operators.py reads it).
  m.def("operators", [] {
    nb::list out;
    int count = 0;
    const strata::OpInfo* rows = strata::op_table(&count);
    for (int i = 0; i < count; ++i) {
      nb::dict d;
      d["id"] = rows[i].id;
      d["kind"] = static_cast<int>(rows[i].op);
      d["api"] = rows[i].api;
      d["lax"] = rows[i].lax;
      d["target"] = std::string("strata_") + rows[i].target;
      d["stats"] = rows[i].stats;
      d["algorithms"] = rows[i].algorithms;
      d["reduce"] = rows[i].reduce;
      out.append(d);
    }
    return out;
  });
  // The reductions (common/ops.h), one dict per reduction in code order.
  m.def("reductions", [] {
    nb::list out;
    auto row = [&out](strata::ReduceOp op, const char* kind, const char* element) {
      nb::dict d;
      d["code"] = static_cast<int>(op);
      d["kind"] = kind;
      d["element"] = element;
      out.append(d);
    };
#define STRATA_REDUCTION_ROW(kind, name, element) row(strata::ReduceOp::name, #kind, #element);
    STRATA_REDUCTIONS(STRATA_REDUCTION_ROW)
#undef STRATA_REDUCTION_ROW
    return out;
  });
  m.def(
      "set_timeout", [](double s) { strata::settings().timeout_ms.store(int64_t(s * 1000)); },
      nb::arg("seconds"));
  m.def(
      "set_timeout_hint", [](const std::string& h) { strata::set_timeout_hint(h); },
      nb::arg("hint"));
  m.def("op_stats", [] {
    nb::list out;
    for (const strata::OpStats* s : strata::op_stats_all()) {
      auto ld = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
      nb::dict d;
      d["name"] = s->name;
      d["calls"] = ld(s->calls);
      d["bytes"] = ld(s->bytes);
      d["one_shot"] = ld(s->algo[0]);
      d["two_shot"] = ld(s->algo[1]);
      d["total_s"] = ld(s->total_ns) * 1e-9;
      d["wait_s"] = ld(s->wait_ns) * 1e-9;
      d["p50_s"] = strata::op_stats_quantile(*s, 0.5) * 1e-9;
      d["p99_s"] = strata::op_stats_quantile(*s, 0.99) * 1e-9;
      out.append(d);
    }
    return out;
  });
  m.def("reset_op_stats", [] { strata::reset_op_stats(); });
  m.def("set_op_stats_enabled", [](bool on) { strata::set_op_stats_enabled(on); }, nb::arg("on"));
  m.def("get_timeout", [] { return strata::settings().timeout_ms.load() / 1000.0; });
  m.def(
      "set_two_shot_bytes", [](int64_t b) { strata::settings().two_shot_bytes.store(b); },
      nb::arg("nbytes"));
  m.def("get_two_shot_bytes", [] { return strata::settings().two_shot_bytes.load(); });
  m.def(
      "all_reduce_algorithm",
      [](int ranks, int64_t nbytes) {
        return strata::all_reduce_two_shot(ranks, static_cast<size_t>(nbytes)) ? "two_shot"
                                                                               : "one_shot";
      },
      nb::arg("ranks"), nb::arg("nbytes"));
  m.def("get_two_shot_pair_bytes", [] { return static_cast<int64_t>(strata::kTwoShotPairBytes); });
  m.def("get_stream_bytes", [] { return static_cast<int64_t>(strata::stream_bytes()); });
  m.def("set_ll_bytes", [](int64_t b) { strata::set_ll_bytes(b); });
  m.def("get_ll_bytes", [] { return strata::get_ll_bytes(); });
  m.def("set_ll_stage_bytes", [](int64_t b) { strata::set_ll_stage_bytes(b); });
  m.def("get_ll_stage_bytes", [] { return strata::get_ll_stage_bytes(); });
  m.def("set_direct_bytes", [](int64_t b) { strata::set_direct_bytes(b); });
  m.def("get_direct_bytes", [] { return strata::get_direct_bytes(); });
  m.def("comm_stats", [] {
    const auto& s = strata::stats();
    // Its counters (fabric/stats.h) by the name comm_stats() gives them.
    const std::pair<const char*, const std::atomic<uint64_t>*> counters[] = {
        {"calls", &s.calls},
        {"zero_copy_bytes", &s.zero_copy_bytes},
        {"staged_bytes", &s.staged_bytes},
        {"one_shot_all_reduce", &s.one_shot},
        {"two_shot_all_reduce", &s.two_shot},
        {"timeouts", &s.timeouts},
        {"moe_calls", &s.moe_calls},
        {"inter_fabric_calls", &s.inter_fabric_calls},
        {"inter_fabric_bytes", &s.inter_fabric_bytes},
        {"max_calls_in_flight_per_device", &s.max_calls_in_flight},
        {"max_runs_in_flight_per_device", &s.max_runs_in_flight},
        {"mismatches", &s.mismatches},
        {"low_latency_calls", &s.low_latency_calls},
        {"direct_calls", &s.direct_calls},
        {"channel_waits", &s.channel_waits},
        {"channel_sleeps", &s.channel_sleeps},
        {"lead_calls", &s.lead_calls},
        {"pair_calls", &s.pair_calls},
        {"rendezvous_steps", &s.rendezvous_steps},
        {"failures", &s.failures}};
    nb::dict d;
    for (const auto& [name, counter] : counters) d[name] = counter->load(std::memory_order_relaxed);
    d["intra_fabric_bytes"] = s.zero_copy_bytes.load(std::memory_order_relaxed) +
                              s.peer_bounce_bytes.load(std::memory_order_relaxed);
    return d;
  });

  // ---- the shared-memory fabric (bootstrap driven by strata_jax/_src/startup.py) ----
  m.def(
      "fabric_listen",
      [](const std::string& dir, int proc) {
        std::string path;
        std::string err = strata::ShmFabric::instance().listen(dir, proc, &path);
        if (!err.empty()) throw std::runtime_error("strata_jax fabric: " + err);
        return path;
      },
      nb::arg("dir"), nb::arg("process_id"));
  m.def(
      "fabric_set_device_procs",
      [](const std::vector<int64_t>& devices, const std::vector<int>& procs,
         const std::vector<int>& job_procs, int fabrics) {
        strata::ShmFabric::instance().set_device_procs(devices, procs, job_procs, fabrics);
      },
      nb::arg("devices"), nb::arg("processes"), nb::arg("job_processes") = std::vector<int>{},
      nb::arg("fabrics") = 1);
  m.def(
      "fabric_connect",
      [](int proc, int nprocs, const std::vector<std::string>& paths, const std::string& mode) {
        strata::RegMode m;
        if (mode == "on_alloc")
          m = strata::RegMode::kOnAlloc;
        else if (mode == "on_use")
          m = strata::RegMode::kOnUse;
        else if (mode == "staging")
          m = strata::RegMode::kStaging;
        else
          throw std::invalid_argument("registration mode must be on_alloc, on_use or staging");
        std::string err;
        {
          nb::gil_scoped_release nogil;  // blocks until every peer has connected
          err = strata::ShmFabric::instance().connect(proc, nprocs, paths, m);
        }
        if (!err.empty()) throw std::runtime_error("strata_jax fabric: " + err);
      },
      nb::arg("process_id"), nb::arg("num_processes"), nb::arg("paths"), nb::arg("mode"));
  m.def("fabric_unlink", [] { strata::ShmFabric::instance().unlink_socket(); });
  m.def("fabric_leave", [] {
    if (strata::ShmFabric* f = strata::ShmFabric::active()) f->leave();
  });
  m.def("fabric_info", []() -> nb::object {
    strata::ShmFabric* f = strata::ShmFabric::active();
    if (!f) return nb::none();
    nb::dict d;
    d["process_id"] = f->proc();
    d["num_processes"] = f->nprocs();
    d["registration"] = strata::reg_mode_name(f->mode());
    d["dead_processes"] = f->dead_peers();  // "1, 3": peers whose link closed
    d["left_processes"] = f->left_peers();  // of those, the ones that left at a normal exit
    return d;
  });
  m.def("memory_stats", [] {
    auto& s = strata::stats();
    auto ld = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    nb::dict d;
    strata::ShmFabric* f = strata::ShmFabric::active();
    d["fabric"] = f ? "shm" : "inproc";
    d["registration"] = f ? strata::reg_mode_name(f->mode()) : "none";
    d["registered_segments"] = ld(s.exported_segments);
    d["registered_bytes"] = ld(s.exported_bytes);
    d["peer_segments_mapped"] = ld(s.mapped_segments);
    d["peer_bytes_mapped"] = ld(s.mapped_bytes);
    d["registrations_critical"] = ld(s.reg_critical);
    d["registrations_critical_s"] = ld(s.reg_critical_ns) * 1e-9;
    d["registrations_offpath"] = ld(s.reg_offpath);
    d["registrations_offpath_s"] = ld(s.reg_offpath_ns) * 1e-9;
    d["zero_copy_bytes"] = ld(s.zero_copy_bytes);
    d["staged_bytes"] = ld(s.staged_bytes);
    d["staged_calls"] = ld(s.staged_calls);
    d["peer_bounce_bytes"] = ld(s.peer_bounce_bytes);
    d["bounce_buffer_bytes"] = ld(s.bounce_bytes);
    d["intra_fabric_bytes"] = ld(s.zero_copy_bytes) + ld(s.peer_bounce_bytes);
    d["inter_fabric_bytes"] = ld(s.inter_fabric_bytes);
    // Per fabric peer (native index): the OS pid at the other end of the link and the peer
    // segments of that process mapped here (strata_jax.memory_stats() names the processes).
    nb::list peers;
    if (f) {
      const auto pids = f->link_pids();
      const auto owners = f->mapped_by_owner();
      for (int j = 0; j < f->nprocs(); ++j) {
        nb::dict e;
        e["fabric_rank"] = j;
        e["os_pid"] = pids[j];
        e["segments_mapped"] = owners[j].first;
        e["bytes_mapped"] = owners[j].second;
        peers.append(e);
      }
    }
    d["fabric_peers"] = peers;
    const auto& api = strata::ShmFabric::alloc();
    d["allocator"] = api.lookup != nullptr;
    strata_alloc_stats_t a{};
    if (api.stats) api.stats(&a);
    d["pool_segments"] = a.segments;
    d["pool_segment_bytes"] = a.segment_bytes;
    d["pool_bytes_in_use"] = a.bytes_in_use;
    d["pool_bytes_cached"] = a.bytes_cached;
    d["pool_allocs"] = a.pool_allocs;
    d["pool_threshold"] = api.stats ? a.threshold : UINT64_MAX;
    // The reserve (on_alloc): segments made and faulted in ahead of demand by the allocator's
    // thread, and segments that malloc had to create on the caller's thread.
    strata_alloc_reserve_t r{};
    static const auto reserve_stats = reinterpret_cast<strata_alloc_reserve_stats_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_reserve_stats"));
    if (reserve_stats && api.lookup) reserve_stats(&r);
    d["pool_reserve_bytes"] = r.target_bytes;
    d["pool_segments_made_ahead"] = r.segments_made;
    d["pool_segments_on_demand"] = r.segments_on_demand;
    d["pool_bytes_prefaulted"] = r.bytes_populated;
    static const auto keep_stats = reinterpret_cast<strata_alloc_keep_stats_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_keep_stats"));
    uint64_t keep = 0, resident = 0, returned = 0;
    if (keep_stats && api.lookup) keep_stats(&keep, &resident, &returned);
    d["pool_keep_bytes"] = keep;
    d["pool_free_resident_bytes"] = resident;
    d["pool_bytes_returned"] = returned;
    return d;
  });
}
