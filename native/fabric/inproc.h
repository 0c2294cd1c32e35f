// The in-process fabric: all ranks are JAX CPU devices of one process, so they share one
// address space and a peer's XLA buffer is addressable as it is. Registration is bookkeeping.
//
// A collective call is identified across ranks by (run id, op id, occurrence, group): the run
// id is equal on every device of one execution (XLA's RunId), the op id is fixed at lowering
// time, and the occurrence counts how often this rank has executed this op in this run (loops).
// Keying by these instead of per-rank sequence counters keeps concurrent executions, loops and
// unrolled loops apart.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "fabric/team.h"
#include "sync/wait.h"

namespace strata {

struct CallKey {
  int64_t run_id;
  int64_t op_id;
  uint64_t occurrence;
  int64_t group;
  bool operator==(const CallKey& o) const {
    return run_id == o.run_id && op_id == o.op_id && occurrence == o.occurrence && group == o.group;
  }
};
struct CallKeyHash {
  size_t operator()(const CallKey& k) const {
    uint64_t h = static_cast<uint64_t>(k.run_id) * 0x9E3779B97F4A7C15ull;
    h ^= static_cast<uint64_t>(k.op_id) + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= k.occurrence + 0x94D049BB133111EBull + (h << 6) + (h >> 2);
    h ^= static_cast<uint64_t>(k.group) + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

// One rank's part of a call, handed to the rank that arrives last (InProcTeam::arrive_lead):
// `call(ctx)` runs the rank's algorithm against its own team and returns its error string. The
// context lives in the rank's frame, which waits in arrive_lead until the leader has run it.
struct LeadFn {
  std::string (*call)(void* ctx) = nullptr;
  void* ctx = nullptr;
};

// One rank's per-source copy of a call of independent blocks (InProcTeam::arrive_pairs):
// `call(ctx, src)` writes into the rank's own output what it receives from rank `src`, reading
// only `src`'s published input, and returns an error string. The context lives in the rank's
// frame, which waits in arrive_pairs until every block it sends or receives has been copied.
struct PairFn {
  std::string (*call)(void* ctx, int src) = nullptr;
  void* ctx = nullptr;
};

// Shared state of one collective call. Created by the first rank to arrive, dropped from the
// table by the last one to leave.
struct CallSlot {
  explicit CallSlot(int n) : peers(n), claims(new std::atomic<uint8_t>[size_t(n) * n]) {
    for (size_t i = 0; i < size_t(n) * n; ++i) claims[i].store(0, std::memory_order_relaxed);
  }
  struct Peer {
    const void* in = nullptr;
    void* out = nullptr;
    const void* bufs[kMaxBufs] = {};  // arrive_multi's buffers (published like `in`)
    const OperandRef* ops = nullptr;  // arrive_list's operands (the caller's array)
    OpDesc desc;
    LeadFn lead;  // arrive_lead: this rank's part, for the leader to run
    PairFn pair;  // arrive_pairs: this rank's per-source copy
    // arrive_pairs: 1 once this rank's buffers, desc and `pair` are published (seq_cst: see
    // arrive_pairs), and the number of its blocks (received and sent, per peer; its own block)
    // copied so far: the rank leaves when it reaches the group size (futex word).
    std::atomic<uint32_t> pub{0};
    std::atomic<uint32_t> done{0};
    std::string lead_err;  // arrive_lead: what the leader's run of `lead` returned
    // Number of barriers this rank has entered. Written by the rank (release), read by the
    // timeout path to name the missing ranks.
    std::atomic<uint32_t> reached{0};
  };
  std::vector<Peer> peers;
  // Total barrier entries of all ranks. Barrier k is complete when arrivals >= k * size.
  // fetch_add(acq_rel): release publishes the rank's buffer pointers and output writes made
  // before the barrier; the waiters' acquire loads make them visible after it.
  std::atomic<uint32_t> arrivals{0};
  std::atomic<uint32_t> leaving{0};
  // arrive_lead: the last rank to arrive ran every rank's part (written before its release
  // increment of `arrivals`, read after the waiters' acquire of it).
  std::atomic<bool> led{false};
  // arrive_pairs: who copies the two blocks between ranks i < j (index i * n + j): 0 nobody
  // yet, 1 being copied, 2 copied, 3 abandoned by a rank that gave up (nobody will copy it).
  std::unique_ptr<std::atomic<uint8_t>[]> claims;
  std::atomic<bool> failed{false};
  std::string failure;  // written once by the rank that sets `failed` (under fail_mu)
  std::mutex fail_mu;
};

class InProcTeam final : public SeatedTeam {
 public:
  InProcTeam(std::shared_ptr<CallSlot> slot, const CallKey& key, const Placement& pl,
             const char* op_name);
  ~InProcTeam() override;
  const void* peer_in(int j) const override { return slot_->peers[j].in; }
  void* peer_out(int j) const override { return slot_->peers[j].out; }
  const void* peer_buf(int j, int i) const override { return slot_->peers[j].bufs[i]; }
  const void* peer_in_at(int j, int k) const override {
    const OperandRef* ops = slot_->peers[j].ops;
    return ops ? ops[k].in : (k == 0 ? slot_->peers[j].in : nullptr);
  }
  void* peer_out_at(int j, int k) const override {
    const OperandRef* ops = slot_->peers[j].ops;
    return ops ? ops[k].out : (k == 0 ? slot_->peers[j].out : nullptr);
  }
  const OpDesc& peer_desc(int j) const override { return slot_->peers[j].desc; }
  std::string barrier(const char* phase) override;
  // Publishes this rank's buffers and waits for every peer to arrive; checks that all agree.
  std::string arrive(const OpDesc& desc, const void* in, void* out);
  // The same with up to kMaxBufs buffers (one address space: published as they are).
  std::string arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs);
  // Publishes `nops` operands (the array must stay valid until depart(): it lives in the
  // caller's frame, which waits there) and waits for every peer.
  std::string arrive_list(const OpDesc& desc, const OperandRef* ops, int nops);
  // Final barrier: after it no peer touches this rank's buffers any more.
  std::string depart() { return barrier("depart"); }
  // The whole call in one rendezvous, for small calls (common.h: lead_in_process): publishes
  // this rank's buffers and its part `fn`; the rank that arrives last runs every rank's part in
  // rank order, then releases the others. Returns this rank's part's error, or the arrival's
  // (timeout, disagreeing ranks). No depart() follows: once released, no rank touches another's
  // buffers. Every rank of the call must take this path (it is chosen from the OpDesc alone).
  std::string arrive_lead(const OpDesc& desc, const void* in, void* out, LeadFn fn);
  // The whole call in one rendezvous, for calls made of independent blocks between pairs of
  // ranks (all_to_all), where every rank's output takes one block from every rank's input:
  // publishes this rank's buffers and its per-source copy `fn`, copies its own block, then, for
  // every peer that has already published, the two blocks between them (the peer's into this
  // output with this rank's `fn`, this input into the peer's output with the peer's), each pair
  // by whichever of the two arrives second. Returns when every block into this output and out of
  // this input is copied (the last rank to arrive copies its pairs and releases the others: no
  // departure barrier). The same copies as each rank pulling its blocks after an arrival
  // barrier, on other threads (the same bits). Every rank of the call must take this path.
  std::string arrive_pairs(const OpDesc& desc, const void* in, void* out, PairFn fn);

 private:
  std::string fail(const std::string& msg);
  // Waits until `arrivals` reaches `target` (see barrier()); the timeout error names `phase`.
  std::string wait_arrivals(uint32_t target, const char* phase);
  // The same on any futex word of the slot (arrive_pairs waits on its `done`).
  std::string wait_word(std::atomic<uint32_t>* word, uint32_t target, const char* phase);
  // arrive_pairs: copies the two blocks between this rank and `j` (both published).
  std::string copy_pair(int j);
  // arrive_pairs after a failure: no peer may start a pair with this rank any more, and the
  // pairs in flight with it are waited for (so its buffers outlive every reader and writer).
  void abandon_pairs();
  // The arrival's agreement check: an error if some rank published another OpDesc.
  std::string check_descs(const OpDesc& desc) const;
  // The same against rank j's descriptor alone.
  std::string check_desc(const OpDesc& desc, int j) const;
  // What the missing rank `j` is doing, for the timeout message (see Doing in inproc.cc):
  // "in no strata call", "waiting in <op> (...)" or "gave up waiting in <op> (...)".
  std::string whereabouts(int j) const;
  std::shared_ptr<CallSlot> slot_;
  CallKey key_;
  uint32_t barriers_ = 0;
};

class InProcFabric {
 public:
  static InProcFabric& instance();
  // Joins the call; the returned team is ready for arrive().
  std::unique_ptr<InProcTeam> join(int64_t run_id, int64_t op_id, const Placement& pl,
                                   const char* op_name);
  void release(const CallKey& key);
  // Records that a call failed, so that a rank arriving after the others gave up fails at once
  // with the same message instead of waiting out its own timeout.
  void record_failure(const CallKey& key, const std::string& msg);

 private:
  uint64_t next_occurrence(int64_t run_id, int64_t partition, int64_t op_id);
  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<CallSlot>, CallKeyHash> calls_;
  struct RankRun {
    int64_t run_id, partition;
    bool operator==(const RankRun& o) const {
      return run_id == o.run_id && partition == o.partition;
    }
  };
  struct RankRunHash {
    size_t operator()(const RankRun& k) const {
      return static_cast<size_t>(k.run_id * 1000003 + k.partition);
    }
  };
  struct RunOccurrences {
    std::unordered_map<int64_t, uint64_t> per_op;  // op id -> calls so far
    uint64_t last_join = 0;                        // value of joins_ at the run's last join
  };
  std::unordered_map<RankRun, RunOccurrences, RankRunHash> occurrences_;
  uint64_t joins_ = 0;  // joins so far (with mu_ held): the clock of the pruning
  std::unordered_map<CallKey, std::string, CallKeyHash> failed_;  // bounded (see .cc)
};

}  // namespace strata
