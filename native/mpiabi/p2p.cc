// Point-to-point messages of the MPI engine (see p2p.h).
#include "mpiabi/p2p.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "coll/kernels.h"
#include "common/settings.h"
#include "fabric/stats.h"
#include "sync/wait.h"

namespace strata {
namespace mpiabi {

constexpr uint64_t kBoxMagic = 0x5354524154503250ull;  // "STRATP2P"

// Written once by the owner before the box is exported; then only the futex words change.
struct P2p::Header {
  uint64_t magic;
  uint32_t nprocs;
  uint32_t slots;
  // `pub`: bumped by the owner after publishing a slot (its receivers sleep on it);
  // `done`: bumped by a receiver after consuming one of the owner's slots (the owner's sends
  // sleep on it). Each with its count of sleepers (notify only wakes when someone sleeps).
  alignas(64) std::atomic<uint32_t> pub;
  std::atomic<uint32_t> pub_sleepers;
  alignas(64) std::atomic<uint32_t> done;
  std::atomic<uint32_t> done_sleepers;
};
constexpr size_t kBoxHeaderBytes = 4096;
static_assert(sizeof(P2p::Header) <= kBoxHeaderBytes, "box header too large");

// One message slot in the sender's box. The sender writes every plain field, then `stamp`
// (seq_cst: a release for the fields and the inline data, and the store half of the sleepers
// handshake). The receiver reads them after an acquire load of `stamp` that matched, writes
// `recv_bytes`, then `done` (seq_cst). The sender frees the slot (stamp 0, then done 0) only
// after it saw `done`, so the receiver never reads a slot being rewritten.
struct P2p::Slot {
  std::atomic<uint64_t> stamp;  // the key's hash (odd), 0 while free
  std::atomic<uint64_t> done;   // stamp: consumed; stamp - 1 (even): refused (size mismatch)
  uint64_t ctx, seq;
  int32_t src, dst, tag, proc;
  uint64_t bytes;
  uint64_t seg, off, ptr;  // where the data is: seg 0 inline, else (segment, offset) of the owner
  uint64_t recv_bytes;     // what the receiver expected (written before a refusal)
  int64_t device;          // the sender's device (for messages)
  char what[32];
};
static_assert(sizeof(P2p::Slot) <= kP2pHeaderBytes, "slot header too large");

namespace {

uint64_t key_stamp(const P2pKey& k) {
  uint64_t h = k.ctx * 0x9E3779B97F4A7C15ull;
  h ^= k.seq + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
  h ^= static_cast<uint64_t>(k.src) * 0x94D049BB133111EBull + (h << 6) + (h >> 2);
  h ^= static_cast<uint64_t>(k.dst) + (h << 6) + (h >> 2);
  return h | 1;  // odd: 0 marks a free slot, stamp - 1 a refusal
}

// The notifier's half of the sleepers handshake: the condition was stored (seq_cst) before.
void notify(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers) {
  word->fetch_add(1, std::memory_order_seq_cst);
  if (sleepers->load(std::memory_order_seq_cst) != 0) futex_wake_all(word, /*shared=*/true);
}

// Waits until ready() (spin, yield, then futex on `word`), failing early when failed() says
// so. The waiter's half of the handshake: count itself in `sleepers`, load the word, re-check.
template <class Ready, class Failed>
bool wait_for(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers, Ready ready,
              Failed failed, Clock::time_point deadline) {
  for (int i = 0; i < 64; ++i) {
    if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  for (int i = 0; i < 8; ++i) {
    if (ready()) return true;
    sched_yield();
  }
  for (;;) {
    sleepers->fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word->load(std::memory_order_seq_cst);
    if (ready()) {
      sleepers->fetch_sub(1, std::memory_order_relaxed);
      return true;
    }
    const auto now = Clock::now();
    if (failed() || now >= deadline) {
      sleepers->fetch_sub(1, std::memory_order_relaxed);
      return ready();
    }
    const int64_t left =
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    futex_wait(word, seen, left < 50'000'000 ? left : 50'000'000, /*shared=*/true);
    sleepers->fetch_sub(1, std::memory_order_relaxed);
  }
}

std::string timeout_s() {
  std::ostringstream os;
  os << settings().timeout_ms.load() / 1000.0 << " s";
  return os.str();
}

std::mutex g_mu;
P2p* g_p2p = nullptr;  // never freed: peers may read the box until the process ends

}  // namespace

P2p::P2p(ShmFabric* f, int fd, char* base, size_t size)
    : f_(f),
      fd_(fd),
      base_(base),
      size_(size),
      busy_(static_cast<size_t>(f->nprocs()) * kP2pSlots, 0),
      peers_(f->nprocs(), nullptr) {
  peers_[f->proc()] = base_;
}

P2p* P2p::get(ShmFabric* f, std::string* err) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_p2p) return g_p2p;
  const size_t size =
      kBoxHeaderBytes + static_cast<size_t>(f->nprocs()) * kP2pSlots * kP2pSlotBytes;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "strata_mpi_p2p", MFD_CLOEXEC));
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    *err = std::string("cannot create the point-to-point box: ") + strerror(errno);
    return nullptr;
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    *err = std::string("cannot map the point-to-point box: ") + strerror(errno);
    return nullptr;
  }
  auto* h = new (base) Header();
  h->magic = kBoxMagic;
  h->nprocs = static_cast<uint32_t>(f->nprocs());
  h->slots = kP2pSlots;
  // The fields above reach a peer with the file descriptor (a system call), before it maps.
  *err = f->export_segment(kP2pSegmentId, fd, size, /*critical=*/false);
  if (!err->empty()) {
    munmap(base, size);
    close(fd);
    return nullptr;
  }
  g_p2p = new P2p(f, fd, static_cast<char*>(base), size);
  return g_p2p;
}

P2p::Header* P2p::header(char* box) const { return reinterpret_cast<Header*>(box); }

P2p::Slot* P2p::slot(char* box, int dst_proc, int i) const {
  return reinterpret_cast<Slot*>(box + kBoxHeaderBytes +
                                 (static_cast<size_t>(dst_proc) * kP2pSlots + i) * kP2pSlotBytes);
}

char* P2p::peer_box(int proc, std::string* err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_[proc]) return peers_[proc];
  }
  // The peer exported its box when its engine started; the fabric's receiver thread maps it.
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  char* box = f_->translate(proc, kP2pSegmentId, 0, size_, deadline, err);
  if (!box) return nullptr;
  if (header(box)->magic != kBoxMagic ||
      header(box)->nprocs != static_cast<uint32_t>(f_->nprocs())) {
    *err = "process " + std::to_string(proc) + "'s point-to-point box is not this version's";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  peers_[proc] = box;
  return box;
}

std::string P2p::post_send(const P2pKey& k, int dst_proc, int64_t dst_device, const void* buf,
                           uint64_t bytes, const char* what, P2pSend* out) {
  int i = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int j = 0; j < kP2pSlots && i < 0; ++j)
      if (!busy_[static_cast<size_t>(dst_proc) * kP2pSlots + j]) i = j;
    if (i >= 0) busy_[static_cast<size_t>(dst_proc) * kP2pSlots + i] = 1;
  }
  if (i < 0)
    return std::string("strata_jax ") + what + ": more than " + std::to_string(kP2pSlots) +
           " sends to process " + std::to_string(dst_proc) +
           " are outstanding (each send needs its MPI_Wait before more are posted)";
  Slot* s = slot(base_, dst_proc, i);
  const auto& api = ShmFabric::alloc();
  strata_seg_info seg{};
  const bool shared =
      bytes && f_->mode() != RegMode::kStaging && api.lookup && api.lookup(buf, bytes, &seg);
  std::string err;
  out->bounce = nullptr;
  s->seg = s->off = 0;
  s->ptr = reinterpret_cast<uintptr_t>(buf);
  if (shared) {
    err = f_->export_segment(seg.segment_id, seg.fd, seg.size, /*critical=*/true);
    s->seg = seg.segment_id;
    s->off = seg.offset;
  } else if (bytes > kP2pInlineBytes) {
    out->bounce = f_->acquire_bounce(bytes, /*critical=*/true, &err);
    if (out->bounce) {
      copy_bytes(out->bounce->base, buf, bytes);
      copy_fence();
      stats().staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
      s->seg = out->bounce->id;
      s->ptr = reinterpret_cast<uintptr_t>(out->bounce->base);
    }
  } else if (bytes) {
    std::memcpy(reinterpret_cast<char*>(s) + kP2pHeaderBytes, buf, bytes);
  }
  if (!err.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    busy_[static_cast<size_t>(dst_proc) * kP2pSlots + i] = 0;
    return std::string("strata_jax ") + what + ": " + err;
  }
  s->ctx = k.ctx;
  s->seq = k.seq;
  s->src = k.src;
  s->dst = k.dst;
  s->tag = k.tag;
  s->proc = f_->proc();
  s->bytes = bytes;
  s->recv_bytes = 0;
  s->device = dst_device;
  std::strncpy(s->what, what, sizeof(s->what) - 1);
  s->what[sizeof(s->what) - 1] = 0;
  s->done.store(0, std::memory_order_relaxed);
  const uint64_t stamp = key_stamp(k);
  s->stamp.store(stamp, std::memory_order_seq_cst);  // publishes everything above
  Header* h = header(base_);
  notify(&h->pub, &h->pub_sleepers);
  out->dst_proc = dst_proc;
  out->slot = i;
  out->stamp = stamp;
  out->key = k;
  out->what = what;
  out->bytes = bytes;
  out->dst_device = dst_device;
  return {};
}

std::string P2p::wait_send(P2pSend& p) {
  Slot* s = slot(base_, p.dst_proc, p.slot);
  Header* h = header(base_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  // acquire: the receiver's reads of the data happen before this sender reuses the buffer.
  auto ready = [&] { return s->done.load(std::memory_order_acquire) != 0; };
  auto failed = [&] { return !f_->peer_alive(p.dst_proc); };
  const bool ok = wait_for(&h->done, &h->done_sleepers, ready, failed, deadline);
  const uint64_t done = s->done.load(std::memory_order_acquire);
  std::string err;
  std::ostringstream os;
  if (!ok) {
    os << "strata_jax " << p.what << ": rank " << p.key.src << " sent " << p.bytes
       << " B (message #" << p.key.seq << " to rank " << p.key.dst << ", tag " << p.key.tag
       << ") and ";
    if (!f_->peer_alive(p.dst_proc))
      os << "process " << p.dst_proc << " (rank " << p.key.dst
         << ") exited or was killed before receiving it";
    else
      os << "timed out after " << timeout_s() << " waiting for rank " << p.key.dst << " (process "
         << p.dst_proc << ") to receive it. Every rank must make the same "
         << "sequence of XLA collectives; raise STRATA_TIMEOUT_S if a rank is only slow";
    err = os.str();
  } else if (done != p.stamp) {
    os << "strata_jax " << p.what << ": ranks disagree on a message's size: rank " << p.key.src
       << " sent " << p.bytes << " B, rank " << p.key.dst << " expected " << s->recv_bytes
       << " B (message #" << p.key.seq << " between them). Every rank must make the same "
       << "sequence of XLA collectives with the same shapes and dtypes";
    err = os.str();
  }
  if (ok) {
    // Free the slot (the receiver is done with it): stamp first, so no receiver matches it.
    s->stamp.store(0, std::memory_order_release);
    s->done.store(0, std::memory_order_release);
    if (p.bounce) f_->release_bounce(p.bounce);
    std::lock_guard<std::mutex> lock(mu_);
    busy_[static_cast<size_t>(p.dst_proc) * kP2pSlots + p.slot] = 0;
  }
  // A send that never completed keeps its slot (and bounce buffer): the peer may still read it.
  p.slot = -1;
  return err;
}

std::string P2p::recv(const P2pKey& k, int src_proc, int64_t src_device, void* buf, uint64_t bytes,
                      const char* what, uint64_t* got) {
  std::string err;
  char* box = peer_box(src_proc, &err);
  if (!box) return std::string("strata_jax ") + what + ": " + err;
  Header* h = header(box);
  const uint64_t stamp = key_stamp(k);
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  Slot* found = nullptr;
  auto ready = [&] {
    for (int i = 0; i < kP2pSlots; ++i) {
      Slot* s = slot(box, f_->proc(), i);
      // acquire: the sender's fields and inline data are visible once its stamp is.
      if (s->stamp.load(std::memory_order_acquire) == stamp && s->ctx == k.ctx && s->seq == k.seq &&
          s->src == k.src && s->dst == k.dst) {
        found = s;
        return true;
      }
    }
    return false;
  };
  auto failed = [&] { return !f_->peer_alive(src_proc); };
  if (!wait_for(&h->pub, &h->pub_sleepers, ready, failed, deadline)) {
    std::ostringstream os;
    os << "strata_jax " << what << ": rank " << k.dst << " waits for message #" << k.seq
       << " from rank " << k.src << " (process " << src_proc << ", device " << src_device
       << ", tag " << k.tag << ", " << bytes << " B) and ";
    if (!f_->peer_alive(src_proc))
      os << "that process exited or was killed before sending it";
    else
      os << "timed out after " << timeout_s() << ". Every rank must make the same sequence of "
         << "XLA collectives; raise STRATA_TIMEOUT_S if a rank is only slow";
    return os.str();
  }
  Slot* s = found;
  *got = s->bytes;
  if (s->bytes != bytes || s->tag != k.tag) {
    std::ostringstream os;
    os << "strata_jax " << what << ": ranks disagree on a message: rank " << k.src << " sent "
       << s->bytes << " B with tag " << s->tag << ", rank " << k.dst << " expected " << bytes
       << " B with tag " << k.tag << " (message #" << k.seq << " between them). Every rank must "
       << "make the same sequence of XLA collectives with the same shapes and dtypes";
    s->recv_bytes = bytes;
    s->done.store(stamp - 1, std::memory_order_seq_cst);
    notify(&h->done, &h->done_sleepers);
    return os.str();
  }
  if (bytes) {
    const char* src = nullptr;
    if (s->seg == 0) {
      src = reinterpret_cast<const char*>(s) + kP2pHeaderBytes;
    } else if (src_proc == f_->proc()) {
      src = reinterpret_cast<const char*>(s->ptr);
    } else {
      src = f_->translate(src_proc, s->seg, s->off, bytes, deadline, &err);
      if (!src) {
        s->recv_bytes = bytes;
        s->done.store(stamp - 1, std::memory_order_seq_cst);
        notify(&h->done, &h->done_sleepers);
        return std::string("strata_jax ") + what + ": " + err;
      }
    }
    copy_bytes(buf, src, bytes);
    copy_fence();
    const bool direct = s->seg != 0 && !(s->seg & kBounceIdBit);
    (direct ? stats().zero_copy_bytes : stats().peer_bounce_bytes)
        .fetch_add(bytes, std::memory_order_relaxed);
  }
  s->done.store(stamp, std::memory_order_seq_cst);  // after the reads of the sender's data
  notify(&h->done, &h->done_sleepers);
  return {};
}

}  // namespace mpiabi
}  // namespace strata
