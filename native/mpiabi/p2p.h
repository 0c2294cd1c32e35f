// Point-to-point messages of the MPI engine over the shared-memory fabric: what XLA's
// collective-permute (MPI_Irecv + MPI_Isend + MPI_Wait) and all-to-all (size-1 rounds of
// MPI_Sendrecv) need, with MPI's matching: a message meets its receive by communicator, the
// pair of ranks and their order (the k-th send from a to b on a communicator meets b's k-th
// receive from a), so ranks that take no part in a permutation call nothing.
//
// Why not the collectives' rendezvous (shm.h): a permutation is not a collective (a rank with no
// source and no target never calls), and MPI_Isend must return before its receiver arrives; a
// slot whose arrival barrier waits for every member would deadlock a ring permutation.
//
// How: every process owns a box, a memfd exported to every peer of its fabric when the engine
// starts (off the critical path), with kP2pSlots slots per destination process. A send claims a
// free slot for its destination, writes the message's key and where its data is, and publishes
// the slot with one seq_cst store of the key's hash (the stamp): no waiting. The data stays in
// the sender's buffer when the allocator owns it (zero-copy: the receiver reads it straight from
// the segment the fabric already mapped), else it is copied into the slot (up to
// kP2pInlineBytes) or into a bounce buffer every peer has mapped. The receive (at MPI_Wait)
// finds the slot in the sender's box by its stamp, checks the key and the size, copies the data
// into its own buffer and marks the slot done (the stamp stored in `done`, seq_cst); the send's
// MPI_Wait returns when its slot is done and frees it. One copy per message, the minimum for a
// receive into XLA's own buffer.
//
// Waiting: spin, yield, then sleep on the box's futex words (`pub` for receivers of the box's
// owner, `done` for the owner's sends), counted in sleepers so that a notifier makes the system
// call only when someone sleeps (the Dekker handshake of shm_ll.h). A receive whose sender's
// process disconnects fails at once naming it; otherwise the wait times out (STRATA_TIMEOUT_S)
// naming the call, the ranks and the message. Sizes that differ fail both sides at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "fabric/shm.h"

namespace strata {
namespace mpiabi {

constexpr int kP2pSlots = 4;                 // slots per (sender, destination) pair
constexpr size_t kP2pSlotBytes = 64 * 1024;  // header + inline data, per slot
constexpr size_t kP2pHeaderBytes = 256;      // of a slot
constexpr size_t kP2pInlineBytes = kP2pSlotBytes - kP2pHeaderBytes;
constexpr uint64_t kP2pSegmentId = uint64_t{1} << 61;  // the box's id among the fabric's segments

// A message's identity: who sends to whom on which communicator, and its place in that order.
struct P2pKey {
  uint64_t ctx = 0;  // the communicator's context
  uint64_t seq = 0;  // the k-th message from src to dst on it
  int src = 0, dst = 0;
  int tag = 0;
};

// A posted send (until its MPI_Wait).
struct P2pSend {
  int dst_proc = -1;
  int slot = -1;
  uint64_t stamp = 0;
  Bounce* bounce = nullptr;
  P2pKey key;
  const char* what = "";
  uint64_t bytes = 0;
  int64_t dst_device = -1;
};

class P2p {
 public:
  // This process's endpoint on the active fabric, made (box created and exported to every
  // peer) on the first call; nullptr and *err when it cannot be.
  static P2p* get(ShmFabric* f, std::string* err);

  // Publishes `bytes` at `buf` for fabric process `dst_proc` (never waits for the receiver).
  std::string post_send(const P2pKey& k, int dst_proc, int64_t dst_device, const void* buf,
                        uint64_t bytes, const char* what, P2pSend* out);
  // Waits until the receiver has consumed the message, then frees its slot.
  std::string wait_send(P2pSend& s);
  // Waits for the message `k` from fabric process `src_proc` and copies it into `buf` (at most
  // `bytes`; a different size fails both sides). *got: its size.
  std::string recv(const P2pKey& k, int src_proc, int64_t src_device, void* buf, uint64_t bytes,
                   const char* what, uint64_t* got);

  struct Header;  // the box's (p2p.cc)
  struct Slot;    // a message slot's

 private:
  P2p(ShmFabric* f, int fd, char* base, size_t size);
  Header* header(char* box) const;
  Slot* slot(char* box, int dst_proc, int i) const;
  char* peer_box(int proc, std::string* err);

  ShmFabric* f_;
  int fd_;
  char* base_;
  size_t size_;
  std::mutex mu_;             // guards busy_ and peers_
  std::vector<char> busy_;    // [dst_proc * kP2pSlots + i]: posted, not yet waited
  std::vector<char*> peers_;  // peers' boxes mapped here (nullptr until first use)
};

}  // namespace mpiabi
}  // namespace strata
