#include "fabric/inproc.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "coll/kernels.h"
#include "common/settings.h"
#include "fabric/op_stats.h"
#include "fabric/stats.h"

namespace strata {

namespace {

// What each device of this process is inside of, for the timeout message only: when a rank
// never reaches a call, its peers say whether it sits in another strata call (which one) or in
// none. One entry per device (indexed by global device id modulo kDoing, the id stored to tell
// collisions apart); a device with two calls in flight shows the later one. Diagnostic only:
// relaxed atomics, a torn read at worst names the wrong op in an error message.
struct Doing {
  std::atomic<int64_t> device{-1};
  std::atomic<int64_t> run{0};
  std::atomic<int64_t> op{0};
  std::atomic<const char*> name{nullptr};  // the call's operator (of the fields above)
  // 0: in no strata call; 1: in the call above; 2: left it failed (a timeout), which a peer
  // timing out a little later must still be told.
  std::atomic<int> state{0};
};
constexpr int64_t kDoing = 512;
Doing* doing() {
  static Doing* d = new Doing[kDoing];  // never destroyed: XLA threads may outlive exit
  return d;
}
Doing& doing_of(int64_t device) {
  return doing()[static_cast<uint64_t>(device) % static_cast<uint64_t>(kDoing)];
}

}  // namespace

InProcFabric& InProcFabric::instance() {
  static InProcFabric* f = new InProcFabric();  // never destroyed: XLA threads may outlive exit
  return *f;
}

uint64_t InProcFabric::next_occurrence(int64_t run_id, int64_t partition, int64_t op_id) {
  // Called with mu_ held. Run ids are not ordered (XLA derives them from the executable's
  // fingerprint plus a counter, so they look like hashes and are often negative): the
  // bookkeeping of finished runs is dropped by recency, never by comparing run ids. A run is
  // forgotten only after kForgetAfter joins passed without it joining; at most one execution
  // is in flight per device (measured: comm_stats max_runs_in_flight_per_device), so a live
  // run cannot fall that far behind.
  // Scanned every kPruneEvery joins, so the cost per join stays a few entries.
  constexpr uint64_t kForgetAfter = 1u << 14, kPruneEvery = 1u << 12;
  if (++joins_ % kPruneEvery == 0) {
    for (auto it = occurrences_.begin(); it != occurrences_.end();)
      it = (joins_ - it->second.last_join > kForgetAfter) ? occurrences_.erase(it) : std::next(it);
  }
  RunOccurrences& r = occurrences_[RankRun{run_id, partition}];
  r.last_join = joins_;
  return r.per_op[op_id]++;
}

std::unique_ptr<InProcTeam> InProcFabric::join(int64_t run_id, int64_t op_id, const Placement& pl,
                                               const char* op_name) {
  std::shared_ptr<CallSlot> slot;
  CallKey key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    key = CallKey{run_id, op_id, next_occurrence(run_id, pl.partition, op_id), pl.group};
    auto& s = calls_[key];
    if (!s) {
      s = std::make_shared<CallSlot>(pl.size);
      auto f = failed_.find(key);
      if (f != failed_.end()) {  // the others already gave up on this call
        s->failure = f->second;
        s->failed.store(true, std::memory_order_release);
      }
    }
    slot = s;
  }
  return std::make_unique<InProcTeam>(std::move(slot), key, pl, op_name);
}

void InProcFabric::release(const CallKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.erase(key);
}

void InProcFabric::record_failure(const CallKey& key, const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.size() >= 1024) failed_.clear();  // failures are rare; forgetting is harmless
  failed_[key] = msg;
}

InProcTeam::InProcTeam(std::shared_ptr<CallSlot> slot, const CallKey& key, const Placement& pl,
                       const char* op_name)
    : SeatedTeam(pl, op_name), slot_(std::move(slot)), key_(key) {
  Doing& d = doing_of(device_);
  d.device.store(device_, std::memory_order_relaxed);
  d.run.store(key_.run_id, std::memory_order_relaxed);
  d.op.store(key_.op_id, std::memory_order_relaxed);
  d.name.store(op_name_, std::memory_order_relaxed);
  d.state.store(1, std::memory_order_relaxed);
}

InProcTeam::~InProcTeam() {
  Doing& d = doing_of(device_);
  if (d.device.load(std::memory_order_relaxed) == device_ &&
      d.run.load(std::memory_order_relaxed) == key_.run_id &&
      d.op.load(std::memory_order_relaxed) == key_.op_id)
    d.state.store(slot_->failed.load(std::memory_order_acquire) ? 2 : 0, std::memory_order_relaxed);
  // The last rank out removes the call from the table. Ranks that failed leave too, so a
  // failed call never pins memory; a late rank then finds no slot and times out on its own.
  const bool last =
      slot_->leaving.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_);
  if (slot_->failed.load(std::memory_order_acquire)) {
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(slot_->fail_mu);
      msg = slot_->failure;
    }
    if (!last) InProcFabric::instance().record_failure(key_, msg);
    InProcFabric::instance().release(key_);
  } else if (last) {
    InProcFabric::instance().release(key_);
  }
}

std::string InProcTeam::fail(const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(slot_->fail_mu);
    if (!slot_->failed.load(std::memory_order_relaxed)) {
      slot_->failure = msg;
      slot_->failed.store(true, std::memory_order_release);
    }
  }
  futex_wake_all(&slot_->arrivals, false);
  for (auto& p : slot_->peers) futex_wake_all(&p.done, false);  // arrive_pairs' waiters
  std::lock_guard<std::mutex> lock(slot_->fail_mu);
  return slot_->failure;
}

std::string InProcTeam::whereabouts(int j) const {
  std::ostringstream os;
  if (!member_parts_ || !device_ids_) return os.str();
  const int64_t dev = device_ids_[member_parts_[j]];
  const Doing& d = doing_of(dev);
  const char* name = d.name.load(std::memory_order_relaxed);
  const int state = d.state.load(std::memory_order_relaxed);
  if (d.device.load(std::memory_order_relaxed) != dev || !name || state == 0) {
    os << "in no strata call";
    return os.str();
  }
  const int64_t run = d.run.load(std::memory_order_relaxed);
  const int64_t op = d.op.load(std::memory_order_relaxed);
  // XLA's run ids are 64-bit values that print negative as signed: shown as unsigned.
  os << (state == 1 ? "waiting in " : "gave up waiting in ") << name << " (op " << op << ", run "
     << static_cast<uint64_t>(run) << ")";
  if (run == key_.run_id && op != key_.op_id) os << ", another call of this same program";
  return os.str();
}

std::string InProcTeam::barrier(const char* phase) {
  ++barriers_;
  stats().rendezvous_steps.fetch_add(1, std::memory_order_relaxed);
  slot_->peers[rank_].reached.store(barriers_, std::memory_order_release);
  const uint32_t target = barriers_ * static_cast<uint32_t>(size_);
  uint32_t now = slot_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now == target) {
    futex_wake_all(&slot_->arrivals, false);
    return {};
  }
  return wait_arrivals(target, phase);
}

std::string InProcTeam::wait_arrivals(uint32_t target, const char* phase) {
  return wait_word(&slot_->arrivals, target, phase);
}

std::string InProcTeam::wait_word(std::atomic<uint32_t>* word, uint32_t target, const char* phase) {
  static const int cores = static_cast<int>(std::thread::hardware_concurrency());
  auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  // Spin only where every rank can have a CPU (a peer may then answer within a microsecond):
  // with more ranks than CPUs a spinning waiter holds the CPU that the ranks it waits for need
  // (8 devices on 2 cores: 0.93-1.16x jax.lax's speed with 64 pauses, 1.01-1.24x without).
  // Then sleep, never sched_yield: under EEVDF (Linux 6.6+) each sched_yield pushes the caller's
  // deadline one slice later until it has run that long or sleeps, and these are XLA's device
  // threads, so a yielding waiter falls behind every other runnable thread for the rest of the
  // call and the XLA work after it (pmax 256 KiB on one busy core: 15.9 ms with 16 yields,
  // 0.74 ms sleeping).
  bool ok = wait_until(
      word, [&] { return word->load(std::memory_order_acquire) >= target; },
      [&] { return slot_->failed.load(std::memory_order_acquire); }, deadline, /*shared=*/false,
      /*spins=*/size_ <= cores ? 64 : 0, /*yields=*/0);
  if (ok) return {};
  if (slot_->failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(slot_->fail_mu);
    return slot_->failure;
  }
  std::vector<int> missing;
  for (int j = 0; j < size_; ++j)
    if (slot_->peers[j].reached.load(std::memory_order_acquire) < barriers_) missing.push_back(j);
  std::ostringstream os;
  os << timed_out_waiting(op_name_, phase, missing) << " of a group of " << size_ << " (group "
     << key_.group << ", op " << key_.op_id << ", run " << static_cast<uint64_t>(key_.run_id)
     << "); reported by rank " << rank_ << " (partition " << partition_ << "). ";
  // What the missing ranks do, ranks doing the same thing named together.
  std::vector<std::pair<std::string, std::vector<int>>> doing_what;
  for (int j : missing) {
    std::string w = whereabouts(j);
    auto it = std::find_if(doing_what.begin(), doing_what.end(),
                           [&](const auto& d) { return d.first == w; });
    if (it == doing_what.end()) {
      doing_what.push_back({w, {j}});
    } else {
      it->second.push_back(j);
    }
  }
  for (const auto& [what, ranks] : doing_what) {
    if (what.empty()) continue;
    os << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
    os << ": " << what << ". ";
  }
  os << "A peer never reached this collective: check that every device "
     << "executes the same sequence of collectives, or raise strata_jax.set_timeout().";
  return fail(os.str());
}

std::string InProcTeam::arrive(const OpDesc& desc, const void* in, void* out) {
  auto& me = slot_->peers[rank_];
  me.in = in;
  me.out = out;
  me.desc = desc;
  std::string err = barrier("arrive");
  if (!err.empty()) return err;
  return check_descs(desc);
}

std::string InProcTeam::check_descs(const OpDesc& desc) const {
  for (int j = 0; j < size_; ++j) {
    std::string err = check_desc(desc, j);
    // Every rank sees the same descriptors, so every rank fails here: nobody touches a peer's
    // buffers.
    if (!err.empty()) return err;
  }
  return {};
}

std::string InProcTeam::check_desc(const OpDesc& desc, int j) const {
  const OpDesc& o = slot_->peers[j].desc;
  if (o.same_as(desc)) return {};
  std::ostringstream os;
  os << "strata_jax " << op_name_ << ": ranks disagree on the collective (rank " << rank_ << ": "
     << desc.name << ", dtype " << dtype_name(desc.dtype) << ", " << desc.in_bytes << " B in, "
     << desc.out_bytes << " B out; rank " << j << ": " << o.name << ", dtype "
     << dtype_name(o.dtype) << ", " << o.in_bytes << " B in, " << o.out_bytes << " B out";
  if (o.params != desc.params)
    os << "; their parameters differ (" << desc.params.describe() << " vs " << o.params.describe()
       << "): e.g. ppermute's permutation (hashed) or pbroadcast's root";
  os << "). Every rank of a group must call the same collective with the same shape, dtype "
        "and parameters.";
  return os.str();
}

std::string InProcTeam::arrive_lead(const OpDesc& desc, const void* in, void* out, LeadFn fn) {
  auto& me = slot_->peers[rank_];
  me.in = in;
  me.out = out;
  me.desc = desc;
  me.lead = fn;
  ++barriers_;
  stats().rendezvous_steps.fetch_add(1, std::memory_order_relaxed);
  me.reached.store(barriers_, std::memory_order_release);
  const uint32_t target = barriers_ * static_cast<uint32_t>(size_);
  // acq_rel: publishes the stores above to the last arriver, and (for the last arriver) makes
  // every peer's stores visible.
  const uint32_t now = slot_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now == target) {
    // Last to arrive: every peer waits below for target + 1. Run every rank's part unless the
    // ranks disagree (each then reports it itself) or a peer already gave up (timed out): its
    // buffers may be gone.
    bool agree = !slot_->failed.load(std::memory_order_acquire);
    for (int j = 0; j < size_ && agree; ++j)
      agree = slot_->peers[j].lead.call != nullptr && slot_->peers[j].desc.same_as(desc);
    // Ranks on arrive_pairs (another size) wait on their own words: tell them.
    if (!agree && !slot_->failed.load(std::memory_order_acquire)) {
      std::string e = check_descs(desc);
      fail(e.empty() ? std::string("strata_jax ") + op_name_ +
                           ": internal error: the ranks of a call disagree on its path"
                     : e);
    }
    if (agree) {
      OpTimer::arrived();  // comm_stats(): the leader moves every rank's bytes; the others wait
      for (int j = 0; j < size_; ++j) {
        CallSlot::Peer& p = slot_->peers[j];
        p.lead_err = p.lead.call(p.lead.ctx);
      }
      copy_fence();  // the parts' non-temporal stores, before the release below
      slot_->led.store(true, std::memory_order_relaxed);
    }
    // release: the outputs, lead_err and led above are visible to every waiter's acquire.
    slot_->arrivals.fetch_add(1, std::memory_order_release);
    futex_wake_all(&slot_->arrivals, false);
  } else {
    std::string err = wait_arrivals(target + 1, "arrive");
    if (!err.empty()) return err;
  }
  if (slot_->led.load(std::memory_order_relaxed)) return me.lead_err;
  std::string err = check_descs(desc);
  if (!err.empty()) return err;
  if (slot_->failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(slot_->fail_mu);
    return slot_->failure;
  }
  return fail(std::string("strata_jax ") + op_name_ +
              ": internal error: the ranks of a call disagree on its path (arrive_lead)");
}

std::string InProcTeam::copy_pair(int j) {
  CallSlot::Peer& me = slot_->peers[rank_];
  CallSlot::Peer& p = slot_->peers[j];
  if (!p.desc.same_as(me.desc)) return fail(check_desc(me.desc, j));
  // The claim decides which of the two ranks copies; acq_rel: the winner sees the loser's
  // publication (already seen through `pub`) and a rank abandoning the pair sees the claim.
  const int lo = std::min(rank_, j), hi = std::max(rank_, j);
  std::atomic<uint8_t>& claim = slot_->claims[static_cast<size_t>(lo) * size_ + hi];
  uint8_t expect = 0;
  if (!claim.compare_exchange_strong(expect, 1, std::memory_order_acq_rel)) return {};
  std::string err = me.pair.call(me.pair.ctx, j);     // j's block into my output
  std::string err2 = p.pair.call(p.pair.ctx, rank_);  // my block into j's output
  copy_fence();  // the copies' non-temporal stores, before the releases below
  claim.store(2, std::memory_order_release);
  if (err.empty()) err = err2;
  if (!err.empty()) return fail(err);
  me.done.fetch_add(1, std::memory_order_acq_rel);
  // release: j's output is written before j sees its count complete.
  if (p.done.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_))
    futex_wake_all(&p.done, false);
  return {};
}

void InProcTeam::abandon_pairs() {
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const int lo = std::min(rank_, j), hi = std::max(rank_, j);
    std::atomic<uint8_t>& claim = slot_->claims[static_cast<size_t>(lo) * size_ + hi];
    uint8_t expect = 0;
    if (claim.compare_exchange_strong(expect, 3, std::memory_order_acq_rel)) continue;
    // Being copied by the peer: a few microseconds to milliseconds, then this rank may go.
    while (claim.load(std::memory_order_acquire) == 1) std::this_thread::yield();
  }
}

std::string InProcTeam::arrive_pairs(const OpDesc& desc, const void* in, void* out, PairFn fn) {
  auto& me = slot_->peers[rank_];
  me.in = in;
  me.out = out;
  me.desc = desc;
  me.pair = fn;
  ++barriers_;
  stats().rendezvous_steps.fetch_add(1, std::memory_order_relaxed);
  me.reached.store(barriers_, std::memory_order_release);
  // seq_cst, with the seq_cst loads of the peers' `pub` below: of two ranks publishing at the
  // same time at least one sees the other (so every pair is copied by someone); both may, and
  // the claim in copy_pair picks one. It also publishes the stores above to the peers.
  me.pub.store(1, std::memory_order_seq_cst);
  std::string err;
  // Counted in `arrivals` too, so that ranks that took another path (their descriptors differ:
  // arrive_lead's size test) are not waited for in vain: whoever arrives last checks them all.
  if (slot_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_)) {
    err = check_descs(desc);
    if (!err.empty()) err = fail(err);
  }
  if (!err.empty()) {
  } else if (slot_->failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(slot_->fail_mu);
    err = slot_->failure;
  } else {
    err = fn.call(fn.ctx, rank_);  // my own block, while my input is in cache
    if (!err.empty()) err = fail(err);
  }
  if (err.empty()) {
    copy_fence();
    me.done.fetch_add(1, std::memory_order_acq_rel);
    for (int k = 1; k < size_ && err.empty(); ++k) {
      const int j = (rank_ + k) % size_;
      if (slot_->peers[j].pub.load(std::memory_order_seq_cst)) err = copy_pair(j);
    }
  }
  // Every pair left is copied by a peer that has yet to arrive (or is copying it now).
  if (err.empty()) err = wait_word(&me.done, static_cast<uint32_t>(size_), "arrive");
  if (!err.empty()) abandon_pairs();
  return err;
}

std::string InProcTeam::arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs) {
  if (nbufs > kMaxBufs) return fail("internal error: too many buffers for arrive_multi");
  auto& me = slot_->peers[rank_];
  for (int i = 0; i < kMaxBufs; ++i)
    me.bufs[i] = i < nbufs && bufs[i].bytes ? bufs[i].ptr : nullptr;
  // arrive()'s barrier (acq_rel) publishes the pointers stored above to every peer.
  return arrive(desc, nullptr, nullptr);
}

std::string InProcTeam::arrive_list(const OpDesc& desc, const OperandRef* ops, int nops) {
  (void)nops;  // the descriptors' signature (OpParams::signature) makes every rank's count the same
  slot_->peers[rank_].ops = ops;
  // arrive()'s barrier (acq_rel) publishes the array pointer stored above to every peer.
  return arrive(desc, nullptr, nullptr);
}

}  // namespace strata
