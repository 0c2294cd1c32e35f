// The low-latency path of the shared-memory fabric for small messages (NCCL's LL protocol
// adapted to CPU shared memory).
//
// Why: the general path (shm.h) meets in a rendezvous slot (claimed under the control mutex),
// publishes buffer addresses, passes an arrival barrier, runs the algorithm on the peers' own
// buffers and passes a departure barrier before anyone may reuse them. Two barriers are two
// rounds of sleeping and waking every process; with 4 processes on 2 cores each round costs a
// context switch per process: with 4 processes on 2 cores a 4 KiB psum on the general path
// spends 420 us (p50) in its handler, 67% of it waiting, against a jitted no-op's 52-70 us.
//
// What: below a threshold (STRATA_LL_BYTES, default 64 KiB of input per rank) a call copies its
// input into a slot of its own in shared memory and publishes it with one store of the call's
// key (the "stamp", written after the data with release: data and arrival flag travel together,
// so no arrival barrier), reads the peers' slots as soon as their stamps carry the same key,
// computes its own output, and marks each peer's slot as read (one fetch_or per peer, no
// departure barrier: nobody waits for it). A rank owns a ring of kLlEntries slots per
// communicator; a slot is rewritten only after every peer marked it read, so the next calls
// start while slow readers still read the previous ones (the ring generalizes double
// buffering to the 2 calls XLA may run at once on a device, see inflight.h).
//
// Keys: exactly the general path's (communicator, execution number on it, op index,
// occurrence) from ShmFabric::next_seq, hashed into the stamp; the slot also holds the exact
// key and the descriptor (op, dtype, sizes, reduce, a digest of the parameters), compared with
// every peer's when found: a disagreement fails every rank that sees it at once, naming each rank's
// op, dtype and size. Ranks that disagree on the path itself (sizes straddling the threshold: one
// rank in the general rendezvous, one here) are found by the waiting LL rank in the control
// segment's slot table, which fails both with the same message. A dead peer's process is detected
// while waiting (the links close) and named; otherwise the call times out naming the missing ranks.
//
// Waiting: spin, yield, then sleep on the channel's futex word `epoch`, counted in `sleepers`
// so that the waker makes the system call only when someone sleeps; only the last rank to
// publish wakes (nobody finishes before it). With more runnable threads than cores (4-8
// processes on 2 cores, or other jobs) spinning takes the core the awaited rank needs, so
// the spin budget adapts per process: it grows after waits that spinning would have caught
// and halves after longer ones, down to futex at once (STRATA_LL_SPINS / STRATA_LL_YIELDS cap
// it). Measured here, loaded: 2 processes 4 KiB psum p50 18-21 us adaptive, 50-150 us with a
// fixed 2000-pause spin. With more processes on the fabric than cores the cap
// is 100 pauses: the adaptive budget up to 2000 kept growing back and cost up to 1.6x the time
// of going straight to the futex (all_gather at 4-64 KiB), and a short spin beat both (4
// processes on 2 cores, 4-256 KiB, median 1.34x XLA over MPI's speed against 1.14x futex at
// once; shm_ll.cc, ShmLlTeam::wait).
//
// Staged form (larger calls, STRATA_LL_STAGE_BYTES): a call too large for a slot but at most
// the channel's `stage_bytes` (and marked OpDesc::may_stage by its handler) takes the same path
// with its data in a bounce buffer of the owner's (a memfd every peer has mapped, shm.cc)
// instead of inside the slot; the slot's header says where (data_seg/off/ptr). The bounce buffer
// stays busy until every peer has marked the slot read, so, as for small calls, no rank waits
// for its peers to finish reading (no departure barrier). Why: with more processes than cores
// every barrier a rank sleeps in costs it its core; the general path's departure barrier made
// ranks that had finished their copy wait for a descheduled peer (measured under launch -n 4 on
// 2 cores, train_recsys's 8 MiB all_to_alls: 1-32 ms per call in the departure barrier for
// 0.7-1.8 ms of copying). What it costs: one copy of the input per call, and an all-reduce runs
// one-shot (every rank reads every peer's whole input). Default: off: calls timed back to back
// (collectives.py --batch, mpirun -n 4 on 2 cores) run 1.2-2.4x slower staged than on the
// general path at 256 KiB-1 MiB for every operator, and train_moe, serve_moe and train_recsys
// (--preset paper, launch -n 4) are no faster with it (docs/design.md, the staged form).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fabric/shm.h"
#include "fabric/team.h"
#include "sync/wait.h"

namespace strata {

constexpr int kLlEntries = 16;    // slots per rank and communicator (a ring)
constexpr int kLlChannels = 128;  // communicators with a low-latency channel
constexpr size_t kLlDefaultBytes = 64 * 1024;
constexpr size_t kLlMaxBytes = 1024 * 1024;
// The region after the control block in the control segment (shm_link.cc maps both): the
// channel table, then the slots. Untouched pages cost nothing (memfd pages are made on touch).
constexpr size_t kLlRegionBytes = size_t{256} << 20;

// One slot: a header line of its own, then the data. Written only by its owner rank.
struct LlEntry {
  // The call's key hash (slot_tag), 0 while free or being written. The owner stores it last,
  // seq_cst (a release for the header and data above it, and the store half of the
  // publish/sleepers handshake); readers load it with acquire before touching anything else.
  std::atomic<uint64_t> stamp;
  // Bit j: rank j has finished reading this occupant (fetch_or, acq_rel: its reads happen
  // before the owner's next rewrite, which waits for all bits with acquire loads).
  std::atomic<uint64_t> read_by;
  // 1 while one of the owner's threads claims or writes the slot (CAS 0 -> 1, acq_rel; reset
  // with release after the stamp): two calls of one device in flight never take the same slot.
  std::atomic<uint32_t> claim;
  uint64_t exec, op, occ;  // the exact key (the stamp is its hash)
  int32_t kind, dtype, reduce, proc;
  uint64_t params;  // OpParams::digest() of the call
  int64_t device;
  uint64_t in_bytes, out_bytes;
  // Staged form: the data's place in the owner's bounce buffer (data_seg 0: inside the slot);
  // data_ptr is the owner's own address of it (for ranks of the same process).
  uint64_t data_seg, data_off, data_ptr;
  // arrive_multi's buffers: offset of each in the data (64-byte aligned) and bytes (0: none).
  uint64_t buf_off[kMaxBufs], buf_bytes[kMaxBufs];
  char name[32];
};
constexpr size_t kLlHeaderBytes = 256;
static_assert(sizeof(LlEntry) <= kLlHeaderBytes, "LlEntry header too large");

// A communicator's channel. Fields up to `offset` are written once under the control mutex when
// the channel is claimed (comm last) and read-only afterwards.
struct LlChannel {
  uint64_t comm;         // 0: free
  int32_t size;          // ranks
  uint32_t data_bytes;   // threshold = data room per slot; 0: no LL path for this comm
  uint64_t offset;       // of rank 0's ring from the region start
  uint64_t entry_bytes;  // header + data room, multiple of 64
  uint64_t stage_bytes;  // largest input of the staged form (0: none; see above)
  // Futex words and their sleeper counts: `epoch` for waiters of peers' data, `freed` for an
  // owner waiting until its peers finished reading a slot it wants to reuse (rare). A notifier
  // changes the condition with a seq_cst store, then loads the count (seq_cst) and bumps the
  // word and wakes only when it is nonzero; a waiter increments the count (seq_cst), loads
  // the word and re-checks the condition before futex_wait (Dekker: one of the two sees the
  // other's store, so a wake-up is never lost).
  alignas(64) std::atomic<uint32_t> epoch;
  std::atomic<uint32_t> sleepers;
  alignas(64) std::atomic<uint32_t> freed;
  std::atomic<uint32_t> free_sleepers;
  alignas(64) std::atomic<uint32_t> next[64];  // per rank: ring position of its next call
};

struct LlRegion {
  uint64_t used;  // bytes of slots handed out (under the control mutex)
  LlChannel channels[kLlChannels];
};

// The threshold a communicator's channel gets when this process creates it: set_ll_bytes()
// (strata_jax.set_low_latency_threshold), else STRATA_LL_BYTES, else kLlDefaultBytes; clamped to
// kLlMaxBytes, 0 = general path only. A channel keeps the value it was created with, so every
// rank of a communicator agrees whatever each process set later.
void set_ll_bytes(int64_t bytes);
int64_t get_ll_bytes();
// The staged form's limit a channel gets when this process creates it: set_ll_stage_bytes(), else
// STRATA_LL_STAGE_BYTES (K/M suffixes), else 0 (off). Kept by the channel like the threshold
// above. set_ll_stage_bytes(-1): back to that default.
void set_ll_stage_bytes(int64_t bytes);
int64_t get_ll_stage_bytes();

class ShmLlTeam final : public SeatedTeam {
 public:
  // The low-latency team for this call, or nullptr when the call takes the general path (too
  // large, no channel): then *err is empty and nothing was consumed (next_seq not called).
  // nullptr with *err set: the call failed.
  // `bytes`: what the call publishes (the input, or arrive_multi's buffers each rounded up to
  // 64 bytes), which decides between a slot, the staged form and the general path.
  static std::unique_ptr<ShmLlTeam> join(ShmFabric* f, const Placement& pl, int64_t run_id,
                                         int64_t op_id, const OpDesc& desc, uint64_t bytes,
                                         const char* op_name, std::string* err);
  // The bytes arrive_multi publishes for these buffers; 0 when one is `written` (the path
  // holds copies of inputs only, so such a call takes the general path).
  static uint64_t multi_bytes(const BufRef* bufs, int nbufs, bool* eligible);
  ShmLlTeam(ShmFabric* f, LlChannel* ch, char* region, const Placement& pl, const char* op_name);
  ~ShmLlTeam() override;  // marks the peers' slots read if depart() did not (a failed call)
  const void* peer_in(int j) const override { return in_[j]; }
  // Only this rank's own output is reachable: every operator on this path writes its own.
  void* peer_out(int j) const override { return j == rank_ ? out_ : nullptr; }
  const void* peer_buf(int j, int i) const override {
    return i >= 0 && i < kMaxBufs ? bufs_[static_cast<size_t>(j) * kMaxBufs + i] : nullptr;
  }
  const OpDesc& peer_desc(int j) const override { return descs_[j]; }
  std::string barrier(const char* phase) override;
  bool zero_copy() const override { return false; }  // the data goes through the slots
  // Copies `in` into this rank's slot, publishes it, waits for every peer's slot of this call
  // and checks that all agree. The algorithm then reads peer_in(j) (the peers' slots).
  std::string arrive(const OpDesc& desc, const void* in, void* out);
  // The same for up to kMaxBufs read-only buffers (peer_buf(j, i) then points into rank j's
  // copy); every rank's buffers have this rank's sizes (the descriptors agree).
  std::string arrive_multi(const OpDesc& desc, const BufRef* bufs, int nbufs);
  // Marks the peers' slots as read. Never waits.
  std::string depart();

 private:
  LlEntry* entry(int rank, uint32_t pos) const;
  LlEntry* find(int j) const;  // rank j's slot holding this call, or nullptr
  // Claims a slot of this rank's ring whose previous occupant every peer has read.
  std::string claim(LlEntry** out, Clock::time_point deadline);
  template <class Ready, class Missing>
  std::string wait(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers, Ready ready,
                   Missing missing, const char* phase, Clock::time_point deadline,
                   const OpDesc* arriving);
  std::string mismatch(const OpDesc& desc) const;  // names every found rank's op, dtype, size
  std::string straddler(const OpDesc& desc);       // a peer in the general rendezvous of this key
  std::string missing_message(const char* phase, const std::vector<int>& missing) const;
  static void notify(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers);
  void mark_read();

  ShmFabric* f_;
  LlChannel* ch_;
  char* region_;
  uint64_t comm_ = 0, tag_ = 0, exec_ = 0, op_ = 0, occ_ = 0;
  std::string failed_;  // set by a failed check inside wait()
  bool read_marked_ = false;
  std::vector<const void*> in_;
  void* out_ = nullptr;
  // Copies `nbufs` buffers into this rank's slot (or bounce buffer), publishes it, waits for
  // the peers' slots of this call and checks that all agree; then fills in_ and bufs_.
  std::string publish_and_wait(const OpDesc& desc, const BufRef* bufs, int nbufs);
  std::vector<const void*> bufs_;  // [rank * kMaxBufs + i]: arrive_multi's buffers, local
  std::vector<LlEntry*> found_;    // peers' slots of this call (after arrive)
  Bounce* stage_ = nullptr;  // the staged form's bounce buffer of this rank (after publishing)
  bool staged_ = false;      // the staged form (data in bounce buffers)
  std::vector<OpDesc> descs_;
};

}  // namespace strata
