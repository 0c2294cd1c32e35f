// Rendezvous in the control segment, the ShmTeam, and the buffers of a call (its own ones that
// peers read directly, share_direct; the bounce buffers) of the shared-memory fabric (see
// shm.h). Sockets and registration are in shm_link.cc.
#include "fabric/shm.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "coll/kernels.h"
#include "common/settings.h"
#include "fabric/stats.h"

namespace strata {

std::atomic<ShmFabric*> ShmFabric::active_{nullptr};

const char* reg_mode_name(RegMode m) {
  switch (m) {
    case RegMode::kOnAlloc:
      return "on_alloc";
    case RegMode::kOnUse:
      return "on_use";
    case RegMode::kStaging:
      return "staging";
  }
  return "?";
}

ShmFabric& ShmFabric::instance() {
  static ShmFabric* f = new ShmFabric();  // never destroyed: XLA and allocator threads outlive exit
  return *f;
}

namespace {

// More processes than cores: a waiter that spins or yields long holds a core the rank it
// waits for needs (4 processes on 2 cores: 4 KiB psum 497 us median spinning 2000 rounds, 195
// us going to the futex at once), but a short spin and a few yields still catch the rank about
// to arrive: 64 pauses and 4 yields took, in two series of three alternated runs under mpirun
// (4 processes, 256 KiB-4 MiB and 4 KiB-16 MiB, every operator), XLA over MPI's time over
// strata's from a median point of 2.43x to 2.58x and of 1.46x to 1.60x against the futex at
// once (no point below 1.0x with either). Otherwise 64 pauses and 16 yields, as the in-process
// fabric does.
bool oversubscribed() {
  const ShmFabric* f = ShmFabric::active();
  return f && f->nprocs() > static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
}
int wait_spins() {
  static const int v = env_count("STRATA_SHM_SPINS", 64);
  return v;
}
int wait_yields() {
  static const int v = env_count("STRATA_SHM_YIELDS", oversubscribed() ? 4 : 16);
  return v;
}

constexpr size_t kAlign = 64;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

int barrier_group(int configured, int size) {
  int g = configured;
  if (g <= 0) {
    if (size <= 64) return size;
    g = 1;
    while (g * g < size) ++g;  // ceil(sqrt(size))
  }
  const int fewest = (size + kShmBarrierGroups - 1) / kShmBarrierGroups;  // counters suffice
  return std::max(g, fewest);
}

uint64_t slot_tag(uint64_t comm, uint64_t exec, uint64_t op, uint64_t occ) {
  uint64_t h = comm * 0x9E3779B97F4A7C15ull;
  h ^= exec + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
  h ^= op + 0x94D049BB133111EBull + (h << 6) + (h >> 2);
  h ^= occ + (h << 6) + (h >> 2);
  return h | 1;  // 0 marks a free slot
}

char* ShmFabric::ll_region() const {
  return reinterpret_cast<char*>(ctl_) +
         ShmControl::control_bytes(static_cast<int>(ctl_->max_ranks));
}

ShmFabric::CallSeq ShmFabric::next_seq(const Placement& pl, int64_t run_id, int64_t op_id) {
  std::lock_guard<std::mutex> lock(seq_mu_);
  CommState& st = seqs_[{pl.device, pl.comm}];
  if (st.execs == 0 || st.last_run != run_id) {  // the first call of a new execution
    st.last_run = run_id;
    ++st.execs;
    st.occ.clear();
  }
  return CallSeq{st.execs - 1, static_cast<uint64_t>(op_id), st.occ[op_id]++};
}

std::unique_ptr<ShmTeam> ShmFabric::join(const Placement& pl, int64_t run_id, int64_t op_id,
                                         const char* op_name, std::string* err) {
  if (pl.size > max_ranks()) {  // a group larger than the fabric's devices: cannot happen
    *err = std::string("strata_jax ") + op_name + ": a group of " + std::to_string(pl.size) +
           " ranks inside a shared-memory fabric of " + std::to_string(max_ranks()) +
           " devices (internal error: the group must span fabrics)";
    return nullptr;
  }
  const CallSeq seq = next_seq(pl, run_id, op_id);
  const uint64_t tag = slot_tag(pl.comm, seq.exec, seq.op, seq.occ);
  ShmSlot* slot = nullptr;
  {
    CtlLock lock(&ctl_->mu);
    ShmSlot* free_slot = nullptr;
    for (int i = 0; i < kShmSlots; ++i) {
      ShmSlot& s = *ctl_->slot(i);
      if (s.tag == tag && s.comm == pl.comm && s.exec == seq.exec && s.op == seq.op &&
          s.occ == seq.occ) {
        slot = &s;
        break;
      }
      if (!free_slot && s.tag == 0) free_slot = &s;
    }
    if (!slot && free_slot) {
      slot = free_slot;
      slot->comm = pl.comm;
      slot->exec = seq.exec;
      slot->op = seq.op;
      slot->occ = seq.occ;
      slot->group = pl.group;
      slot->size = pl.size;
      // Nobody else can reach the slot before the tag is set under the lock: relaxed is enough;
      // the mutex orders these stores before any later joiner's loads.
      slot->arrivals.store(0, std::memory_order_relaxed);
      slot->leaving.store(0, std::memory_order_relaxed);
      slot->failed.store(0, std::memory_order_relaxed);
      slot->failure[0] = 0;
      for (int j = 0; j < pl.size; ++j) slot->peer(j).reached.store(0, std::memory_order_relaxed);
      const int g = barrier_group(static_cast<int>(ctl_->barrier_group), pl.size);
      if (g < pl.size)
        for (int i = 0; i * g < pl.size; ++i)
          slot->groups[i].arrivals.store(0, std::memory_order_relaxed);
      slot->tag = tag;
    }
  }
  if (!slot) {
    *err = std::string("strata_jax ") + op_name + ": all " + std::to_string(kShmSlots) +
           " rendezvous slots of the shared-memory fabric are in use (collectives that failed "
           "and were never completed by every rank keep theirs); restart the processes";
    return nullptr;
  }
  if (slot->size != pl.size) {
    *err = std::string("strata_jax ") + op_name + ": ranks disagree on the group size (" +
           std::to_string(slot->size) + " vs " + std::to_string(pl.size) + ")";
    leave(slot);
    return nullptr;
  }
  return std::make_unique<ShmTeam>(this, slot, pl, op_name);
}

void ShmFabric::leave(ShmSlot* slot) {
  // acq_rel: everything this rank did with the slot happens before the last leaver frees it.
  if (slot->leaving.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(slot->size)) {
    CtlLock lock(&ctl_->mu);
    slot->tag = 0;
  }
}

// ---- direct buffers and bounce buffers ----

std::string ShmFabric::share_direct(const void* in, uint64_t in_bytes, const void* out,
                                    uint64_t out_bytes, DirectBuffers* d) {
  const auto& api = alloc();
  const bool staging = mode_ == RegMode::kStaging;
  d->in_ok = in_bytes == 0 || (!staging && api.lookup && api.lookup(in, in_bytes, &d->in));
  d->out_ok = out_bytes == 0 || (!staging && api.lookup && api.lookup(out, out_bytes, &d->out));
  std::string err;
  if (d->in_ok && in_bytes) err = export_segment(d->in.segment_id, d->in.fd, d->in.size, true);
  if (err.empty() && d->out_ok && out_bytes && !(in_bytes && d->in.segment_id == d->out.segment_id))
    err = export_segment(d->out.segment_id, d->out.fd, d->out.size, true);
  return err;
}

Bounce* ShmFabric::acquire_bounce(size_t bytes, bool critical, std::string* err) {
  std::lock_guard<std::mutex> lock(bounce_mu_);
  Bounce* best = nullptr;
  for (auto& b : bounces_)
    if (!b->busy && b->size >= bytes && (!best || b->size < best->size)) best = b.get();
  if (best) {
    best->busy = true;
    return best;
  }
  // A new one (the first is made at connect time, off the critical path): whole 2 MiB units.
  size_t size = bytes < (size_t{4} << 20) ? (size_t{4} << 20)
                                          : (bytes + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
  int fd = static_cast<int>(syscall(SYS_memfd_create, "strata_bounce", MFD_CLOEXEC));
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    const int e = errno;
    *err = std::string("cannot create a bounce buffer: ") + strerror(e);
    if (e == EMFILE || e == ENFILE)
      *err +=
          " (RLIMIT_NOFILE, the process's limit of open files, is reached: raise it with "
          "`ulimit -n` before starting the job)";
    return nullptr;
  }
  // A bounce buffer made for a call is faulted in whole (the call copies through it now); the
  // one made at connect time (bytes 0) only its first 256 KiB: faulting in all 4 MiB cost every
  // process 4 MiB whether it ever staged or not (64 processes: 256 MiB of the host).
  void* base =
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | (bytes ? MAP_POPULATE : 0), fd, 0);
#ifdef MADV_POPULATE_WRITE
  if (base != MAP_FAILED && !bytes) madvise(base, size_t{256} << 10, MADV_POPULATE_WRITE);
#endif
  if (base == MAP_FAILED) {
    close(fd);
    *err = std::string("cannot map a bounce buffer: ") + strerror(errno);
    return nullptr;
  }
  auto b = std::make_unique<Bounce>(
      Bounce{kBounceIdBit | next_bounce_id_++, fd, static_cast<char*>(base), size, true});
  *err = export_segment(b->id, fd, size, critical);
  if (!err->empty()) {
    munmap(base, size);
    close(fd);
    return nullptr;
  }
  stats().bounce_bytes.fetch_add(size, std::memory_order_relaxed);
  bounces_.push_back(std::move(b));
  return bounces_.back().get();
}

void ShmFabric::release_bounce(Bounce* b) {
  std::lock_guard<std::mutex> lock(bounce_mu_);
  b->busy = false;
}

// ---- the team ----

ShmTeam::ShmTeam(ShmFabric* f, ShmSlot* slot, const Placement& pl, const char* op_name)
    : SeatedTeam(pl, op_name),
      f_(f),
      slot_(slot),
      in_(pl.size, nullptr),
      out_(pl.size, nullptr),
      bufs_(static_cast<size_t>(pl.size) * kMaxBufs, nullptr) {}

ShmTeam::~ShmTeam() {
  // A bounce buffer is reused only when every peer is known to be done with it; after a failed
  // barrier a peer might still write into it, so it stays busy (leaked) instead.
  if (bounce_ && release_bounce_) f_->release_bounce(bounce_);
  f_->leave(slot_);
}

std::string ShmTeam::fail(const std::string& msg) {
  uint32_t expected = 0;
  // acq_rel CAS: one writer of the message; the release store of 2 publishes it.
  if (slot_->failed.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    std::strncpy(slot_->failure, msg.c_str(), sizeof(slot_->failure) - 1);
    slot_->failure[sizeof(slot_->failure) - 1] = 0;
    slot_->failed.store(2, std::memory_order_release);
  }
  futex_wake_all(&slot_->arrivals, true);
  for (int i = 0; i < 100000 && slot_->failed.load(std::memory_order_acquire) != 2; ++i)
    sched_yield();  // the winner is between its two stores
  return std::string(slot_->failure);
}

std::string ShmTeam::barrier(const char* phase) {
  ++barriers_;
  stats().rendezvous_steps.fetch_add(1, std::memory_order_relaxed);
  slot_->peer(rank_).reached.store(barriers_, std::memory_order_release);
  const uint32_t target = barriers_ * static_cast<uint32_t>(size_);
  if (barriers_ == 1) {
    const int g = barrier_group(static_cast<int>(f_->control()->barrier_group), size_);
    if (g < size_) {
      barrier_group_ = g;
      group_first_ = rank_ / g * g;
      group_members_ = std::min(g, size_ - group_first_);
    }
  }
  // acq_rel: release publishes this rank's descriptor and writes before the barrier; the
  // acquire side (here and in the waiters' loads) makes the peers' ones visible after it.
  // Two levels: the group's counter first. Its last rank's acq_rel add there reads every
  // member's release (an RMW chain), and its acq_rel add of the group's count to the slot's
  // counter releases them with its own writes: a waiter's acquire of the slot's counter sees
  // all of them, as with one counter.
  uint32_t now = 0;
  if (group_members_ == 0) {
    now = slot_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
  } else {
    const uint32_t members = static_cast<uint32_t>(group_members_);
    ShmGroupCount& group = slot_->groups[group_first_ / barrier_group_];
    const uint32_t in_group = group.arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (in_group == barriers_ * members)  // the group's last rank of this barrier
      now = slot_->arrivals.fetch_add(members, std::memory_order_acq_rel) + members;
  }
  if (now == target) {
    futex_wake_all(&slot_->arrivals, true);
    return {};
  }
  auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  bool ok = wait_until(
      &slot_->arrivals, [&] { return slot_->arrivals.load(std::memory_order_acquire) >= target; },
      [&] {
        if (slot_->failed.load(std::memory_order_acquire) != 0) return true;
        // A missing rank whose process disconnected (exited or was killed) never comes: fail
        // now instead of at the timeout (the receiver thread sees the link close at once).
        std::string dead = dead_members();
        if (!dead.empty()) {
          fail(std::string("strata_jax ") + op_name_ + ": " + dead + " in phase '" + phase +
               "' (group of " + std::to_string(size_) + "; reported by rank " +
               std::to_string(rank_) + ", process " + std::to_string(f_->job_proc(f_->proc())) +
               "). The job cannot complete this collective.");
          return true;
        }
        // Arrival: a rank that already published a different op fails the call now, not at
        // the timeout (the ranks still missing may never come).
        if (arriving_) {
          std::string m = check_peers(*arriving_);
          if (!m.empty()) {
            fail(m);
            return true;
          }
        }
        return false;
      },
      deadline, /*shared=*/true, wait_spins(), wait_yields());
  if (ok) return {};
  if (slot_->failed.load(std::memory_order_acquire) != 0) return fail("");
  std::vector<int> missing;
  for (int j = 0; j < size_; ++j)
    if (slot_->peer(j).reached.load(std::memory_order_acquire) < barriers_) missing.push_back(j);
  std::ostringstream os;
  os << timed_out_waiting(op_name_, phase, missing) << " of a group of " << size_ << " (execution #"
     << slot_->exec << " on communicator " << std::hex << slot_->comm << std::dec
     << "); reported by rank " << rank_ << " (partition " << partition_ << ", device " << device_
     << ", process " << f_->job_proc(f_->proc()) << ")";
  const std::string where = f_->ranks_where(missing, member_parts_, device_ids_);
  if (!where.empty()) os << "; where the missing run: " << where;
  std::string dead = f_->dead_peers();
  if (!dead.empty()) os << "; process(es) " << dead << " disconnected (exited or killed)";
  os << ". A peer never reached this collective: check that every device executes the same "
        "sequence of collectives, or raise strata_jax.set_timeout()."
     << f_->across_fabrics_hint();
  return fail(os.str());
}

std::string ShmTeam::dead_members() const {
  if (!member_parts_ || !device_ids_) return {};
  std::vector<int> dead;  // allocates only when a rank is dead: this runs while waiting
  for (int j = 0; j < size_; ++j) {
    if (slot_->peer(j).reached.load(std::memory_order_acquire) >= barriers_) continue;
    const int p = f_->device_proc(device_ids_[member_parts_[j]]);
    if (p >= 0 && p != f_->proc() && !f_->peer_alive(p)) dead.push_back(j);
  }
  if (dead.empty()) return {};
  return f_->ranks_where(dead, member_parts_, device_ids_) +
         " exited or was killed before reaching this collective";
}

std::string ShmTeam::arrival_barrier(const OpDesc& desc) {
  // The arriving rank itself compares first: the later of two disagreeing ranks fails the
  // slot before it waits, and fail() wakes every waiter.
  std::string err = check_peers(desc);
  if (!err.empty()) {
    stats().mismatches.fetch_add(1, std::memory_order_relaxed);
    fail(err);
  }
  arriving_ = &desc;
  err = barrier("arrive");
  arriving_ = nullptr;
  if (!err.empty()) return err;  // a peer may still come and touch the bounce: keep it busy
  release_bounce_ = true;
  err = check_peers(desc);
  if (!err.empty()) return fail(err);  // every rank sees the same descriptors and fails here
  release_bounce_ = false;             // from here on a peer may already be using it
  descs_.assign(size_, desc);
  local_ranks_ = 0;
  for (int j = 0; j < size_; ++j) {
    descs_[j].algo = slot_->peer(j).algo;
    if (slot_->peer(j).proc == f_->proc()) ++local_ranks_;
  }
  return {};
}

void ShmTeam::publish_desc(const OpDesc& desc) {
  ShmPeer& me = slot_->peer(rank_);
  me.proc = f_->proc();
  me.device = device_;
  std::strncpy(me.name, desc.name ? desc.name : "", sizeof(me.name) - 1);
  me.name[sizeof(me.name) - 1] = 0;
  me.kind = desc.kind;
  me.dtype = desc.dtype;
  me.reduce = desc.reduce;
  me.params = desc.params.digest();
  me.algo = desc.algo;
  me.in_bytes = desc.in_bytes;
  me.out_bytes = desc.out_bytes;
  // Published to peers by the release store of `reached` in barrier("arrive").
}

std::string ShmTeam::check_peers(const OpDesc& desc) const {
  bool differ = false;
  for (int j = 0; j < size_ && !differ; ++j) {
    const ShmPeer& o = slot_->peer(j);
    if (j == rank_ || o.reached.load(std::memory_order_acquire) < 1) continue;  // not yet here
    differ = o.kind != desc.kind || o.dtype != desc.dtype || o.reduce != desc.reduce ||
             o.params != desc.params.digest() || o.in_bytes != desc.in_bytes ||
             o.out_bytes != desc.out_bytes;
  }
  if (!differ) return {};
  // The parameters' digests are shown only when they are part of the disagreement.
  bool params_differ = false;
  for (int j = 0; j < size_; ++j) {
    const ShmPeer& o = slot_->peer(j);
    if (j != rank_ && o.reached.load(std::memory_order_acquire) >= 1)
      params_differ |= o.params != desc.params.digest();
  }
  auto describe = [params_differ](std::ostringstream& os, int j, const ShmPeer& o) {
    const int es = dtype_size(o.dtype);
    os << "rank " << j << " (device " << o.device << "): " << o.name << " " << dtype_name(o.dtype)
       << "[" << (es ? o.in_bytes / es : 0) << "] (" << o.in_bytes << " B in, " << o.out_bytes
       << " B out";
    if (params_differ) os << ", parameters " << std::hex << o.params << std::dec;
    os << ")";
  };
  std::ostringstream os;
  os << "strata_jax " << op_name_ << ": ranks disagree on a collective call (execution #"
     << slot_->exec << " on their communicator, op " << slot_->op << ", occurrence " << slot_->occ
     << ", group of " << size_ << "): ";
  int shown = 0;
  for (int j = 0; j < size_; ++j) {
    const ShmPeer& o = slot_->peer(j);
    if (j != rank_ && o.reached.load(std::memory_order_acquire) < 1) continue;
    if (shown == 8) {
      os << "; ...";
      break;
    }
    if (shown++) os << "; ";
    describe(os, j, o);
  }
  os << ". Every rank of a group must make the same sequence of collective calls with the same "
        "op, shape, dtype and parameters (e.g. ppermute's permutation, hashed, or pbroadcast's "
        "root).";
  return os.str();
}

std::string ShmTeam::arrive(const OpDesc& desc, const void* in, void* out) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  // Which of my buffers peers can reach directly (exported if need be).
  ShmFabric::DirectBuffers direct;
  std::string err = f_->share_direct(in, desc.in_bytes, out, desc.out_bytes, &direct);
  if (!err.empty()) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
  const bool in_ok = direct.in_ok, out_ok = direct.out_ok;
  const strata_seg_info &in_seg = direct.in, &out_seg = direct.out;

  publish_desc(desc);
  ShmPeer& me = slot_->peer(rank_);
  me.in_seg = me.out_seg = 0;
  me.in_off = me.out_off = 0;
  me.in_ptr = reinterpret_cast<uintptr_t>(in);
  me.out_ptr = reinterpret_cast<uintptr_t>(out);
  if (in_ok && desc.in_bytes) {
    me.in_seg = in_seg.segment_id;
    me.in_off = in_seg.offset;
  }
  if (out_ok && desc.out_bytes) {
    me.out_seg = out_seg.segment_id;
    me.out_off = out_seg.offset;
  }
  if (!in_ok || !out_ok) {
    // Staging: the unshareable buffer(s) go through a bounce buffer every peer has mapped.
    const size_t in_room = in_ok ? 0 : align_up(desc.in_bytes);
    bounce_ = f_->acquire_bounce(in_room + (out_ok ? 0 : desc.out_bytes), true, &err);
    if (!bounce_) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    any_staged_ = true;
    stats().staged_calls.fetch_add(1, std::memory_order_relaxed);
    if (!in_ok) {
      copy_bytes(bounce_->base, in, desc.in_bytes);
      stats().staged_bytes.fetch_add(desc.in_bytes, std::memory_order_relaxed);
      me.in_seg = bounce_->id;
      me.in_off = 0;
      me.in_ptr = reinterpret_cast<uintptr_t>(bounce_->base);
    }
    if (!out_ok) {
      out_staged_ = true;
      user_out_ = out;
      out_bytes_ = desc.out_bytes;
      me.out_seg = bounce_->id;
      me.out_off = in_room;
      me.out_ptr = reinterpret_cast<uintptr_t>(bounce_->base + in_room);
    }
  }
  err = arrival_barrier(desc);
  if (!err.empty()) return err;
  for (int j = 0; j < size_; ++j) {
    const ShmPeer& o = slot_->peer(j);
    if ((o.in_seg | o.out_seg) & kBounceIdBit) any_staged_ = true;
    if (o.proc == f_->proc()) {
      in_[j] = reinterpret_cast<const void*>(o.in_ptr);
      out_[j] = reinterpret_cast<void*>(o.out_ptr);
      continue;
    }
    if (o.in_bytes) {
      in_[j] = f_->translate(o.proc, o.in_seg, o.in_off, o.in_bytes, deadline, &err);
      if (!in_[j]) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    }
    if (o.out_bytes) {
      out_[j] = f_->translate(o.proc, o.out_seg, o.out_off, o.out_bytes, deadline, &err);
      if (!out_[j]) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    }
  }
  arrived_ = true;
  release_bounce_ = true;
  return {};
}

std::string ShmTeam::arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs) {
  if (nbufs > kMaxBufs)
    return fail(std::string("strata_jax ") + op_name_ + ": internal error: too many buffers");
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  const auto& api = ShmFabric::alloc();
  const bool staging = f_->mode() == RegMode::kStaging;
  // As in arrive(): a buffer inside an allocator segment is shared as it is (its segment
  // exported if needed); any other is staged at its offset in one bounce buffer.
  strata_seg_info seg[kMaxBufs] = {};
  bool ok[kMaxBufs] = {};
  uint64_t stage_off[kMaxBufs] = {};
  size_t room = 0;
  std::string err;
  for (int i = 0; i < nbufs; ++i) {
    const BufRef& b = bufs[i];
    ok[i] = b.bytes == 0 || (!staging && api.lookup && api.lookup(b.ptr, b.bytes, &seg[i]));
    if (ok[i] && b.bytes && err.empty())
      err = f_->export_segment(seg[i].segment_id, seg[i].fd, seg[i].size, true);
    if (!ok[i]) {
      stage_off[i] = room;
      room += align_up(b.bytes);
    }
  }
  if (!err.empty()) return fail(std::string("strata_jax ") + op_name_ + ": " + err);

  publish_desc(desc);  // in/out bytes are compared by check_peers; in/out are not published
  ShmPeer& me = slot_->peer(rank_);
  me.in_seg = me.out_seg = me.in_off = me.out_off = me.in_ptr = me.out_ptr = 0;
  if (room) {
    bounce_ = f_->acquire_bounce(room, true, &err);
    if (!bounce_) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    any_staged_ = true;
    stats().staged_calls.fetch_add(1, std::memory_order_relaxed);
  }
  for (int i = 0; i < kMaxBufs; ++i) {
    const bool used = i < nbufs && bufs[i].bytes;
    me.buf_bytes[i] = used ? bufs[i].bytes : 0;
    me.buf_seg[i] = me.buf_off[i] = me.buf_ptr[i] = 0;
    if (!used) continue;
    const BufRef& b = bufs[i];
    if (ok[i]) {
      me.buf_seg[i] = seg[i].segment_id;
      me.buf_off[i] = seg[i].offset;
      me.buf_ptr[i] = reinterpret_cast<uintptr_t>(b.ptr);
      continue;
    }
    char* staged = bounce_->base + stage_off[i];
    if (b.written) {
      copy_back_.push_back(CopyBack{const_cast<void*>(b.ptr), stage_off[i], b.bytes});
    } else {
      copy_bytes(staged, b.ptr, b.bytes);
    }
    stats().staged_bytes.fetch_add(b.bytes, std::memory_order_relaxed);
    me.buf_seg[i] = bounce_->id;
    me.buf_off[i] = stage_off[i];
    me.buf_ptr[i] = reinterpret_cast<uintptr_t>(staged);
  }
  // The barrier's fetch_add(acq_rel) publishes the fields above and the staged copies.
  err = arrival_barrier(desc);
  if (!err.empty()) return err;
  for (int j = 0; j < size_; ++j) {
    const ShmPeer& o = slot_->peer(j);
    for (int i = 0; i < kMaxBufs; ++i) {
      if (!o.buf_bytes[i]) continue;
      if (o.buf_seg[i] & kBounceIdBit) any_staged_ = true;
      const void*& dst = bufs_[static_cast<size_t>(j) * kMaxBufs + i];
      if (o.proc == f_->proc()) {
        dst = reinterpret_cast<const void*>(o.buf_ptr[i]);
        continue;
      }
      dst = f_->translate(o.proc, o.buf_seg[i], o.buf_off[i], o.buf_bytes[i], deadline, &err);
      if (!dst) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    }
  }
  arrived_ = true;
  release_bounce_ = true;
  return {};
}

namespace {
// One entry of arrive_list's table of buffers (in the publishing rank's bounce buffer).
struct ListEntry {
  uint64_t seg, off, ptr;  // seg 0: an empty buffer
};
}  // namespace

std::string ShmTeam::arrive_list(const OpDesc& desc, const OperandRef* ops, int nops) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  const auto& api = ShmFabric::alloc();
  const bool staging = f_->mode() == RegMode::kStaging;
  // Buffer i is operand i / 2's input (i even) or output (i odd).
  const int nb = 2 * nops;
  auto buf_of = [&](int i) -> std::pair<const void*, uint64_t> {
    const OperandRef& o = ops[i / 2];
    return (i & 1) ? std::make_pair(static_cast<const void*>(o.out), o.out_bytes)
                   : std::make_pair(o.in, o.in_bytes);
  };
  std::vector<ListEntry> table(nb);
  constexpr uint64_t kShared = ~uint64_t{0};
  std::vector<uint64_t> stage_off(nb, kShared);
  const size_t table_bytes = static_cast<size_t>(nb) * sizeof(ListEntry);
  size_t room = align_up(table_bytes);
  uint64_t last_exported = 0;
  std::string err;
  for (int i = 0; i < nb; ++i) {
    auto [p, bytes] = buf_of(i);
    table[i] = ListEntry{0, 0, reinterpret_cast<uintptr_t>(p)};
    if (!bytes) continue;
    strata_seg_info seg{};
    if (!staging && api.lookup && api.lookup(p, bytes, &seg)) {
      if (seg.segment_id != last_exported && err.empty()) {
        err = f_->export_segment(seg.segment_id, seg.fd, seg.size, true);
        last_exported = seg.segment_id;
      }
      table[i].seg = seg.segment_id;
      table[i].off = seg.offset;
    } else {
      stage_off[i] = room;
      room += align_up(bytes);
    }
  }
  if (!err.empty()) return fail(std::string("strata_jax ") + op_name_ + ": " + err);

  publish_desc(desc);
  ShmPeer& me = slot_->peer(rank_);
  me.in_seg = me.out_seg = me.in_off = me.out_off = me.in_ptr = me.out_ptr = 0;
  bounce_ = f_->acquire_bounce(room, true, &err);
  if (!bounce_) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
  bool staged = false;
  for (int i = 0; i < nb; ++i) {
    if (stage_off[i] == kShared) continue;
    auto [p, bytes] = buf_of(i);
    char* at = bounce_->base + stage_off[i];
    table[i] = ListEntry{bounce_->id, stage_off[i], reinterpret_cast<uintptr_t>(at)};
    if (i & 1) {
      copy_back_.push_back(CopyBack{const_cast<void*>(p), stage_off[i], bytes});
    } else {
      copy_bytes(at, p, bytes);
    }
    stats().staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
    staged = true;
  }
  if (staged) {
    any_staged_ = true;
    stats().staged_calls.fetch_add(1, std::memory_order_relaxed);
  }
  if (table_bytes) std::memcpy(bounce_->base, table.data(), table_bytes);
  copy_fence();  // the staged copies' non-temporal stores, before the barrier's release
  for (int i = 0; i < kMaxBufs; ++i)
    me.buf_seg[i] = me.buf_off[i] = me.buf_ptr[i] = me.buf_bytes[i] = 0;
  me.buf_seg[0] = bounce_->id;
  me.buf_ptr[0] = reinterpret_cast<uintptr_t>(bounce_->base);
  me.buf_bytes[0] = table_bytes;
  // The barrier's fetch_add(acq_rel) publishes the fields, the table and the staged copies.
  err = arrival_barrier(desc);
  if (!err.empty()) return err;
  nops_ = nops;
  in_list_.assign(static_cast<size_t>(size_) * nops, nullptr);
  out_list_.assign(static_cast<size_t>(size_) * nops, nullptr);
  for (int j = 0; j < size_; ++j) {
    const ShmPeer& o = slot_->peer(j);
    const bool local = o.proc == f_->proc();
    const ListEntry* tab = nullptr;
    if (local) {
      tab = reinterpret_cast<const ListEntry*>(o.buf_ptr[0]);
    } else if (table_bytes) {
      tab = reinterpret_cast<const ListEntry*>(
          f_->translate(o.proc, o.buf_seg[0], o.buf_off[0], table_bytes, deadline, &err));
      if (!tab) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
    }
    for (int i = 0; i < nb; ++i) {
      // Every rank's operands have this rank's sizes: the descriptors' signature agrees.
      const uint64_t bytes = buf_of(i).second;
      if (!bytes) continue;
      const ListEntry e = tab[i];
      if (e.seg & kBounceIdBit) any_staged_ = true;
      char* p = local ? reinterpret_cast<char*>(e.ptr)
                      : f_->translate(o.proc, e.seg, e.off, bytes, deadline, &err);
      if (!p) return fail(std::string("strata_jax ") + op_name_ + ": " + err);
      const size_t at = static_cast<size_t>(j) * nops + i / 2;
      if (i & 1) {
        out_list_[at] = p;
      } else {
        in_list_[at] = p;
      }
    }
  }
  arrived_ = true;
  release_bounce_ = true;
  return {};
}

std::string ShmTeam::depart() {
  if (!arrived_) return {};
  std::string err = barrier("depart");
  if (!err.empty()) {
    release_bounce_ = false;
    return err;
  }
  if (out_staged_) {
    copy_bytes(user_out_, bounce_->base + (slot_->peer(rank_).out_off), out_bytes_);
    stats().staged_bytes.fetch_add(out_bytes_, std::memory_order_relaxed);
  }
  // After the final barrier no peer reads this rank's staged buffers any more.
  for (const CopyBack& c : copy_back_) copy_bytes(c.dst, bounce_->base + c.off, c.bytes);
  return {};
}

}  // namespace strata
