// The shared-memory fabric: one or more JAX CPU devices per process, several processes on one
// host. Ranks of one collective may live in different processes; each rank publishes where its
// buffers are as (segment id, offset) and peers translate that into an address of their own
// through a table of mapped peer segments.
//
// Pieces (NCCL keeps transport, registration and algorithms in separate rooms; so do we):
//  - Links (shm_link.cc): a full mesh of unix SOCK_SEQPACKET connections, bootstrapped from
//    socket paths exchanged through the jax.distributed key-value store. They carry memfd file
//    descriptors (SCM_RIGHTS) and nothing else; the sockets' paths are unlinked as soon as every
//    process is connected, so nothing is left in the file system even after SIGKILL.
//  - Registration (shm_link.cc): "export" = send a segment's fd to every peer; the peer's
//    receiver thread maps it MAP_SHARED and records (process, segment id) -> local address.
//    In on_alloc mode the allocator's background thread exports every new segment (off the
//    critical path); in on_use mode a collective exports its buffers' segments the first time it
//    meets them (on the critical path, counted); in staging mode buffers are never exported.
//  - The control segment (shm.cc): a memfd made by process 0 and mapped by all, holding the
//    rendezvous slots: one per call in flight, keyed by what every process agrees on without
//    sharing a program (NCCL and gloo match calls by communicator and sequence number):
//      (communicator, execution number on it, op index in the program, occurrence).
//    The communicator is the group's members' global device ids in rank order (hashed:
//    Placement::comm). The execution number counts, per (device, communicator), the
//    executions that called it; the op index is the call's position among the strata calls
//    of the lowered module (collectives.py: next_op_id), and the occurrence counts the call's
//    executions inside this execution (loops). XLA's RunId cannot key calls across
//    processes: it derives from the executable's fingerprint, which includes source locations,
//    so one jitted function called from two call sites gets two run ids.
//    Why not a plain per-call sequence number: measured with InFlight (fabric/inflight.h) on
//    8 in-process devices, XLA CPU runs independent strata calls of ONE execution at once on
//    a device (2 in flight: psum(v) + pmax(2v) + ... in one program), so their start order
//    differs between devices and a per-call counter would pair psum(v) with psum(sin v).
//    Executions never overlap on a device (XLA CPU launches a multi-device program only after
//    the previous one ended on every device of the process; measured: at most 1 run in flight
//    per device over 1000 chained calls of 4 programs dispatched ahead), so counting
//    executions is well defined; a call that overlaps another execution's call on its device
//    fails loudly instead of risking a wrong pairing (ffi/common.h).
//    At arrival every rank publishes its descriptor (op, dtype, bytes, reduce, a digest of its
//    parameters) and compares it with those already published: the first rank to see a disagreement
//    fails the slot naming every rank's op, dtype and size, and waiting ranks see the failure flag
//    at once (never the timeout). Out of scope, by nature: an extra identical execution on one rank
//    pairs with its peers' next identical one (NCCL and gloo behave the same).
//  - The low-latency path (shm_ll.h): calls of at most STRATA_LL_BYTES per rank skip the slot
//    and both barriers; the data travels with its key through per-rank slot rings in the region
//    after the control block, under the same keys and with the same checks.
//  - Staging (shm.cc): a buffer the allocator does not own (below its threshold, allocator not
//    preloaded) or every buffer in staging mode is copied through a bounce buffer of this
//    process that every peer mapped when it was created.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "alloc/strata_alloc.h"
#include "common/env.h"
#include "fabric/team.h"
#include "sync/wait.h"

namespace strata {

// Holds the control segment's robust process-shared mutex (shm.cc, shm_ll.cc). A process killed
// while holding it leaves it EOWNERDEAD: the tables under it only ever change in single stores
// that leave them consistent, so the next owner marks it consistent and goes on.
class CtlLock {
 public:
  explicit CtlLock(pthread_mutex_t* mu) : mu_(mu) {
    if (pthread_mutex_lock(mu_) == EOWNERDEAD) pthread_mutex_consistent(mu_);
  }
  ~CtlLock() { pthread_mutex_unlock(mu_); }
  CtlLock(const CtlLock&) = delete;
  CtlLock& operator=(const CtlLock&) = delete;

 private:
  pthread_mutex_t* mu_;
};

enum class RegMode : int32_t { kOnAlloc = 0, kOnUse = 1, kStaging = 2 };
const char* reg_mode_name(RegMode m);

// No fixed cap on a group: the rendezvous slots' rank entries are sized when the fabric connects,
// for the largest group it can hold (its devices; ShmControl::max_ranks), so a group of any size
// the host holds meets in one slot (the unit test runs 1024 ranks: tests/native/shm_many_ranks.cc).
constexpr int kShmSlots = 256;
constexpr uint64_t kShmMagic = 0x5354524154413031ull;  // "STRATA01"
// Segment ids of the fabric's own bounce buffers (allocator ids start at 1 and stay small).
constexpr uint64_t kBounceIdBit = uint64_t{1} << 62;

// One rank's entry in a rendezvous slot. Plain fields are written by the rank before its
// arrival barrier; the barrier's fetch_add(acq_rel) on the slot's `arrivals` publishes them and
// the waiters' acquire loads make them visible to every process.
struct ShmPeer {
  int32_t proc;  // process index of the rank
  int32_t kind, dtype, reduce;
  uint64_t params;  // OpParams::digest() of the call
  uint64_t in_bytes, out_bytes;
  uint64_t in_seg, in_off, out_seg, out_off;  // where peers find the buffers (seg 0: none)
  uint64_t in_ptr, out_ptr;                   // the same, as addresses in the owner process
  // arrive_multi's buffers, published like in/out (bytes 0: not published).
  uint64_t buf_seg[kMaxBufs], buf_off[kMaxBufs], buf_ptr[kMaxBufs], buf_bytes[kMaxBufs];
  // Barriers this rank entered (release), read by the timeout path to name missing ranks.
  std::atomic<uint32_t> reached;
  int32_t algo;    // the rank's algorithm proposal (OpDesc::algo); everyone follows rank 0's
  int64_t device;  // the rank's global device id (for messages)
  char name[32];   // the rank's op name (for messages)
};

// Groups of the two-level barrier a slot has counters for (barrier_group()); each counter on a
// cache line of its own.
constexpr int kShmBarrierGroups = 64;
struct alignas(64) ShmGroupCount {
  // Barrier entries of the group's ranks, all barriers of the call together (acq_rel adds).
  std::atomic<uint32_t> arrivals;
};

// A rendezvous slot: this header, then `ShmControl::max_ranks` ShmPeer entries (peer(j)).
struct alignas(64) ShmSlot {
  // Key and size: written under the control mutex when the slot is claimed, read under it.
  uint64_t tag;            // 0: free
  uint64_t comm;           // the key: communicator hash,
  uint64_t exec, op, occ;  // execution number on it, op index, occurrence
  int64_t group;           // the group's index in the first joiner's program (for messages)
  int32_t size;
  // Total barrier entries of all ranks (barrier k complete at k * size); futex word.
  std::atomic<uint32_t> arrivals;
  std::atomic<uint32_t> leaving;  // ranks done with the call; the last frees the slot
  // 0 ok; 1 a rank is writing `failure`; 2 failure written (release) and readable (acquire).
  std::atomic<uint32_t> failed;
  char failure[768];
  // The two-level barrier's group counters (barrier_group(); reset when the slot is claimed for
  // a call that uses them).
  ShmGroupCount groups[kShmBarrierGroups];
  // Rank j's entry (j < the fabric's max_ranks), right after the header.
  ShmPeer& peer(int j) { return reinterpret_cast<ShmPeer*>(this + 1)[j]; }
  const ShmPeer& peer(int j) const { return reinterpret_cast<const ShmPeer*>(this + 1)[j]; }
};
static_assert(sizeof(ShmSlot) % alignof(ShmPeer) == 0, "ShmPeer entries follow the header");

// The control segment: this header, kShmSlots slots of slot_bytes each (ShmSlot + max_ranks
// entries), then the low-latency path's region (shm_ll.h) at control_bytes(max_ranks). Written
// by process 0 before the segment's fd leaves it; read-only afterwards except the slots.
struct alignas(64) ShmControl {
  uint64_t magic;
  uint32_t nprocs;
  uint32_t max_ranks;  // the largest group: rank entries per slot
  // STRATA_SHM_BARRIER_GROUP of the process that made the segment (0: the default rule), so
  // that every process of the fabric counts its barriers in the same groups.
  uint32_t barrier_group;
  uint32_t reserved;
  uint64_t slot_bytes;  // slot_bytes(max_ranks)
  pthread_mutex_t mu;   // process-shared, robust: guards slot claim and release
  ShmSlot* slot(int i) {
    return reinterpret_cast<ShmSlot*>(reinterpret_cast<char*>(this) + sizeof(ShmControl) +
                                      static_cast<size_t>(i) * slot_bytes);
  }
  // Bytes of one slot with `max_ranks` entries (a multiple of 64), and of the whole control
  // block before the low-latency region (a multiple of 4096). 1024 ranks: 269 KiB a slot,
  // 67 MiB in all, of which a call touches its slot's header and its group's entries.
  static size_t slot_bytes_for(int max_ranks) {
    return (sizeof(ShmSlot) + static_cast<size_t>(max_ranks) * sizeof(ShmPeer) + 63) & ~size_t{63};
  }
  static size_t control_bytes(int max_ranks) {
    return (sizeof(ShmControl) + kShmSlots * slot_bytes_for(max_ranks) + 4095) & ~size_t{4095};
  }
};

class ShmFabric;

// Ranks per group of the general path's barrier for a group of `size` ranks (size or more: one
// flat counter). A flat barrier has every rank add to one counter, so a step costs `size`
// contended adds on one cache line in turn; in groups of g ranks, each rank adds to its
// group's counter (ShmSlot::groups, a line each) and the last of a group adds the group's count
// to the slot's, so no line takes more than max(g, ceil(size / g)) adds (docs/scaling.md: the
// model). `configured` (ShmControl::barrier_group, from STRATA_SHM_BARRIER_GROUP of the process
// that made the fabric) sets g; 0: flat up to 64 ranks (where the low-latency path takes most
// calls), ceil(sqrt(size)) above. g is raised where size / g would need more than
// kShmBarrierGroups counters.
int barrier_group(int configured, int size);

// The hash of a call's key (comm, exec, op, occ); never 0 (0 marks a free slot).
uint64_t slot_tag(uint64_t comm, uint64_t exec, uint64_t op, uint64_t occ);

class ShmTeam final : public SeatedTeam {
 public:
  ShmTeam(ShmFabric* f, ShmSlot* slot, const Placement& pl, const char* op_name);
  ~ShmTeam() override;
  const void* peer_in(int j) const override { return in_[j]; }
  void* peer_out(int j) const override { return out_[j]; }
  const void* peer_buf(int j, int i) const override { return bufs_[j * kMaxBufs + i]; }
  const void* peer_in_at(int j, int k) const override {
    return nops_ ? in_list_[static_cast<size_t>(j) * nops_ + k] : (k == 0 ? in_[j] : nullptr);
  }
  void* peer_out_at(int j, int k) const override {
    return nops_ ? out_list_[static_cast<size_t>(j) * nops_ + k] : (k == 0 ? out_[j] : nullptr);
  }
  const OpDesc& peer_desc(int j) const override { return descs_[j]; }
  std::string barrier(const char* phase) override;
  // Stages what cannot be shared, publishes this rank's buffers, waits for every peer, checks
  // that all agree and translates the peers' buffers into local addresses.
  std::string arrive(const OpDesc& desc, const void* in, void* out);
  // The same for up to kMaxBufs buffers (no in/out): each buffer is shared zero-copy when the
  // allocator owns it, else staged through one bounce buffer (copied in at arrival, or, when
  // `written`, copied back to the caller's buffer at departure).
  std::string arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs);
  // `nops` operands, each an input and an output (a pytree's leaves as one call): each buffer
  // is shared zero-copy when the allocator owns it, else staged in one bounce buffer (inputs
  // copied in at arrival, outputs copied back at departure). Where the buffers are goes as a
  // table of (segment, offset, address) at the start of that bounce buffer, which every peer has
  // mapped; its place is published in buffer slot 0 of the rendezvous entry.
  std::string arrive_list(const OpDesc& desc, const OperandRef* ops, int nops);
  // Final barrier, then copies a staged output to the caller's buffer. Always call it once
  // arrive() returned (also after an error), so no peer still touches this rank's memory.
  std::string depart();
  // True when no byte of this call went through a bounce buffer.
  bool zero_copy() const override { return !any_staged_; }
  int local_ranks() const override { return local_ranks_; }

 private:
  std::string fail(const std::string& msg);
  // Compares the descriptors of every rank that has published one (reached >= 1) with this
  // rank's; returns a message naming each rank's op, dtype and size on a disagreement.
  std::string check_peers(const OpDesc& desc) const;
  void publish_desc(const OpDesc& desc);
  // The arrival barrier shared by arrive() and arrive_multi(): waits for every peer's published
  // entry, checks that all agree on the op and copies the peers' descriptors.
  std::string arrival_barrier(const OpDesc& desc);
  std::string publish(const void* p, uint64_t bytes, bool is_out, uint64_t* seg, uint64_t* off,
                      uint64_t* ptr);
  ShmFabric* f_;
  ShmSlot* slot_;
  int local_ranks_ = 1;  // ranks of this call in this process (set at arrival)
  // The missing ranks whose process has disconnected: "" if none (checked while waiting).
  std::string dead_members() const;
  uint32_t barriers_ = 0;
  // This rank's barrier group: size g, first rank, members (0 members: flat).
  int barrier_group_ = 0, group_first_ = 0, group_members_ = 0;
  const OpDesc* arriving_ = nullptr;  // set while in the arrival barrier: checked while waiting
  std::vector<const void*> in_;
  std::vector<void*> out_;
  std::vector<const void*> bufs_;     // [rank * kMaxBufs + i]: arrive_multi's buffers, local
  int nops_ = 0;                      // arrive_list's operand count (0: not a list call)
  std::vector<const void*> in_list_;  // [rank * nops_ + k]: arrive_list's operands, local
  std::vector<void*> out_list_;
  struct CopyBack {
    void* dst;
    uint64_t off, bytes;
  };
  std::vector<CopyBack> copy_back_;  // staged `written` buffers, copied back at departure
  std::vector<OpDesc> descs_;        // copies of the peers' published descriptors (after arrival)
  bool any_staged_ = false;
  // Staging of this rank's own buffers.
  struct Bounce* bounce_ = nullptr;
  void* user_out_ = nullptr;
  uint64_t out_bytes_ = 0;
  bool out_staged_ = false;
  bool arrived_ = false;
  bool release_bounce_ = false;
};

// A bounce buffer: a memfd of the fabric's own, exported to every peer when created.
struct Bounce {
  uint64_t id;
  int fd;
  char* base;
  size_t size;
  bool busy;
};

class ShmFabric {
 public:
  // The connected fabric, or nullptr (single process, or init() not called).
  static ShmFabric* active() { return active_.load(std::memory_order_acquire); }
  static ShmFabric& instance();

  // Bootstrap, step 1: listen on a unix socket in `dir`; returns its path (or an error).
  std::string listen(const std::string& dir, int proc, std::string* path);
  // Step 2: connect to every peer (paths by process index), share the control segment, start
  // the receiver thread and the registration callbacks. Step 3 (after every process returned
  // from connect): unlink_socket().
  std::string connect(int proc, int nprocs, const std::vector<std::string>& paths, RegMode mode);
  void unlink_socket();
  // This process is exiting: shut its links down so that every peer's receiver sees them close
  // at once and a peer waiting for one of this process's ranks fails now ("exited or was
  // killed") instead of at the timeout. Ranks that already arrived are not waited for, so a
  // peer still finishing a call this process completed is not affected. The sockets stay open
  // (the receiver thread owns them) and mapped segments stay valid for the peers.
  void leave();

  RegMode mode() const { return mode_; }
  int proc() const { return proc_; }
  int nprocs() const { return nprocs_; }
  ShmControl* control() const { return ctl_; }
  // The largest group this fabric holds (rank entries per rendezvous slot).
  int max_ranks() const { return ctl_ ? static_cast<int>(ctl_->max_ranks) : 0; }
  // Tests only (tests/native/shm_many_ranks.cc): makes this fabric a single process with a
  // control segment of `max_ranks` entries per slot in private memory, as connect() would.
  std::string connect_for_test(int max_ranks);

  // Rendezvous: finds or claims the slot of this call. nullptr and *err on failure.
  std::unique_ptr<ShmTeam> join(const Placement& pl, int64_t run_id, int64_t op_id,
                                const char* op_name, std::string* err);
  void leave(ShmSlot* slot);

  // Registration. Sends the segment to every peer unless already done. `critical`: called by a
  // collective (counted as registration on the critical path).
  std::string export_segment(uint64_t id, int fd, size_t size, bool critical);
  void unexport_segment(uint64_t id);
  // Address in this process of (proc, seg) + off, waiting up to the deadline for the receiver
  // thread to map it. nullptr on timeout (err filled).
  char* translate(int proc, uint64_t seg, uint64_t off, uint64_t bytes, Clock::time_point deadline,
                  std::string* err);
  bool peer_alive(int proc) const;
  // Which process of this fabric owns a global device (-1: unknown), and the job's process
  // index of each of this fabric's processes (`job_procs[proc]`; empty: the same numbers, one
  // fabric). Set once from Python before connect().
  void set_device_procs(const std::vector<int64_t>& devices, const std::vector<int>& procs,
                        const std::vector<int>& job_procs, int fabrics);
  int device_proc(int64_t device) const;
  // The job's process index of fabric process `proc`: what messages name. Across several
  // fabrics (hosts) the fabric's own numbering restarts at 0 on each, which no user can map.
  int job_proc(int proc) const;
  // For a message: where the group's ranks `ranks` live, "rank 1 (device 3, process 3), ...",
  // from the group's members (Placement::member_parts, device_ids; empty when not known).
  std::string ranks_where(const std::vector<int>& ranks, const int64_t* member_parts,
                          const int64_t* device_ids) const;
  // For a timeout message in a job of several fabrics (hosts): why the rank named missing may
  // not be the one at fault (empty with one fabric).
  std::string across_fabrics_hint() const;
  std::string dead_peers() const;  // job processes whose link closed ("1, 3"), cleanly or not
  std::string left_peers() const;  // of those, the ones that said kBye first (a normal exit)
  // For memory_stats(): the OS process id at the other end of each link (SO_PEERCRED, attested
  // by the kernel; 0 for self), and the peer segments mapped here per owner (count, bytes).
  std::vector<int> link_pids() const { return link_pids_; }
  std::vector<std::pair<uint64_t, uint64_t>> mapped_by_owner() const;

  // The rendezvous key of a call (see the opening comment); the general path (join) and the
  // low-latency path (shm_ll.h) both take it here, once per call.
  struct CallSeq {
    uint64_t exec, op, occ;
  };
  CallSeq next_seq(const Placement& pl, int64_t run_id, int64_t op_id);
  // The low-latency path's region (shm_ll.h), mapped right after the control block.
  char* ll_region() const;

  // Where a call's input and output stand for the peers: `in_ok`/`out_ok`, inside an allocator
  // segment (`in`/`out`), which is exported now if it was not yet (on_use mode; in on_alloc mode
  // the allocator's thread did it); not ok: staging mode, or memory the allocator does not
  // hold, which the caller stages. An empty buffer counts as ok. Returns the error, or empty.
  struct DirectBuffers {
    strata_seg_info in{}, out{};
    bool in_ok = false, out_ok = false;
  };
  std::string share_direct(const void* in, uint64_t in_bytes, const void* out, uint64_t out_bytes,
                           DirectBuffers* d);

  Bounce* acquire_bounce(size_t bytes, bool critical, std::string* err);
  void release_bounce(Bounce* b);

  // The allocator's C API, found with dlsym (null members when libstrata_alloc is not loaded).
  struct AllocApi {
    strata_alloc_lookup_fn lookup = nullptr;
    strata_alloc_set_callback_fn set_new_cb = nullptr;
    strata_alloc_set_callback_fn set_free_cb = nullptr;
    strata_alloc_stats_fn stats = nullptr;
    strata_alloc_active_fn active = nullptr;
  };
  static const AllocApi& alloc();

 private:
  ShmFabric() = default;
  void receiver_main();
  int fabric_max_ranks(int nprocs) const;
  std::string send_fd(int peer, uint32_t type, uint64_t id, uint64_t size, int fd);
  static std::atomic<ShmFabric*> active_;

  int proc_ = -1, nprocs_ = 0;
  std::unordered_map<int64_t, int> device_proc_;  // written before connect(), then read-only
  std::vector<int> job_procs_;                    // written before connect(), then read-only
  int fabrics_ = 1;                               // the job's fabrics; as job_procs_
  RegMode mode_ = RegMode::kOnAlloc;
  int listen_fd_ = -1;
  std::string socket_path_;
  std::vector<int> links_;  // socket per peer process (-1 for self)
  std::vector<int> link_pids_;
  std::unique_ptr<std::atomic<bool>[]> alive_;
  // Set by the receiver thread (release) when a peer's kBye arrives; read (acquire) at exit.
  std::unique_ptr<std::atomic<bool>[]> left_;
  ShmControl* ctl_ = nullptr;
  std::thread receiver_;

  // Exported segments of this process (id -> size). export_mu_ also serializes all sends.
  std::mutex export_mu_;
  std::unordered_map<uint64_t, size_t> exported_;

  // Peer segments mapped here: (proc, id) -> (base, size).
  mutable std::shared_mutex map_mu_;
  std::condition_variable_any map_cv_;
  std::map<std::pair<int, uint64_t>, std::pair<char*, size_t>> mapped_;
  std::map<std::pair<int, uint64_t>, std::string> map_errors_;  // segments that failed to map

  std::mutex bounce_mu_;
  std::vector<std::unique_ptr<Bounce>> bounces_;
  uint64_t next_bounce_id_ = 1;

  // Per (device, communicator): the last execution (run id) that called it, how many
  // executions did, and the occurrences of each op in the current one. A handful of
  // communicators per device, so the map stays small.
  struct CommState {
    int64_t last_run = 0;
    uint64_t execs = 0;
    std::unordered_map<int64_t, uint64_t> occ;
  };
  std::mutex seq_mu_;
  std::map<std::pair<int64_t, uint64_t>, CommState> seqs_;
};

}  // namespace strata
