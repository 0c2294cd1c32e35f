// A Team is the set of participants of one collective call, as the algorithms see it: my rank,
// the group size, every peer's input and output buffer (directly addressable: zero-copy), and
// barriers. Algorithms in coll/ only talk to a Team; they never know which fabric moved the
// bytes (NCCL keeps transports apart from collectives in the same way).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/ops.h"

namespace strata {

// What every participant of one collective call must agree on. Checked at arrival so that a
// mismatch (different op, dtype or size on some rank) fails loudly instead of corrupting memory.
struct OpDesc {
  const char* name = "";   // user-facing op name, e.g. "psum"
  int32_t kind = 0;        // the operator (Op of common/ops.h)
  int32_t dtype = 0;       // xla::ffi::DataType
  int32_t reduce = 0;      // ReduceOp for reductions
  OpParams params;         // the operator's own parameters (root rank, axes, form ...)
  int32_t algo = 0;        // algorithm choice; not compared: every rank follows rank 0's
  uint64_t in_bytes = 0;   // per-rank input bytes
  uint64_t out_bytes = 0;  // per-rank output bytes
  // Not compared (derived from the op and its sizes, so equal on every rank of a matching
  // call): the call may take the shared-memory fabric's staged low-latency form above the slot
  // size (fabric/shm_ll.h): its algorithm reads peer_in() (or read-only peer_buf()) and writes
  // only its own output, and one-shot costs it no more than otherwise.
  bool may_stage = false;
  bool same_as(const OpDesc& o) const {
    return kind == o.kind && dtype == o.dtype && reduce == o.reduce && params == o.params &&
           in_bytes == o.in_bytes && out_bytes == o.out_bytes;
  }
};

// One of several buffers a rank publishes for operators that need more than one input (MoE).
// `written`: the owner writes it during the call (through peer_buf(rank(), i)) and peers read it
// after a barrier; a fabric that stages it copies it back to `ptr` at departure instead of
// copying it in at arrival.
struct BufRef {
  const void* ptr = nullptr;
  uint64_t bytes = 0;  // 0: not published (peer_buf returns nullptr)
  bool written = false;
};
constexpr int kMaxBufs = 4;  // buffers per rank for arrive_multi

// One operand of a multi-operand call (arrive_list): this rank's input and output buffers. A
// pytree's leaves travel as one call with one rendezvous (XLA's combiner makes one all-reduce of
// them the same way); peers reach operand k of rank j through peer_in_at / peer_out_at.
struct OperandRef {
  const void* in = nullptr;
  void* out = nullptr;
  uint64_t in_bytes = 0, out_bytes = 0;  // 0: nothing to publish (the pointer is not read)
};

class Team {
 public:
  virtual ~Team() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const void* peer_in(int j) const = 0;
  virtual void* peer_out(int j) const = 0;
  // Address in this process of buffer i (0 <= i < kMaxBufs) published by rank j through
  // arrive_multi (valid after it returned; nullptr if not published). For j == rank() this is
  // where this rank must write a `written` buffer so that peers see it (a bounce buffer when
  // the fabric staged it).
  virtual const void* peer_buf(int j, int i) const = 0;
  // Operand k of rank j after arrive_list (nullptr for an empty one). Teams without lists
  // answer operand 0 with the single buffers of arrive().
  virtual const void* peer_in_at(int j, int k) const { return k == 0 ? peer_in(j) : nullptr; }
  virtual void* peer_out_at(int j, int k) const { return k == 0 ? peer_out(j) : nullptr; }
  // The descriptor rank j published at arrival (valid after arrive()).
  virtual const OpDesc& peer_desc(int j) const = 0;
  // Barrier across the team: every write any rank made before it is visible to every rank
  // after it. Returns an empty string on success, else an error naming the missing ranks.
  virtual std::string barrier(const char* phase) = 0;
  // True when the peers' buffers this call reads are their own (no bounce buffer in between).
  virtual bool zero_copy() const { return true; }
  // How many ranks of this call run in this process (valid after arrival): their outputs share
  // this process's cores and caches (coll/kernels.h stream_output). One process: all of them.
  virtual int local_ranks() const { return size(); }
};

// Describes where this rank sits: `rank` of `size` in group `group` of the collective.
struct Placement {
  int64_t group = 0;
  int rank = 0;
  int size = 1;
  int64_t partition = 0;  // the rank's global partition index (unique per device in a program)
  int64_t device = 0;     // the rank's global device id (the same in every process)
  // The communicator: a hash of the group members' global device ids in rank order. Every
  // process computes the same value for the same group, whatever program it runs.
  uint64_t comm = 0;
  // The group's members, valid while the handler runs (they point into its attributes):
  // member r's global device id is device_ids[member_parts[r]].
  const int64_t* member_parts = nullptr;
  const int64_t* device_ids = nullptr;
  int64_t member_device(int r) const { return device_ids[member_parts[r]]; }
};

// What every fabric's team keeps of where its rank sits in the call (its Placement: the member
// arrays stay valid while the handler runs, which the team never outlives) and of the call's
// name (for messages), with Team's rank() and size().
class SeatedTeam : public Team {
 public:
  SeatedTeam(const Placement& pl, const char* op_name)
      : rank_(pl.rank),
        size_(pl.size),
        partition_(pl.partition),
        device_(pl.device),
        member_parts_(pl.member_parts),
        device_ids_(pl.device_ids),
        op_name_(op_name) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  int rank_, size_;
  int64_t partition_, device_;
  // The members' global device ids (Placement::member_device).
  const int64_t* member_parts_;
  const int64_t* device_ids_;
  const char* op_name_;
};

// Computes the placement of `partition` in explicit groups: `groups` holds `num_groups` rows
// of `group_size` partition indices (row-major), rank = position in the row; `device_ids[p]`
// is partition p's global device id. Returns an error if the partition is in no row.
std::string place_in_groups(int64_t partition, const int64_t* groups, size_t groups_len,
                            int64_t group_size, const int64_t* device_ids, size_t num_devices,
                            Placement* out);

// The words every fabric's timeout message starts with: "strata_jax <op>: timed out after <s> s
// in phase '<phase>' waiting for rank(s) [<missing>]"; each fabric goes on with where the call
// was and what the missing ranks do.
std::string timed_out_waiting(const char* op, const char* phase, const std::vector<int>& missing);

}  // namespace strata
