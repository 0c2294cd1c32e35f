// What every FFI handler shares: error mapping, placement from the partition-id operand, and
// joining a call on the right fabric (arrive, run the algorithm, depart).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "coll/kernels.h"
#include "common/env.h"
#include "fabric/inflight.h"
#include "fabric/inproc.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"
#include "fabric/stats.h"
#include "fabric/team.h"
#include "xla/ffi/api/ffi.h"

namespace strata {

using I64s = xla::ffi::Span<const int64_t>;
// The optional last operand of every call that meets peers: the previous strata call's `Done`
// in the same computation (lowering.py: lower_strata_call), left out when the call already reads
// that call's results. The handler never reads it; it is there so that XLA's thunk executor,
// which orders thunks only by the buffers they share, runs the calls of one device in program
// order. Without it XLA CPU starts independent calls in whatever order they become ready, so two
// ranks could each wait in a different call for the other (a deadlock that the timeout
// reported, across processes and in one process).
using After = std::optional<xla::ffi::AnyBuffer>;
// The optional last result of those calls: one byte the handler never writes, added by the
// lowering to every call when calls are chained (the default), for the next call to take as
// its `After`.
using Done = std::optional<xla::ffi::Result<xla::ffi::AnyBuffer>>;

// Bytes a call read from (or wrote to) its peers' buffers: zero-copy unless a bounce buffer was
// in the way (staging). memory_stats()'s zero_copy_bytes / peer_bounce_bytes (their sum is
// intra_fabric_bytes).
inline void count_peer_bytes(const Team& t, uint64_t n) {
  (t.zero_copy() ? stats().zero_copy_bytes : stats().peer_bounce_bytes)
      .fetch_add(n, std::memory_order_relaxed);
}

inline xla::ffi::Error to_error(const std::string& msg) {
  namespace ffi = xla::ffi;
  stats().failures.fetch_add(1, std::memory_order_relaxed);
  if (msg.find("timed out") != std::string::npos) {
    stats().timeouts.fetch_add(1, std::memory_order_relaxed);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg + timeout_hint());
  }
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

// The attributes every strata call carries (strata_jax/_src/collectives.py,
// lower_strata_call): explicit groups of partitions and the device assignment.
struct GroupAttrs {
  I64s groups;         // [num_groups * group_size] partition indices, row-major
  int64_t group_size;  // members per group
  I64s device_ids;     // global device id of every partition
};
// The same attributes in a handler's binding (after its results): `.STRATA_GROUP_ATTRS`.
#define STRATA_GROUP_ATTRS \
  Attr<int64_t>("op_id").Attr<I64s>("groups").Attr<int64_t>("group_size").Attr<I64s>("device_ids")

namespace bind {
// N >= 1 buffer arguments (kResults: results) appended to binding b. Every step returns the next
// stage as a prvalue: a Binding cannot be moved from outside XLA's own code.
template <int N, bool kResults, class B>
auto buffers(B&& b) {
  using xla::ffi::AnyBuffer;
  if constexpr (N == 1 && kResults)
    return std::move(b).template Ret<AnyBuffer>();
  else if constexpr (N == 1)
    return std::move(b).template Arg<AnyBuffer>();
  else if constexpr (kResults)
    return buffers<N - 1, true>(std::move(b).template Ret<AnyBuffer>());
  else
    return buffers<N - 1, false>(std::move(b).template Arg<AnyBuffer>());
}
// The binding of a call that meets its peers (lowering.lower_strata_call): the run id,
// `kOperands` buffers, the partition id and the optional After, then `kResults` results and the
// optional Done, then the group attributes (STRATA_GROUP_ATTRS); the handler's own attributes
// follow.
template <int kOperands, int kResults>
auto call() {
  using xla::ffi::AnyBuffer;
  return buffers<kResults, true>(
             buffers<kOperands + 1, false>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>())
                 .template OptionalArg<AnyBuffer>())
      .template OptionalRet<AnyBuffer>()
      .template Attr<int64_t>("op_id")
      .template Attr<I64s>("groups")
      .template Attr<int64_t>("group_size")
      .template Attr<I64s>("device_ids");
}
}  // namespace bind
// bind::call<kOperands, kResults>() as XLA_FFI_DEFINE_HANDLER_SYMBOL takes a binding (in
// parentheses, so that its comma does not split the macro's arguments).
#define STRATA_BIND_CALL(operands, results) (::strata::bind::call<operands, results>())

// The descriptor of one call of operator `op` through target `form`: its element type and its
// bytes per rank in and out (the operator's parameters and reduction are the caller's to add).
inline OpDesc make_desc(Op op, Target form, int32_t dtype, uint64_t in_bytes, uint64_t out_bytes) {
  OpDesc d;
  d.kind = static_cast<int32_t>(op);
  d.params.form = form;
  d.dtype = dtype;
  d.in_bytes = in_bytes;
  d.out_bytes = out_bytes;
  return d;
}

// Where this device sits in the collective: from its partition id (an operand computed by
// the program itself, so it is right for any device assignment) and the groups.
inline std::string placement(xla::ffi::AnyBuffer pid, const GroupAttrs& g, Placement* pl) {
  if (pid.element_type() != xla::ffi::DataType::U32 || pid.element_count() != 1)
    return "internal error: partition id operand must be a u32 scalar";
  const uint32_t p = *static_cast<const uint32_t*>(pid.untyped_data());
  return place_in_groups(p, g.groups.begin(), g.groups.size(), g.group_size, g.device_ids.begin(),
                         g.device_ids.size(), pl);
}

// In one process, calls of at most this many bytes per rank (input or output) run in one
// rendezvous: the rank that arrives last runs every rank's part while the others sleep
// (InProcTeam::arrive_lead), as XLA's in-process collectives do; larger calls run each rank's
// part on its own thread between an arrival and a departure barrier. With 8 devices on 2 cores
// the second barrier's round of sleeps and wake-ups cost more than the parts of a small call
// (measured in docs/notes/2026-12-03-in-process-collectives.md, "Small calls in one process").
constexpr uint64_t kLeadBytes = 256 * 1024;
inline bool lead_in_process(const OpDesc& d, int n) {
  return n > 1 && d.in_bytes <= kLeadBytes && d.out_bytes <= kLeadBytes;
}

// In one process, calls made of independent blocks between pairs of ranks (all_to_all) that are
// too large for lead_in_process run in one rendezvous too, each pair of blocks copied by the
// second rank of the pair to arrive (InProcTeam::arrive_pairs): no departure barrier, and the
// copies of the ranks that arrive early overlap the computation of the late ones.
// STRATA_INPROC_PAIRS=0 turns it off (measurements).
inline bool pairs_in_process(const OpDesc& d, int n) {
  static const bool on = env_flag("STRATA_INPROC_PAIRS", true);
  return on && n > 1 && !lead_in_process(d, n);
}

// arrive_pairs for one rank: `block(team, src)` copies what this rank receives from `src` into
// its own output (the rest as join_and_run_with).
template <class Block>
xla::ffi::Error join_and_run_pairs(const char* name, int64_t run_id, int64_t op_id,
                                   const Placement& pl, const OpDesc& desc, const void* in,
                                   void* out, Block block) {
  InFlight inflight(pl.device, run_id);
  stats().pair_calls.fetch_add(1, std::memory_order_relaxed);
  auto team = InProcFabric::instance().join(run_id, op_id, pl, name);
  prepare_output(out, desc.out_bytes);
  auto mine = [&](int src) -> std::string { return block(*team, src); };
  PairFn fn;
  fn.call = [](void* c, int src) { return (*static_cast<decltype(mine)*>(c))(src); };
  fn.ctx = &mine;
  std::string err = team->arrive_pairs(desc, in, out, fn);
  OpTimer::arrived();  // comm_stats(): on this path `wait` includes the copies made meanwhile
  if (!err.empty()) return to_error(err);
  return xla::ffi::Error::Success();
}

// A call's own buffers, for the one-rendezvous path of small in-process calls.
struct LeadIo {
  const OpDesc* desc;
  const void* in;
  void* out;
};

// Joins call (run, op_id, occurrence, group) on the fabric, publishes this rank's buffers with
// arrive(Team&) -> error string (a generic lambda: called with the InProcTeam or the ShmTeam),
// runs body(Team&) -> error string, and always departs (peers may still read this rank's
// buffers). `cross_process` says whether the operator supports the shared-memory fabric; one
// that does not fails clearly when several processes are connected instead of waiting for
// peers that cannot arrive.
// kMayLl: the call may take the shared-memory fabric's low-latency path (fabric/shm_ll.h) when
// `ll_desc` is given and small enough; only for operators that read peer_in() and write their
// own output (Arrive then calls team.arrive(desc, in, out)).
// `ll_bytes`: what the call would publish on that path (default: ll_desc->in_bytes).
// `slot_ok`, `direct_ok`: ShmLlTeam::join's (the direct form: only callers whose Arrive calls
// team.arrive(desc, in, out)).
template <bool kMayLl = false, class Arrive, class Body>
xla::ffi::Error join_and_run_with(const char* name, int64_t run_id, int64_t op_id,
                                  const Placement& pl, bool cross_process, Arrive arrive, Body body,
                                  const OpDesc* ll_desc = nullptr, const LeadIo* lead = nullptr,
                                  const uint64_t* ll_bytes = nullptr, bool slot_ok = true,
                                  bool direct_ok = false) {
  std::string err;
  // Measures, and guards, the ordering rule (inflight.h). Only groups of more than one rank:
  // XLA orders single-device programs by their own per-device queue, which may overlap a
  // multi-device execution, and a group of one needs no ordering.
  std::optional<InFlight> inflight;
  if (pl.size > 1) inflight.emplace(pl.device, run_id);
  if (ShmFabric* shm = ShmFabric::active()) {
    if (!cross_process)
      return to_error(std::string("strata_jax ") + name +
                      " runs on the in-process fabric only; it is not supported across "
                      "processes yet (use one process with several devices)");
    if (inflight && inflight->runs_at_entry() > 1)
      return to_error(std::string("strata_jax ") + name +
                      ": a call of another execution is in flight on this device; calls across "
                      "processes pair by their order on each device, which two concurrent "
                      "executions would make ambiguous (XLA CPU runs one multi-device execution "
                      "at a time: please report this with your jax version)");
    // Several processes: every call goes through the shared-memory fabric, which also reaches
    // this process's own devices directly (a handler cannot tell from the mesh alone which
    // processes a group spans: that needs the program's device assignment). Calls meet by
    // communicator and execution number on it, not by run id (fabric/shm.h).
    if constexpr (kMayLl) {
      auto ll = ll_desc ? ShmLlTeam::join(shm, pl, run_id, op_id, *ll_desc,
                                          ll_bytes ? *ll_bytes : ll_desc->in_bytes, name, &err,
                                          slot_ok, direct_ok)
                        : nullptr;
      if (!err.empty()) return to_error(err);
      if (ll) {
        err = arrive(*ll);
        if (err.empty()) err = body(*ll);
        std::string derr = ll->depart();  // marks the peers' slots read; never waits
        if (err.empty()) err = derr;
        if (!err.empty()) return to_error(err);
        return xla::ffi::Error::Success();
      }
    }
    auto team = shm->join(pl, run_id, op_id, name, &err);
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
  if (lead && lead_in_process(*lead->desc, pl.size)) {
    stats().lead_calls.fetch_add(1, std::memory_order_relaxed);
    auto mine = [&]() -> std::string { return body(*team); };
    LeadFn fn;
    fn.call = [](void* c) { return (*static_cast<decltype(mine)*>(c))(); };
    fn.ctx = &mine;
    err = team->arrive_lead(*lead->desc, lead->in, lead->out, fn);
    OpTimer::arrived();  // the others' (the leader marked its own before the parts)
    if (!err.empty()) return to_error(err);
    return xla::ffi::Error::Success();
  }
  err = arrive(*team);
  if (err.empty()) err = body(*team);
  if (err.empty()) err = team->depart();
  if (!err.empty()) return to_error(err);
  return xla::ffi::Error::Success();
}

// The usual case: one input and one output buffer per rank. `may_ll`: false for an algorithm
// that writes into the peers' outputs, which the low-latency path's slots do not publish (its
// direct form does, whatever the size).
template <class Body>
xla::ffi::Error join_and_run(const char* name, int64_t run_id, int64_t op_id, const Placement& pl,
                             const OpDesc& desc, const void* in, void* out, bool cross_process,
                             Body body, bool may_ll = true) {
  const LeadIo lead{&desc, in, out};
  return join_and_run_with<true>(
      name, run_id, op_id, pl, cross_process,
      [&](auto& team) {
        // Before peers may write into it (they do after the arrival barrier).
        prepare_output(out, desc.out_bytes);
        std::string e = team.arrive(desc, in, out);
        OpTimer::arrived();  // wait vs move in comm_stats() (fabric/op_stats.h)
        return e;
      },
      body, cross_process ? &desc : nullptr, &lead, nullptr, /*slot_ok=*/may_ll,
      /*direct_ok=*/true);
}

// Several buffers per rank (Team::peer_buf); the output is this rank's alone, not published.
// `may_ll`: the body only reads the peers' buffers and never calls a barrier, so across
// processes the call may take the low-latency path (fabric/shm_ll.h) when no buffer is
// `written` and they fit (in a slot, or staged when desc.may_stage).
template <class Body>
xla::ffi::Error join_and_run_multi(const char* name, int64_t run_id, int64_t op_id,
                                   const Placement& pl, const OpDesc& desc, const BufRef* bufs,
                                   int nbufs, Body body, bool may_ll = false) {
  bool eligible = false;
  const uint64_t bytes = ShmLlTeam::multi_bytes(bufs, nbufs, &eligible);
  return join_and_run_with<true>(
      name, run_id, op_id, pl, /*cross_process=*/true,
      [&](auto& team) {
        std::string e = team.arrive_multi(desc, bufs, nbufs);
        OpTimer::arrived();  // wait vs move in comm_stats() (fabric/op_stats.h)
        return e;
      },
      body, may_ll && eligible ? &desc : nullptr, nullptr, &bytes);
}

}  // namespace strata
