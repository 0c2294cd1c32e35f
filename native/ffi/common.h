// What every FFI handler shares: error mapping, placement from the partition-id operand, and
// joining a call on the right fabric (arrive, run the algorithm, depart).
#pragma once

#include <string>
#include <vector>

#include "fabric/inproc.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/stats.h"
#include "fabric/team.h"
#include "xla/ffi/api/ffi.h"

namespace strata {

using I64s = xla::ffi::Span<const int64_t>;

inline xla::ffi::Error to_error(const std::string& msg) {
  namespace ffi = xla::ffi;
  if (msg.find("timed out") != std::string::npos) {
    stats().timeouts.fetch_add(1, std::memory_order_relaxed);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg + timeout_hint());
  }
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

// Where this device sits in the collective: from its partition id (an operand computed by
// the program itself, so it is right for any device assignment) and the mesh.
inline std::string placement(xla::ffi::AnyBuffer pid, I64s mesh_shape, I64s axes,
                             Placement* pl) {
  if (pid.element_type() != xla::ffi::DataType::U32 || pid.element_count() != 1)
    return "internal error: partition id operand must be a u32 scalar";
  const uint32_t p = *static_cast<const uint32_t*>(pid.untyped_data());
  return place(p, std::vector<int64_t>(mesh_shape.begin(), mesh_shape.end()),
               std::vector<int64_t>(axes.begin(), axes.end()), pl);
}

// Joins call (run, op_id, occurrence, group) on the fabric, publishes this rank's buffers with
// arrive(Team&) -> error string (a generic lambda: called with the InProcTeam or the ShmTeam),
// runs body(Team&) -> error string, and always departs (peers may still read this rank's
// buffers). `cross_process` says whether the operator supports the shared-memory fabric; one
// that does not fails clearly when several processes are connected instead of waiting for
// peers that cannot arrive.
template <class Arrive, class Body>
xla::ffi::Error join_and_run_with(const char* name, int64_t run_id, int64_t op_id,
                                  const Placement& pl, bool cross_process, Arrive arrive,
                                  Body body) {
  std::string err;
  if (ShmFabric* shm = ShmFabric::active()) {
    if (!cross_process)
      return to_error(std::string("strata_jax ") + name +
                      " runs on the in-process fabric only; it is not supported across "
                      "processes yet (use one process with several devices)");
    // Several processes: every call goes through the shared-memory fabric, which also reaches
    // this process's own devices directly (a handler cannot tell from the mesh alone which
    // processes a group spans: that needs the program's device assignment).
    auto team = shm->join(run_id, op_id, pl, name, &err);
    if (!team) return to_error(err);
    err = arrive(*team);
    if (!err.empty()) return to_error(err);
    err = body(*team);
    std::string derr = team->depart();
    if (err.empty()) err = derr;
    if (!err.empty()) return to_error(err);
    return xla::ffi::Error::Success();
  }
  auto team = InProcFabric::instance().join(run_id, op_id, pl, name);
  err = arrive(*team);
  if (err.empty()) err = body(*team);
  if (err.empty()) err = team->depart();
  if (!err.empty()) return to_error(err);
  return xla::ffi::Error::Success();
}

// The usual case: one input and one output buffer per rank.
template <class Body>
xla::ffi::Error join_and_run(const char* name, int64_t run_id, int64_t op_id,
                             const Placement& pl, const OpDesc& desc, const void* in, void* out,
                             bool cross_process, Body body) {
  return join_and_run_with(
      name, run_id, op_id, pl, cross_process,
      [&](auto& team) {
        std::string e = team.arrive(desc, in, out);
        OpTimer::arrived();  // wait vs move in comm_stats() (fabric/op_stats.h)
        return e;
      },
      body);
}

// Several buffers per rank (Team::peer_buf); the output is this rank's alone, not published.
template <class Body>
xla::ffi::Error join_and_run_multi(const char* name, int64_t run_id, int64_t op_id,
                                   const Placement& pl, const OpDesc& desc, const BufRef* bufs,
                                   int nbufs, Body body) {
  return join_and_run_with(
      name, run_id, op_id, pl, /*cross_process=*/true,
      [&](auto& team) { return team.arrive_multi(desc, bufs, nbufs); }, body);
}

}  // namespace strata
