// The low-latency path of the shared-memory fabric (see shm_ll.h).
#include "fabric/shm_ll.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "coll/kernels.h"
#include "common/env.h"
#include "common/settings.h"
#include "fabric/stats.h"

namespace strata {
namespace {

// Relaxed: a setting read when a channel is created, not a synchronization flag.
// Threshold of input bytes per rank from STRATA_LL_BYTES (0 turns the path off).
std::atomic<int64_t> g_ll_bytes{
    env_bytes("STRATA_LL_BYTES", static_cast<int64_t>(kLlDefaultBytes))};

// The staged form's limit for a channel this process creates (shm_ll.h): STRATA_LL_STAGE_BYTES,
// or set_ll_stage_bytes(); -1 (unset): 0, the form off.
std::atomic<int64_t> g_stage_bytes{env_bytes("STRATA_LL_STAGE_BYTES", -1)};

// The direct form's threshold for a channel this process creates (shm_ll.h): STRATA_DIRECT_BYTES,
// or set_direct_bytes(); -1 (unset): kDirectDefaultBytes.
std::atomic<int64_t> g_direct_bytes{env_bytes("STRATA_DIRECT_BYTES", -1)};

uint64_t direct_limit() {
  const int64_t v = g_direct_bytes.load(std::memory_order_relaxed);
  return v >= 0 ? static_cast<uint64_t>(v) : kDirectDefaultBytes;
}

uint64_t stage_limit() {
  const int64_t v = g_stage_bytes.load(std::memory_order_relaxed);
  return v > 0 ? static_cast<uint64_t>(v) : 0;
}

// The staged form's bounce buffers of this process that peers may still read: each is released
// once every peer has marked the slot that published it read (or the slot holds another call,
// which its owner claims only after that).
struct StagedUse {
  Bounce* bounce;
  LlEntry* entry;
  uint64_t tag, others;
};
std::mutex g_stage_mu;
std::vector<StagedUse> g_staged;

// A bounce buffer of at least `bytes` for the staged form, after releasing those every reader
// is done with. nullptr and *err on failure.
Bounce* acquire_stage(ShmFabric* f, size_t bytes, std::string* err) {
  {
    std::lock_guard<std::mutex> lock(g_stage_mu);
    for (size_t i = 0; i < g_staged.size();) {
      const StagedUse& u = g_staged[i];
      // acquire: the peers' reads of the buffer happen before its reuse (their fetch_or of
      // read_by is seq_cst; a changed stamp means the owner reclaimed the slot after them).
      if (u.entry->stamp.load(std::memory_order_acquire) != u.tag ||
          (u.entry->read_by.load(std::memory_order_acquire) & u.others) == u.others) {
        f->release_bounce(u.bounce);
        g_staged[i] = g_staged.back();
        g_staged.pop_back();
      } else {
        ++i;
      }
    }
  }
  return f->acquire_bounce(bytes, /*critical=*/true, err);
}

size_t ll_threshold() {
  const int64_t b = g_ll_bytes.load(std::memory_order_relaxed);
  if (b <= 0) return 0;
  return static_cast<size_t>(b) > kLlMaxBytes ? kLlMaxBytes : static_cast<size_t>(b);
}

// A wait at least this short would have been caught by spinning (2000 pauses: ~50 us).
constexpr int64_t kLlSpinWindowNs = 40'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

uint64_t others_mask(int size, int owner) {
  const uint64_t all = size >= 64 ? ~uint64_t{0} : (uint64_t{1} << size) - 1;
  return all & ~(uint64_t{1} << owner);
}

// Channels by communicator, cached per process (channels are never freed, so a pointer found
// once stays valid; nullptr: the table was full, which it then stays for every process).
std::mutex g_cache_mu;
std::unordered_map<uint64_t, LlChannel*> g_cache;

LlChannel* channel_for(ShmFabric* f, uint64_t comm, int size) {
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    auto it = g_cache.find(comm);
    if (it != g_cache.end()) return it->second;
  }
  auto* reg = reinterpret_cast<LlRegion*>(f->ll_region());
  LlChannel* ch = nullptr;
  {
    // The mutex orders the claimer's plain stores before every later locker's loads.
    CtlLock lock(&f->control()->mu);
    LlChannel* free_ch = nullptr;
    for (LlChannel& c : reg->channels) {
      if (c.comm == comm) {
        ch = &c;
        break;
      }
      if (!free_ch && c.comm == 0) free_ch = &c;
    }
    if (!ch && free_ch) {
      ch = free_ch;
      const size_t data = round_up(ll_threshold(), 64);
      const size_t entry = kLlHeaderBytes + data;
      const size_t table = round_up(sizeof(LlRegion), 4096);
      const size_t need = static_cast<size_t>(size) * kLlEntries * entry;
      const bool fits = size <= 64 && data > 0 && table + reg->used + need <= kLlRegionBytes;
      ch->size = size;
      ch->data_bytes = fits ? static_cast<uint32_t>(data) : 0;  // 0: general path only
      ch->entry_bytes = entry;
      ch->stage_bytes = fits ? stage_limit() : 0;
      ch->direct_bytes = direct_limit();
      ch->offset = table + reg->used;
      if (fits) reg->used += need;
      ch->comm = comm;  // the slots are fresh memfd pages: stamps, claims and bits all 0
    }
  }
  std::lock_guard<std::mutex> lock(g_cache_mu);
  g_cache[comm] = ch;
  return ch;
}

}  // namespace

void set_ll_bytes(int64_t bytes) { g_ll_bytes.store(bytes, std::memory_order_relaxed); }
int64_t get_ll_bytes() { return static_cast<int64_t>(ll_threshold()); }
void set_ll_stage_bytes(int64_t bytes) {
  g_stage_bytes.store(bytes < 0 ? -1 : bytes, std::memory_order_relaxed);
}
int64_t get_ll_stage_bytes() { return static_cast<int64_t>(stage_limit()); }
void set_direct_bytes(int64_t bytes) {
  g_direct_bytes.store(bytes < 0 ? -1 : bytes, std::memory_order_relaxed);
}
int64_t get_direct_bytes() { return static_cast<int64_t>(direct_limit()); }

// ---- joining ----

uint64_t ShmLlTeam::multi_bytes(const BufRef* bufs, int nbufs, bool* eligible) {
  uint64_t total = 0;
  *eligible = nbufs <= kMaxBufs;
  for (int i = 0; i < nbufs && *eligible; ++i) {
    if (bufs[i].bytes && bufs[i].written) *eligible = false;
    total += round_up(bufs[i].bytes, 64);
  }
  return *eligible ? total : 0;
}

std::unique_ptr<ShmLlTeam> ShmLlTeam::join(ShmFabric* f, const Placement& pl, int64_t run_id,
                                           int64_t op_id, const OpDesc& desc, uint64_t bytes,
                                           const char* op_name, std::string* err, bool slot_ok,
                                           bool direct_ok) {
  if (pl.size < 2 || pl.size > 64) return nullptr;
  LlChannel* ch = channel_for(f, pl.comm, pl.size);
  if (!ch || ch->data_bytes == 0) return nullptr;
  // Every rank of a matching call decides alike: the channel's limits are shared, may_stage,
  // slot_ok and direct_ok derive from the op and its sizes.
  // The staged form where it is asked for (STRATA_LL_STAGE_BYTES: off by default), else the
  // direct form above its threshold, else a slot; anything else takes the general path.
  const bool staged =
      slot_ok && desc.may_stage && bytes > ch->data_bytes && bytes <= ch->stage_bytes;
  const bool direct = !staged && direct_ok && bytes > ch->direct_bytes;
  if (!staged && !direct && (!slot_ok || bytes > ch->data_bytes)) return nullptr;
  if (ch->size != pl.size) {
    *err = std::string("strata_jax ") + op_name + ": ranks disagree on the group size (" +
           std::to_string(ch->size) + " vs " + std::to_string(pl.size) + ")";
    return nullptr;
  }
  auto t = std::make_unique<ShmLlTeam>(f, ch, f->ll_region(), pl, op_name);
  const ShmFabric::CallSeq seq = f->next_seq(pl, run_id, op_id);
  t->comm_ = pl.comm;
  t->exec_ = seq.exec;
  t->op_ = seq.op;
  t->occ_ = seq.occ;
  t->tag_ = slot_tag(pl.comm, seq.exec, seq.op, seq.occ);
  t->staged_ = staged;
  t->direct_ = direct;
  (direct ? stats().direct_calls : stats().low_latency_calls)
      .fetch_add(1, std::memory_order_relaxed);
  stats().rendezvous_steps.fetch_add(1, std::memory_order_relaxed);  // its one publication
  return t;
}

ShmLlTeam::ShmLlTeam(ShmFabric* f, LlChannel* ch, char* region, const Placement& pl,
                     const char* op_name)
    : SeatedTeam(pl, op_name), f_(f), ch_(ch), region_(region) {
  in_.assign(pl.size, nullptr);
  bufs_.assign(static_cast<size_t>(pl.size) * kMaxBufs, nullptr);
  found_.assign(pl.size, nullptr);
}

ShmLlTeam::~ShmLlTeam() {
  mark_read();
  // A bounce buffer of the direct form is reused only once every peer is known to be done with
  // it (depart() waited for them); after a failed call a peer might still use it, so it stays
  // busy (leaked) instead, as on the general path.
  if (bounce_ && release_bounce_) f_->release_bounce(bounce_);
}

LlEntry* ShmLlTeam::entry(int rank, uint32_t pos) const {
  const size_t ring = static_cast<size_t>(kLlEntries) * ch_->entry_bytes;
  return reinterpret_cast<LlEntry*>(region_ + ch_->offset + static_cast<size_t>(rank) * ring +
                                    static_cast<size_t>(pos % kLlEntries) * ch_->entry_bytes);
}

static char* data_of(LlEntry* e) { return reinterpret_cast<char*>(e) + kLlHeaderBytes; }

namespace {
// Where this process expects each peer's next slot on each channel: one past the slot it found
// last (a rank claims the slot after its previous one whenever that one is free, the usual
// case). Process-local, per channel (by its index in the region) and peer rank; relaxed: a
// hint, checked against the stamp like any slot.
std::atomic<uint32_t> g_hint[kLlChannels][64];
}  // namespace

LlEntry* ShmLlTeam::find(int j, bool full) const {
  // acquire: pairs with the owner's stamp store; the header and data written before it are
  // visible, and stay put until this rank sets its read_by bit.
  auto holds = [&](LlEntry* e) {
    return e->stamp.load(std::memory_order_acquire) == tag_ && e->exec == exec_ && e->op == op_ &&
           e->occ == occ_;
  };
  // The hinted slot first: a waiter polling a peer that has not published yet reads one line
  // of the peer's ring per poll, not 16 (each a line the peer may be writing: the scan of the
  // whole ring at every poll cost 1-2 us per call between 2 processes).
  const size_t c = static_cast<size_t>(ch_ - reinterpret_cast<LlRegion*>(region_)->channels);
  std::atomic<uint32_t>& hint = g_hint[c][j];
  const uint32_t h = hint.load(std::memory_order_relaxed);
  if (LlEntry* e = entry(j, h); holds(e)) {
    hint.store(h + 1, std::memory_order_relaxed);
    return e;
  }
  if (!full) return nullptr;
  for (uint32_t p = 1; p < static_cast<uint32_t>(kLlEntries); ++p) {
    LlEntry* e = entry(j, h + p);
    if (holds(e)) {
      hint.store(h + p + 1, std::memory_order_relaxed);
      return e;
    }
  }
  return nullptr;
}

void ShmLlTeam::notify(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers) {
  // seq_cst load after the caller's seq_cst store of the condition (see LlChannel).
  if (sleepers->load(std::memory_order_seq_cst) != 0) {
    word->fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(word, /*shared=*/true);
  }
}

bool ShmLlTeam::same_cpu(int j, int cpu1) const {
  // Relaxed: a hint about where rank j runs, not a synchronization flag.
  return cpu1 > 0 && ch_->ranks[j].cpu1.load(std::memory_order_relaxed) == cpu1;
}

template <class Ready, class Missing, class Since>
std::string ShmLlTeam::wait(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers,
                            Ready ready, Missing missing, Since since, bool colocated,
                            const char* phase, Clock::time_point deadline, const OpDesc* arriving) {
  // Spinning pays only while the awaited peers are running; with more runnable threads than
  // cores (more processes than cores, or other jobs) it takes the core they need. So the spin
  // budget adapts, like glibc's adaptive mutexes: it grows (to STRATA_LL_SPINS pauses, about
  // 50 us) after waits short enough that spinning would have caught them, and halves after
  // longer ones, down to 0 (straight to the futex). Relaxed: a per-process heuristic.
  // More processes on this fabric than cores: a short cap of 100 pauses (and the yields after
  // them). Going straight to the futex (as the general path did then, shm.cc wait_spins) beat
  // the uncapped budget, which kept growing back after quick waits and took the cores the
  // peers needed, but a short spin still catches the peer that is about to arrive: 4
  // processes on 2 cores under mpirun, 4-256 KiB, three alternated runs each, median speedup
  // over XLA over MPI 1.34x with a cap of 100 (no point below 1.0x of 36) against 1.24x at 30,
  // 1.28x at 300, and 1.14x with no spinning (4 of 27 points below at 4-64 KiB); 2000 fell to
  // 0.65-0.99x.
  static const int max_spins =
      env_count("STRATA_LL_SPINS",
                f_->nprocs() > static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) ? 100 : 2000);
  static const int max_yields = env_count("STRATA_LL_YIELDS", 4);
  static std::atomic<int> budget{max_spins};
  // A rank awaited on this very CPU cannot run while this one spins: two processes the
  // scheduler put on one core (other jobs busy on the other) took a full spin budget per wait,
  // about 45 us, twice per call (2 processes, ppermute 64 KiB: 97 us a call instead of 8.7 us
  // for seconds on end, and back once they were on two cores again; docs/design.md). The
  // yields always follow: they hand the CPU to a runnable peer on it, and cost a system call
  // where there is none.
  const int spins = colocated ? 0 : budget.load(std::memory_order_relaxed);
  const int yields = max_yields;
  const auto t0 = Clock::now();
  if (std::strcmp(phase, "reuse") != 0)
    stats().channel_waits.fetch_add(1, std::memory_order_relaxed);
  auto adapt = [](bool quick) {
    const int b = budget.load(std::memory_order_relaxed);
    budget.store(quick ? std::min(max_spins, 2 * b + 64) : b / 2, std::memory_order_relaxed);
  };
  for (int i = 0; i < spins; ++i) {
    if (ready((i & 15) == 15)) {
      adapt(true);
      return {};
    }
    if (!failed_.empty()) return failed_;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  const int64_t t0_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
  // Would spinning have caught this wait? Judged by when the condition became true (the
  // awaited peer's publication, or its mark), not by when this rank saw it: a futex wake-up
  // takes tens of microseconds here, so a waiter that slept always woke "late", and a budget
  // judged by that stayed at 0 for good once it got there. Not for a wait on a rank on this
  // CPU, which only the yield let run.
  auto judge = [&] {
    if (colocated) return;
    const int64_t done = static_cast<int64_t>(since());
    adapt((done > 0 ? done : now_ns()) - t0_ns < kLlSpinWindowNs);
  };
  for (int i = 0; i < yields; ++i) {
    if (ready(true)) {
      judge();
      return {};
    }
    if (!failed_.empty()) return failed_;
    sched_yield();
  }
  bool slept = false;
  struct AfterSleep {  // whichever way the sleeping phase ends
    const bool& slept;
    decltype(judge)& j;
    ~AfterSleep() {
      if (slept) stats().channel_sleeps.fetch_add(1, std::memory_order_relaxed);
      j();
    }
  } after_sleep{slept, judge};
  const auto start = Clock::now();
  auto next_straddle_check = start + std::chrono::milliseconds(2);
  for (;;) {
    if (ready(true)) return {};
    if (!failed_.empty()) return failed_;
    const auto now = Clock::now();
    // A missing rank whose process disconnected (exited or was killed) never comes.
    std::vector<int> miss = missing();
    std::vector<int> dead;
    for (int j : miss) {
      if (!member_parts_ || !device_ids_) break;
      const int p = f_->device_proc(device_ids_[member_parts_[j]]);
      if (p >= 0 && p != f_->proc() && !f_->peer_alive(p)) dead.push_back(j);
    }
    if (!dead.empty()) {
      return std::string("strata_jax ") + op_name_ + ": " +
             f_->ranks_where(dead, member_parts_, device_ids_) +
             " exited or was killed before reaching this collective in phase '" + phase +
             "' (group of " + std::to_string(size_) + "; reported by rank " +
             std::to_string(rank_) + ", process " + std::to_string(f_->job_proc(f_->proc())) +
             "). The job cannot complete this collective.";
    }
    // A peer that took the general path for this call (its size is above the threshold).
    if (arriving && now >= next_straddle_check) {
      next_straddle_check = now + std::chrono::milliseconds(10);
      std::string m = straddler(*arriving);
      if (!m.empty()) return m;
    }
    if (now >= deadline) {
      if (ready(true)) return {};
      return missing_message(phase, missing());
    }
    auto slice =
        std::min(deadline, arriving ? next_straddle_check : now + std::chrono::milliseconds(50)) -
        now;
    const int64_t ns = std::max<int64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count(), 100'000);
    // Register, then re-check (the fence orders ready()'s acquire loads after the increment):
    // a notifier that loaded sleepers == 0 stored its condition before, so ready() sees it.
    sleepers->fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word->load(std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready(true) && failed_.empty()) {
      slept = true;
      futex_wait(word, seen, ns, /*shared=*/true);
    }
    sleepers->fetch_sub(1, std::memory_order_relaxed);
  }
}

std::string ShmLlTeam::claim(LlEntry** out, Clock::time_point deadline) {
  const uint64_t others = others_mask(size_, rank_);
  std::atomic<uint32_t>& next = ch_->ranks[rank_].next;
  LlEntry* got = nullptr;
  // Free: never used, or every peer read the previous occupant (acquire: their reads happen
  // before this rank's rewrite). Starting at `next`, the first free slot wins; a slot left
  // unread by a failed call is skipped, not waited for.
  auto try_claim = [&](bool) -> bool {
    const uint32_t start = next.load(std::memory_order_relaxed);
    for (uint32_t k = 0; k < static_cast<uint32_t>(kLlEntries); ++k) {
      LlEntry* e = entry(rank_, start + k);
      uint32_t zero = 0;
      if (!e->claim.compare_exchange_strong(zero, 1, std::memory_order_acq_rel)) continue;
      if (e->stamp.load(std::memory_order_acquire) == 0 ||
          (e->read_by.load(std::memory_order_acquire) & others) == others) {
        next.store(start + k + 1, std::memory_order_relaxed);
        got = e;
        return true;
      }
      e->claim.store(0, std::memory_order_release);
    }
    return false;
  };
  if (try_claim(true)) {  // the usual case: the next slot is free
    *out = got;
    return {};
  }
  std::string err = wait(
      &ch_->freed, &ch_->free_sleepers, try_claim,
      [&] {
        // Ranks that have not finished reading the slot this rank would reuse next.
        std::vector<int> m;
        const uint64_t bits = entry(rank_, next.load(std::memory_order_relaxed))
                                  ->read_by.load(std::memory_order_acquire);
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && !(bits >> j & 1)) m.push_back(j);
        return m;
      },
      [] { return uint64_t{0}; }, false, "reuse", deadline, nullptr);
  *out = got;
  return err;
}

std::string ShmLlTeam::arrive(const OpDesc& desc, const void* in, void* out) {
  out_ = out;
  const BufRef buf{in, desc.in_bytes, false};
  return publish_and_wait(desc, &buf, 1);
}

std::string ShmLlTeam::prepare_direct(const OpDesc& desc, const void* in, void* out,
                                      uint64_t pub[6]) {
  ShmFabric::DirectBuffers direct;
  std::string err = f_->share_direct(in, desc.in_bytes, out, desc.out_bytes, &direct);
  if (!err.empty()) return std::string("strata_jax ") + op_name_ + ": " + err;
  const bool in_ok = direct.in_ok, out_ok = direct.out_ok;
  const strata_seg_info &in_seg = direct.in, &out_seg = direct.out;
  pub[0] = in_ok && desc.in_bytes ? in_seg.segment_id : 0;
  pub[1] = in_ok && desc.in_bytes ? in_seg.offset : 0;
  pub[2] = reinterpret_cast<uintptr_t>(in);
  pub[3] = out_ok && desc.out_bytes ? out_seg.segment_id : 0;
  pub[4] = out_ok && desc.out_bytes ? out_seg.offset : 0;
  pub[5] = reinterpret_cast<uintptr_t>(out);
  if (in_ok && out_ok) return {};
  // Staging, as the general path does (ShmTeam::arrive): the buffer that cannot be shared goes
  // through a bounce buffer every peer has mapped; a staged output is copied back at departure.
  const size_t in_room = in_ok ? 0 : round_up(desc.in_bytes, 64);
  bounce_ = f_->acquire_bounce(in_room + (out_ok ? 0 : desc.out_bytes), true, &err);
  if (!bounce_) return std::string("strata_jax ") + op_name_ + ": " + err;
  release_bounce_ = true;  // until published: nobody else knows it
  stats().staged_calls.fetch_add(1, std::memory_order_relaxed);
  if (!in_ok) {
    copy_bytes(bounce_->base, in, desc.in_bytes);
    copy_fence();  // the streaming stores, before the stamp's release
    stats().staged_bytes.fetch_add(desc.in_bytes, std::memory_order_relaxed);
    pub[0] = bounce_->id;
    pub[1] = 0;
    pub[2] = reinterpret_cast<uintptr_t>(bounce_->base);
  }
  if (!out_ok) {
    user_out_ = out;
    out_room_ = in_room;
    out_bytes_ = desc.out_bytes;
    pub[3] = bounce_->id;
    pub[4] = in_room;
    pub[5] = reinterpret_cast<uintptr_t>(bounce_->base + in_room);
  }
  return {};
}

std::string ShmLlTeam::arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs) {
  if (nbufs > kMaxBufs)
    return std::string("strata_jax ") + op_name_ + ": internal error: too many buffers";
  return publish_and_wait(desc, bufs, nbufs);
}

std::string ShmLlTeam::publish_and_wait(const OpDesc& desc, const BufRef* bufs, int nbufs) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  uint64_t off[kMaxBufs] = {}, total = 0;
  for (int i = 0; i < nbufs; ++i) {
    off[i] = total;
    total += round_up(bufs[i].bytes, 64);
  }
  // Staged form: the data goes into a bounce buffer every peer has mapped (before claiming the
  // slot, so that a failure here leaves the ring as it was).
  uint64_t pub[6] = {};  // the direct form's (segment, offset, address) of input and output
  if (direct_) {
    std::string derr = prepare_direct(desc, bufs[0].ptr, out_, pub);
    if (!derr.empty()) return derr;
  }
  Bounce* stage = nullptr;
  if (staged_ && total) {
    std::string serr;
    stage = acquire_stage(f_, total, &serr);
    if (!stage) return std::string("strata_jax ") + op_name_ + ": " + serr;
    for (int i = 0; i < nbufs; ++i)
      if (bufs[i].bytes) copy_bytes(stage->base + off[i], bufs[i].ptr, bufs[i].bytes);
    copy_fence();  // the streaming stores, before the stamp's release below
    stats().staged_calls.fetch_add(1, std::memory_order_relaxed);
    stats().staged_bytes.fetch_add(total, std::memory_order_relaxed);
  }
  LlEntry* me = nullptr;
  std::string err = claim(&me, deadline);
  if (!err.empty()) {
    if (stage) f_->release_bounce(stage);
    return err;
  }
  // Every peer has read the previous occupant and nobody reads the header or data before the
  // new stamp: plain stores, published by the seq_cst (release) stamp store below.
  me->stamp.store(0, std::memory_order_relaxed);
  me->read_by.store(0, std::memory_order_relaxed);
  me->exec = exec_;
  me->op = op_;
  me->occ = occ_;
  me->kind = desc.kind;
  me->dtype = desc.dtype;
  me->reduce = desc.reduce;
  me->params = desc.params.digest();
  me->proc = f_->proc();
  me->device = device_;
  me->in_bytes = desc.in_bytes;
  me->out_bytes = desc.out_bytes;
  std::strncpy(me->name, desc.name ? desc.name : "", sizeof(me->name) - 1);
  me->name[sizeof(me->name) - 1] = 0;
  me->data_seg = stage ? stage->id : 0;
  me->data_off = 0;
  me->data_ptr = stage ? reinterpret_cast<uintptr_t>(stage->base) : 0;
  me->out_seg = me->out_off = me->out_ptr = 0;
  me->algo = desc.algo;
  if (direct_) {
    me->data_seg = pub[0];
    me->data_off = pub[1];
    me->data_ptr = pub[2];
    me->out_seg = pub[3];
    me->out_off = pub[4];
    me->out_ptr = pub[5];
  }
  for (int i = 0; i < kMaxBufs; ++i) {
    me->buf_off[i] = i < nbufs ? off[i] : 0;
    me->buf_bytes[i] = i < nbufs ? bufs[i].bytes : 0;
  }
  if (!stage && !direct_) {
    for (int i = 0; i < nbufs; ++i)  // regular stores, no fence
      if (bufs[i].bytes) std::memcpy(data_of(me) + off[i], bufs[i].ptr, bufs[i].bytes);
  }
  me->pub_ns = static_cast<uint64_t>(now_ns());
  const int cpu1 = sched_getcpu() + 1;  // 0 where the CPU cannot be told
  // Relaxed: a hint for this rank's waiters (same_cpu), written only when it moved.
  if (ch_->ranks[rank_].cpu1.load(std::memory_order_relaxed) != cpu1)
    ch_->ranks[rank_].cpu1.store(cpu1, std::memory_order_relaxed);
  me->read_ns.store(0, std::memory_order_relaxed);
  me->stamp.store(tag_, std::memory_order_seq_cst);
  me->claim.store(0, std::memory_order_release);
  stage_ = stage;  // listed for release by mark_read(), once this rank's own reads are done
  found_[rank_] = me;

  int left = size_ - 1;
  // `full`: every slot of a missing peer's ring, else only the hinted one (find).
  auto ready = [&](bool full) -> bool {
    for (int j = 0; j < size_ && left > 0; ++j) {
      if (found_[j]) continue;
      LlEntry* e = find(j, full);
      if (!e) continue;
      found_[j] = e;
      --left;
      bool same_bufs = true;  // arrive_multi: every buffer of the same size
      for (int i = 0; i < kMaxBufs; ++i)
        same_bufs = same_bufs && e->buf_bytes[i] == (i < nbufs ? bufs[i].bytes : 0);
      if (failed_.empty() &&
          (e->kind != desc.kind || e->dtype != desc.dtype || e->reduce != desc.reduce ||
           e->params != desc.params.digest() || e->in_bytes != desc.in_bytes ||
           e->out_bytes != desc.out_bytes || !same_bufs)) {
        failed_ = mismatch(desc);
        notify(&ch_->epoch, &ch_->sleepers);  // waiters see it now, not at their next slice
      }
    }
    return left == 0 && failed_.empty();
  };
  // Only the last rank to publish wakes the sleepers (nobody can finish before it, so waking
  // on every publish would only make the waiters that still miss a peer take the cores the
  // missing peers need: 3 wasted wake-ups per call with 4 ranks). Each rank stores its stamp,
  // then a seq_cst fence, then scans: of the ranks publishing at the same time, the one whose
  // fence comes last sees every other stamp, so at least one rank sees the call complete and
  // wakes. A rank that finds a disagreement wakes everyone too (they fail at once).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const bool complete = ready(true);
  bool colocated = false;  // a missing peer last published from this CPU
  for (int j = 0; j < size_ && !complete && !colocated; ++j)
    colocated = !found_[j] && j != rank_ && same_cpu(j, cpu1);
  if (complete || !failed_.empty()) notify(&ch_->epoch, &ch_->sleepers);
  err = complete ? failed_
                 : wait(
                       &ch_->epoch, &ch_->sleepers, ready,
                       [&] {
                         std::vector<int> m;
                         for (int j = 0; j < size_; ++j)
                           if (!found_[j]) m.push_back(j);
                         return m;
                       },
                       [&] {  // the last peer's publication
                         uint64_t last = 0;
                         for (int j = 0; j < size_; ++j)
                           if (j != rank_ && found_[j]) last = std::max(last, found_[j]->pub_ns);
                         return last;
                       },
                       colocated, "arrive", deadline, &desc);
  if (!err.empty()) {
    if (err.find("disagree") != std::string::npos)
      stats().mismatches.fetch_add(1, std::memory_order_relaxed);
    if (direct_) release_bounce_ = false;  // a peer may still come and use it
    return err;
  }
  local_ranks_ = 0;
  for (int j = 0; j < size_; ++j)
    if (found_[j]->proc == f_->proc()) ++local_ranks_;
  descs_.assign(size_, desc);
  if (direct_) {
    // Every rank's own buffers (or its bounce buffer), mapped here unless this process's own.
    release_bounce_ = false;  // from here on a peer may be using it: depart() waits for them
    outs_.assign(size_, nullptr);
    for (int j = 0; j < size_; ++j) {
      const LlEntry* e = found_[j];
      descs_[j].algo = e->algo;
      if ((e->data_seg | e->out_seg) & kBounceIdBit) any_staged_ = true;
      const bool local = e->proc == f_->proc();
      char* in = reinterpret_cast<char*>(e->data_ptr);
      char* out = reinterpret_cast<char*>(e->out_ptr);
      if (!local && e->in_bytes) {
        in = f_->translate(e->proc, e->data_seg, e->data_off, e->in_bytes, deadline, &err);
        if (!in) return std::string("strata_jax ") + op_name_ + ": " + err;
      }
      if (!local && e->out_bytes) {
        out = f_->translate(e->proc, e->out_seg, e->out_off, e->out_bytes, deadline, &err);
        if (!out) return std::string("strata_jax ") + op_name_ + ": " + err;
      }
      in_[j] = in;
      outs_[j] = out;
    }
    arrived_ = true;
    return {};
  }
  // Where each rank's data is: in its slot, or (staged form; every rank of an agreeing call is
  // staged alike) in its bounce buffer, mapped here unless it is this process's own.
  for (int j = 0; j < size_; ++j) {
    LlEntry* e = found_[j];
    char* base = data_of(e);
    if (e->data_seg) {
      if (e->proc == f_->proc()) {
        base = reinterpret_cast<char*>(e->data_ptr);
      } else {
        base = f_->translate(e->proc, e->data_seg, e->data_off, total, deadline, &err);  // = its
        if (!base) return std::string("strata_jax ") + op_name_ + ": " + err;
      }
    }
    in_[j] = base;
    for (int i = 0; i < kMaxBufs; ++i)
      bufs_[static_cast<size_t>(j) * kMaxBufs + i] =
          e->buf_bytes[i] ? base + e->buf_off[i] : nullptr;
  }
  for (OpDesc& d : descs_) d.algo = 0;  // one-shot: each rank reads the slots, writes its own
  return {};
}

void ShmLlTeam::mark_read() {
  if (read_marked_) return;
  read_marked_ = true;
  if (stage_) {
    // This rank has read its own copy; the bounce buffer stays busy until every peer has read
    // it too (acquire_stage releases it then). Not listed before: another device thread of this
    // process sweeping the list would release it while this rank still reads it, or, before
    // the stamp, take the slot's old stamp for a finished call.
    std::lock_guard<std::mutex> lock(g_stage_mu);
    g_staged.push_back(StagedUse{stage_, found_[rank_], tag_, others_mask(size_, rank_)});
  }
  bool any = false;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || !found_[j]) continue;
    // seq_cst (an acq_rel RMW): this rank's reads of the slot happen before the owner's
    // rewrite, and the store half of the freed/free_sleepers handshake. The time first
    // (relaxed; published by the RMW): for the owner's spin budget (wait).
    found_[j]->read_ns.store(static_cast<uint64_t>(now_ns()), std::memory_order_relaxed);
    found_[j]->read_by.fetch_or(uint64_t{1} << rank_, std::memory_order_seq_cst);
    any = true;
  }
  if (any) notify(&ch_->freed, &ch_->free_sleepers);
}

std::string ShmLlTeam::depart() {
  mark_read();
  if (!direct_ || !arrived_) return {};
  // The direct form: the peers read this rank's own input (and may write its output) until
  // they mark its slot read; the caller may reuse both as soon as this returns.
  LlEntry* me = found_[rank_];
  const uint64_t others = others_mask(size_, rank_);
  const uint64_t marked = me->read_by.load(std::memory_order_acquire);
  if ((marked & others) == others) return finish_depart();  // every peer is done already
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  const int cpu1 = sched_getcpu() + 1;
  bool colocated = false;  // a peer still reading last published from this CPU
  for (int j = 0; j < size_ && !colocated; ++j)
    colocated = j != rank_ && !(marked >> j & 1) && same_cpu(j, cpu1);
  std::string err = wait(
      &ch_->freed, &ch_->free_sleepers,
      // acquire: the peers' reads and writes of this rank's buffers happen before the return.
      [&](bool) { return (me->read_by.load(std::memory_order_acquire) & others) == others; },
      [&] {
        std::vector<int> m;
        const uint64_t bits = me->read_by.load(std::memory_order_acquire);
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && !(bits >> j & 1)) m.push_back(j);
        return m;
      },
      // acquire: the time a reader stored before its read_by bit (roughly the last reader's).
      [&] { return me->read_ns.load(std::memory_order_acquire); }, colocated, "depart", deadline,
      nullptr);
  if (!err.empty()) return err;  // bounce_ stays busy: a peer may still use it
  return finish_depart();
}

std::string ShmLlTeam::finish_depart() {
  if (user_out_) {
    copy_bytes(user_out_, bounce_->base + out_room_, out_bytes_);
    stats().staged_bytes.fetch_add(out_bytes_, std::memory_order_relaxed);
  }
  release_bounce_ = true;
  return {};
}

std::string ShmLlTeam::barrier(const char* phase) {
  return std::string("strata_jax ") + op_name_ + ": internal error: barrier '" + phase +
         "' on the low-latency path";
}

std::string ShmLlTeam::mismatch(const OpDesc& desc) const {
  std::ostringstream os;
  os << "strata_jax " << op_name_ << ": ranks disagree on a collective call (execution #" << exec_
     << " on their communicator, op " << op_ << ", occurrence " << occ_ << ", group of " << size_
     << "): ";
  // The parameters' digests are shown only when they are part of the disagreement.
  bool params_differ = false;
  for (int j = 0; j < size_; ++j)
    if (found_[j]) params_differ |= found_[j]->params != desc.params.digest();
  int shown = 0;
  for (int j = 0; j < size_; ++j) {
    const LlEntry* o = found_[j];
    if (!o) continue;
    if (shown == 8) {
      os << "; ...";
      break;
    }
    if (shown++) os << "; ";
    const int es = dtype_size(o->dtype);
    os << "rank " << j << " (device " << o->device << "): " << o->name << " "
       << dtype_name(o->dtype) << "[" << (es ? o->in_bytes / es : 0) << "] (" << o->in_bytes
       << " B in, " << o->out_bytes << " B out";
    if (params_differ) os << ", parameters " << std::hex << o->params << std::dec;
    os << ")";
  }
  os << ". Every rank of a group must make the same sequence of collective calls with the same "
        "op, shape, dtype and parameters (e.g. ppermute's permutation, hashed, or pbroadcast's "
        "root).";
  return os.str();
}

std::string ShmLlTeam::straddler(const OpDesc& desc) {
  ShmControl* ctl = f_->control();
  CtlLock lock(&ctl->mu);
  for (int i = 0; i < kShmSlots; ++i) {
    ShmSlot& s = *ctl->slot(i);
    if (s.tag != tag_ || s.comm != comm_ || s.exec != exec_ || s.op != op_ || s.occ != occ_)
      continue;
    // A peer met this call in the general rendezvous: its input is above the low-latency
    // threshold while this rank's is below, so the ranks disagree on the size. Name both sides
    // and fail the general slot too, so its waiters stop at once.
    std::ostringstream os;
    os << "strata_jax " << op_name_ << ": ranks disagree on a collective call (execution #" << exec_
       << " on their communicator, op " << op_ << ", occurrence " << occ_ << ", group of " << size_
       << "): ";
    int shown = 0;
    auto item = [&](int j, int64_t dev, const char* name, int32_t dt, uint64_t in_b,
                    uint64_t out_b) {
      if (shown++) os << "; ";
      const int es = dtype_size(dt);
      os << "rank " << j << " (device " << dev << "): " << name << " " << dtype_name(dt) << "["
         << (es ? in_b / es : 0) << "] (" << in_b << " B in, " << out_b << " B out)";
    };
    for (int j = 0; j < size_ && shown < 8; ++j)
      if (const LlEntry* o = found_[j])
        item(j, o->device, o->name, o->dtype, o->in_bytes, o->out_bytes);
    for (int j = 0; j < s.size && j < size_ && shown < 8; ++j) {
      const ShmPeer& o = s.peer(j);
      // acquire: pairs with the release store of `reached` that published the descriptor.
      if (found_[j] || o.reached.load(std::memory_order_acquire) < 1) continue;
      item(j, o.device, o.name, o.dtype, o.in_bytes, o.out_bytes);
    }
    os << " (sizes on both sides of the low-latency threshold of " << ch_->data_bytes << " B";
    if (ch_->stage_bytes)  // a slot, the staged form or the general path (shm_ll.h)
      os << " in a slot, or of its staged form's " << ch_->stage_bytes
         << " B (psum/pmax/pmin, pbroadcast: at most " << kLlMaxBytes << " B)";
    os << "). Every rank of a group must make the same sequence of collective calls with the "
          "same op, shape and dtype.";
    (void)desc;
    const std::string msg = os.str();
    uint32_t expected = 0;
    // As ShmTeam::fail: one writer of the message (acq_rel CAS), published by the release
    // store of 2; the wake makes the slot's waiters see it now.
    if (s.failed.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      std::strncpy(s.failure, msg.c_str(), sizeof(s.failure) - 1);
      s.failure[sizeof(s.failure) - 1] = 0;
      s.failed.store(2, std::memory_order_release);
    }
    futex_wake_all(&s.arrivals, true);
    return msg;
  }
  return {};
}

std::string ShmLlTeam::missing_message(const char* phase, const std::vector<int>& missing) const {
  std::ostringstream os;
  os << timed_out_waiting(op_name_, phase, missing) << " of a group of " << size_ << " (execution #"
     << exec_ << " on communicator " << std::hex << comm_ << std::dec
     << ", low-latency path); reported by rank " << rank_ << " (partition " << partition_
     << ", device " << device_ << ", process " << f_->job_proc(f_->proc()) << ")";
  const std::string where = f_->ranks_where(missing, member_parts_, device_ids_);
  if (!where.empty()) os << "; where the missing run: " << where;
  std::string dead = f_->dead_peers();
  if (!dead.empty()) os << "; process(es) " << dead << " disconnected (exited or killed)";
  if (std::strcmp(phase, "reuse") == 0)
    os << ". These peers never finished reading an earlier call of this rank.";
  else if (std::strcmp(phase, "depart") == 0)
    os << ". These peers never finished this collective.";
  else
    os << ". A peer never reached this collective: check that every device executes the same "
          "sequence of collectives, or raise strata_jax.set_timeout()."
       << f_->across_fabrics_hint();
  return os.str();
}

}  // namespace strata
