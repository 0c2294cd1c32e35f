// Links between the processes of the shared-memory fabric (unix SOCK_SEQPACKET, full mesh) and
// registration: exporting segments' file descriptors to every peer, mapping peers' segments.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "common/settings.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"
#include "fabric/stats.h"

namespace strata {
namespace {

// kBye: the sender is leaving at its normal exit (fabric_leave), so its closed link that follows
// is a clean exit, not a crash (dead_peers() vs left_peers()).
enum MsgType : uint32_t { kHello = 1, kControl = 2, kNewSeg = 3, kFreeSeg = 4, kBye = 5 };

struct LinkMsg {
  uint32_t type;
  int32_t from;
  uint64_t id;
  uint64_t size;
};

std::string errno_str(const char* what) { return std::string(what) + ": " + strerror(errno); }

// Receives one message and, if it carries one, a file descriptor (-1 otherwise).
// Returns bytes received (0: peer closed), or -1 with errno.
ssize_t recv_msg(int sock, LinkMsg* m, int* fd) {
  *fd = -1;
  iovec iov{m, sizeof(*m)};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  h.msg_control = ctrl;
  h.msg_controllen = sizeof(ctrl);
  ssize_t n;
  do n = recvmsg(sock, &h, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n <= 0) return n;
  for (cmsghdr* c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(&h, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      std::memcpy(fd, CMSG_DATA(c), sizeof(int));
  if (n != sizeof(*m)) {
    if (*fd >= 0) close(*fd);
    errno = EPROTO;
    return -1;
  }
  return n;
}

bool send_msg(int sock, const LinkMsg& m, int fd) {
  iovec iov{const_cast<LinkMsg*>(&m), sizeof(m)};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  if (fd >= 0) {
    std::memset(ctrl, 0, sizeof(ctrl));
    h.msg_control = ctrl;
    h.msg_controllen = sizeof(ctrl);
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do n = sendmsg(sock, &h, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof(m));
}

bool prefault_enabled() { return env_flag("STRATA_PREFAULT", false); }

// True when every page of a just-mapped peer segment is already in memory: the owner's
// allocator made it ahead of demand and faulted it in (its reserve). mincore reports the page
// cache behind a shared mapping whether or not this process has touched it.
bool all_resident(void* base, size_t size) {
  std::vector<unsigned char> v((size + 4095) / 4096);
  if (mincore(base, size, v.data()) != 0) return false;
  for (unsigned char c : v)
    if (!(c & 1)) return false;
  return true;
}

// The reserve (pool.cc) each process of a fabric of `nprocs` keeps when the user did not set
// STRATA_ALLOC_RESERVE_BYTES: the allocator's default (SIZE_MAX: 2 segments, 128 MiB) while the
// fabric's reserves together stay within 1/32 of the host's memory, else whole 64 MiB units of
// that share (0 below one). The reserve is memory faulted in ahead of demand, in every process:
// measured on 2 processes it was 128 of the 127 MiB strata added to a rank's memory (Pss) over
// the same JAX program without strata; 64 ranks kept 8 GiB of it on a 24 GiB host.
size_t fabric_reserve_bytes(int nprocs) {
  if (std::getenv("STRATA_ALLOC_RESERVE_BYTES")) return SIZE_MAX;  // the user's, as set
  struct sysinfo si{};
  if (sysinfo(&si) != 0 || nprocs < 1) return SIZE_MAX;
  const uint64_t total = static_cast<uint64_t>(si.totalram) * si.mem_unit;
  constexpr uint64_t kUnit = uint64_t{64} << 20;
  const uint64_t units = total / 32 / static_cast<uint64_t>(nprocs) / kUnit;
  return units >= 2 ? SIZE_MAX : static_cast<size_t>(units * kUnit);
}

// The keep budget (pool.cc: free pool memory a process keeps faulted in) of each process of a
// fabric of `nprocs`: STRATA_ALLOC_KEEP_BYTES when set, else the same share of the host as the
// reserve's (1/32 of its memory over the fabric's processes), at least 16 MiB. Measured at 32
// processes on 24 GiB before it: the pool kept ~100 MiB per process of blocks XLA had freed.
size_t fabric_keep_bytes(int nprocs) {
  const int64_t set = env_bytes("STRATA_ALLOC_KEEP_BYTES", -1);
  if (set >= 0) return static_cast<size_t>(set);
  struct sysinfo si{};
  if (sysinfo(&si) != 0 || nprocs < 1) return SIZE_MAX;
  const uint64_t total = static_cast<uint64_t>(si.totalram) * si.mem_unit;
  const uint64_t share = total / 32 / static_cast<uint64_t>(nprocs);
  return static_cast<size_t>(share > (uint64_t{16} << 20) ? share : uint64_t{16} << 20);
}

void on_new_segment(const strata_seg_info* info, void* user) {
  auto* f = static_cast<ShmFabric*>(user);
  if (f->mode() != RegMode::kOnAlloc) return;  // on_use: exported when a collective meets it
  std::string err = f->export_segment(info->segment_id, info->fd, info->size, false);
  if (!err.empty())
    std::fprintf(stderr, "strata_jax: registering a segment failed: %s\n", err.c_str());
}

void on_free_segment(const strata_seg_info* info, void* user) {
  static_cast<ShmFabric*>(user)->unexport_segment(info->segment_id);
}

// Fills a new control block (zeroed memory) of `nprocs` processes: its robust, process-shared
// mutex and its sizes, then the magic that marks it ready. Before its fd leaves this process
// (sendmsg orders the stores).
void init_control(ShmControl* ctl, int nprocs, int max_ranks) {
  pthread_mutexattr_t at;
  pthread_mutexattr_init(&at);
  pthread_mutexattr_setpshared(&at, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&at, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&ctl->mu, &at);
  pthread_mutexattr_destroy(&at);
  ctl->nprocs = static_cast<uint32_t>(nprocs);
  ctl->max_ranks = static_cast<uint32_t>(max_ranks);
  ctl->barrier_group = static_cast<uint32_t>(env_count("STRATA_SHM_BARRIER_GROUP", 0));
  ctl->slot_bytes = ShmControl::slot_bytes_for(max_ranks);
  ctl->magic = kShmMagic;
}

}  // namespace

const ShmFabric::AllocApi& ShmFabric::alloc() {
  static const AllocApi api = [] {
    AllocApi a;
    a.lookup = reinterpret_cast<strata_alloc_lookup_fn>(dlsym(RTLD_DEFAULT, "strata_alloc_lookup"));
    a.set_new_cb = reinterpret_cast<strata_alloc_set_callback_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_set_new_segment_callback"));
    a.set_free_cb = reinterpret_cast<strata_alloc_set_callback_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_set_free_segment_callback"));
    a.stats = reinterpret_cast<strata_alloc_stats_fn>(dlsym(RTLD_DEFAULT, "strata_alloc_stats"));
    a.active = reinterpret_cast<strata_alloc_active_fn>(dlsym(RTLD_DEFAULT, "strata_alloc_active"));
    // Without the malloc interposer the pool serves nothing: treat the allocator as absent.
    if (!a.active || !a.active()) a.lookup = nullptr;
    return a;
  }();
  return api;
}

std::string ShmFabric::listen(const std::string& dir, int proc, std::string* path) {
  if (active()) return "the shared-memory fabric is already connected";
  std::string p = dir + "/fabric-" + std::to_string(proc) + ".sock";
  sockaddr_un addr{};
  if (p.size() >= sizeof(addr.sun_path))
    return "socket path too long for a unix socket (" + p +
           "); set STRATA_RUN_DIR or TMPDIR "
           "to a shorter folder";
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return errno_str("socket");
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, p.c_str(), p.size() + 1);
  unlink(p.c_str());
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(s, 128) != 0) {
    std::string e = errno_str(("bind/listen " + p).c_str());
    close(s);
    return e;
  }
  listen_fd_ = s;
  socket_path_ = p;
  *path = p;
  return {};
}

void ShmFabric::unlink_socket() {
  if (!socket_path_.empty()) unlink(socket_path_.c_str());
  socket_path_.clear();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
}

void ShmFabric::leave() {
  {
    std::lock_guard<std::mutex> lock(export_mu_);  // export_mu_ serializes all sends
    for (int fd : links_)
      if (fd >= 0) send_msg(fd, LinkMsg{kBye, proc_, 0, 0}, -1);  // best effort
  }
  for (int fd : links_)
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

std::string ShmFabric::connect(int proc, int nprocs, const std::vector<std::string>& paths,
                               RegMode mode) {
  if (active()) return "the shared-memory fabric is already connected";
  if (listen_fd_ < 0) return "internal error: listen() first";
  if (static_cast<int>(paths.size()) != nprocs || proc < 0 || proc >= nprocs)
    return "internal error: bad process table";
  proc_ = proc;
  nprocs_ = nprocs;
  mode_ = mode;
  links_.assign(nprocs, -1);
  const auto deadline = Clock::now() + std::chrono::milliseconds(settings().timeout_ms.load());
  // Connect to every higher process (a pending connection completes without accept()), then
  // accept every lower one: no ordering between processes can deadlock.
  for (int j = proc + 1; j < nprocs; ++j) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, paths[j].c_str(), sizeof(addr.sun_path) - 1);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) return errno_str("socket");
    while (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      if ((errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN) ||
          Clock::now() > deadline) {
        std::string e = errno_str(
            ("connect to process " + std::to_string(job_proc(j)) + " at " + paths[j]).c_str());
        close(s);
        return e;
      }
      usleep(1000);
    }
    if (!send_msg(s, LinkMsg{kHello, proc, 0, 0}, -1)) return errno_str("hello");
    links_[j] = s;
  }
  for (int k = 0; k < proc; ++k) {
    pollfd pf{listen_fd_, POLLIN, 0};
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0 || poll(&pf, 1, left) <= 0)
      return "timed out waiting for lower-numbered processes to connect";
    int a = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (a < 0) return errno_str("accept");
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(a, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != getuid()) {
      close(a);
      return "a process of another user connected to the fabric socket; refused";
    }
    LinkMsg m{};
    int fd;
    if (recv_msg(a, &m, &fd) <= 0 || m.type != kHello || m.from < 0 || m.from >= proc ||
        links_[m.from] >= 0) {
      if (fd >= 0) close(fd);
      close(a);
      return "bad hello on the fabric socket";
    }
    links_[m.from] = a;
  }
  // The control segment: made by process 0, mapped by everyone.
  int cfd = -1;
  // The control block, then the low-latency path's region (shm_ll.h; sparse until touched).
  // Its slots hold an entry per device of the fabric (the largest group inside it); every
  // process computes the same size from the same device table (checked on receipt).
  const int max_ranks = fabric_max_ranks(nprocs);
  const size_t csize = ShmControl::control_bytes(max_ranks) + kLlRegionBytes;
  if (proc == 0) {
    cfd = static_cast<int>(syscall(SYS_memfd_create, "strata_control", MFD_CLOEXEC));
    if (cfd < 0 || ftruncate(cfd, static_cast<off_t>(csize)) != 0)
      return errno_str("control segment");
  } else {
    LinkMsg m{};
    if (recv_msg(links_[0], &m, &cfd) <= 0 || m.type != kControl || cfd < 0 || m.size != csize)
      return "did not receive the control segment from process 0 (a different strata_jax "
             "version?)";
  }
  void* base = mmap(nullptr, csize, PROT_READ | PROT_WRITE, MAP_SHARED, cfd, 0);
  if (base == MAP_FAILED) return errno_str("mmap control segment");
  ctl_ = static_cast<ShmControl*>(base);
  if (proc == 0) {
    init_control(ctl_, nprocs, max_ranks);
    for (int j = 1; j < nprocs; ++j)
      if (!send_msg(links_[j], LinkMsg{kControl, 0, 0, csize}, cfd))
        return errno_str("sending the control segment");
  } else if (ctl_->magic != kShmMagic || ctl_->nprocs != static_cast<uint32_t>(nprocs) ||
             ctl_->max_ranks != static_cast<uint32_t>(max_ranks)) {
    return "the control segment from process 0 is not a strata_jax fabric";
  }
  close(cfd);
  link_pids_.assign(nprocs, 0);
  for (int j = 0; j < nprocs; ++j) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (links_[j] >= 0 && getsockopt(links_[j], SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
      link_pids_[j] = cred.pid;
  }
  alive_.reset(new std::atomic<bool>[nprocs]);
  left_.reset(new std::atomic<bool>[nprocs]);
  for (int j = 0; j < nprocs; ++j) {
    alive_[j].store(true, std::memory_order_relaxed);
    left_[j].store(false, std::memory_order_relaxed);
  }
  receiver_ = std::thread([this] { receiver_main(); });
  receiver_.detach();
  active_.store(this, std::memory_order_release);
  // Registration-on-allocation: the allocator calls back for every segment that exists now and
  // every later one. on_use installs them too, so freed segments that a collective exported are
  // unmapped on the peers. staging never exports allocator memory.
  const AllocApi& api = alloc();
  if (mode != RegMode::kStaging && api.lookup && api.set_new_cb && api.set_free_cb) {
    api.set_free_cb(on_free_segment, this);
    api.set_new_cb(on_new_segment, this);
    // on_alloc also keeps segments made, faulted in and exported ahead of demand, so that a
    // burst of fresh buffers (a first training step) pays neither first touch nor registration.
    auto set_reserve = reinterpret_cast<strata_alloc_set_reserve_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_set_reserve"));
    if (mode == RegMode::kOnAlloc && set_reserve) set_reserve(fabric_reserve_bytes(nprocs));
    auto set_keep =
        reinterpret_cast<strata_alloc_set_keep_fn>(dlsym(RTLD_DEFAULT, "strata_alloc_set_keep"));
    if (set_keep) set_keep(fabric_keep_bytes(nprocs));
    // Calls above the direct form's threshold (fabric/shm_ll.h) read and write the callers' own
    // buffers, which must then be fabric memory: the allocator serves XLA's buffers from that
    // size on (unless STRATA_ALLOC_THRESHOLD says otherwise), not only from its default 64 KiB,
    // which suits one process (glibc reuses its heap below 128 KiB, interpose.cc).
    auto set_threshold = reinterpret_cast<strata_alloc_set_threshold_fn>(
        dlsym(RTLD_DEFAULT, "strata_alloc_set_threshold"));
    strata_alloc_stats_t st{};
    if (set_threshold && api.stats) {
      api.stats(&st);
      const uint64_t want = static_cast<uint64_t>(get_direct_bytes());
      if (want < st.threshold) set_threshold(static_cast<size_t>(want));
    }
  }
  // One bounce buffer registered now, off the critical path, for small unshareable buffers.
  std::string err;
  Bounce* b = acquire_bounce(0, /*critical=*/false, &err);
  if (!b) return err;
  release_bounce(b);
  return {};
}

int ShmFabric::fabric_max_ranks(int nprocs) const {
  // device_proc_ lists the devices of this fabric's processes (set_device_procs); without it
  // (a direct native caller), one device per process.
  const int devices = static_cast<int>(device_proc_.size());
  return devices > nprocs ? devices : nprocs;
}

std::string ShmFabric::connect_for_test(int max_ranks) {
  if (active()) return "the shared-memory fabric is already connected";
  proc_ = 0;
  nprocs_ = 1;
  mode_ = RegMode::kOnUse;
  links_.assign(1, -1);
  link_pids_.assign(1, 0);
  alive_.reset(new std::atomic<bool>[1]);
  left_.reset(new std::atomic<bool>[1]);
  alive_[0].store(true, std::memory_order_relaxed);
  left_[0].store(false, std::memory_order_relaxed);
  const size_t csize = ShmControl::control_bytes(max_ranks) + kLlRegionBytes;
  void* base = mmap(nullptr, csize, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return errno_str("mmap control segment");
  ctl_ = static_cast<ShmControl*>(base);
  init_control(ctl_, 1, max_ranks);
  active_.store(this, std::memory_order_release);
  return {};
}

std::string ShmFabric::send_fd(int peer, uint32_t type, uint64_t id, uint64_t size, int fd) {
  if (!alive_[peer].load(std::memory_order_acquire)) return {};
  if (!send_msg(links_[peer], LinkMsg{type, proc_, id, size}, fd)) {
    if (errno == EPIPE || errno == ECONNRESET || errno == ECONNREFUSED) {
      alive_[peer].store(false, std::memory_order_release);
      return {};  // a dead peer needs no memory; its collectives fail with a timeout
    }
    return errno_str(("sending a segment to process " + std::to_string(job_proc(peer))).c_str());
  }
  return {};
}

std::string ShmFabric::export_segment(uint64_t id, int fd, size_t size, bool critical) {
  const auto t0 = Clock::now();
  std::lock_guard<std::mutex> lock(export_mu_);
  if (exported_.count(id)) return {};
  for (int j = 0; j < nprocs_; ++j) {
    if (j == proc_) continue;
    std::string err = send_fd(j, kNewSeg, id, size, fd);
    if (!err.empty()) return err;
  }
  exported_.emplace(id, size);
  stats().exported_segments.fetch_add(1, std::memory_order_relaxed);
  stats().exported_bytes.fetch_add(size, std::memory_order_relaxed);
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  (critical ? stats().reg_critical : stats().reg_offpath).fetch_add(1, std::memory_order_relaxed);
  (critical ? stats().reg_critical_ns : stats().reg_offpath_ns)
      .fetch_add(ns, std::memory_order_relaxed);
  return {};
}

void ShmFabric::unexport_segment(uint64_t id) {
  std::lock_guard<std::mutex> lock(export_mu_);
  auto it = exported_.find(id);
  if (it == exported_.end()) return;
  stats().exported_segments.fetch_sub(1, std::memory_order_relaxed);
  stats().exported_bytes.fetch_sub(it->second, std::memory_order_relaxed);
  exported_.erase(it);
  for (int j = 0; j < nprocs_; ++j)
    if (j != proc_) send_fd(j, kFreeSeg, id, 0, -1);
}

std::vector<std::pair<uint64_t, uint64_t>> ShmFabric::mapped_by_owner() const {
  std::vector<std::pair<uint64_t, uint64_t>> out(nprocs_, {0, 0});
  std::shared_lock<std::shared_mutex> lock(map_mu_);
  for (const auto& [key, seg] : mapped_) {
    out[key.first].first += 1;
    out[key.first].second += seg.second;
  }
  return out;
}

void ShmFabric::set_device_procs(const std::vector<int64_t>& devices, const std::vector<int>& procs,
                                 const std::vector<int>& job_procs, int fabrics) {
  device_proc_.clear();
  for (size_t i = 0; i < devices.size() && i < procs.size(); ++i)
    device_proc_[devices[i]] = procs[i];
  job_procs_ = job_procs;
  fabrics_ = fabrics;
}

std::string ShmFabric::across_fabrics_hint() const {
  if (fabrics_ <= 1) return {};
  return " This job spans " + std::to_string(fabrics_) +
         " fabrics (hosts), and a collective across them runs here as its steps within this "
         "host (psum as psum_scatter, then all_gather): a rank missing here may itself be "
         "waiting for a process on another host, which that host's processes name.";
}

int ShmFabric::job_proc(int proc) const {
  return proc >= 0 && static_cast<size_t>(proc) < job_procs_.size() ? job_procs_[proc] : proc;
}

std::string ShmFabric::ranks_where(const std::vector<int>& ranks, const int64_t* member_parts,
                                   const int64_t* device_ids) const {
  if (!member_parts || !device_ids) return {};
  std::string out;
  for (int r : ranks) {
    const int64_t dev = device_ids[member_parts[r]];
    const int p = device_proc(dev);
    out += (out.empty() ? "rank " : ", rank ") + std::to_string(r) + " (device " +
           std::to_string(dev) + (p < 0 ? "" : ", process " + std::to_string(job_proc(p))) + ")";
  }
  return out;
}

int ShmFabric::device_proc(int64_t device) const {
  auto it = device_proc_.find(device);
  return it == device_proc_.end() ? -1 : it->second;
}

bool ShmFabric::peer_alive(int proc) const {
  return alive_ && alive_[proc].load(std::memory_order_acquire);
}

std::string ShmFabric::dead_peers() const {
  std::string s;
  for (int j = 0; j < nprocs_; ++j)
    if (j != proc_ && !peer_alive(j)) s += (s.empty() ? "" : ", ") + std::to_string(job_proc(j));
  return s;
}

std::string ShmFabric::left_peers() const {
  std::string s;
  for (int j = 0; j < nprocs_; ++j)
    if (j != proc_ && left_ && left_[j].load(std::memory_order_acquire))
      s += (s.empty() ? "" : ", ") + std::to_string(job_proc(j));
  return s;
}

char* ShmFabric::translate(int proc, uint64_t seg, uint64_t off, uint64_t bytes,
                           Clock::time_point deadline, std::string* err) {
  const auto key = std::make_pair(proc, seg);
  {
    std::shared_lock<std::shared_mutex> lock(map_mu_);
    auto it = mapped_.find(key);
    if (it != mapped_.end()) {
      if (off + bytes > it->second.second) {
        *err = "a peer's buffer lies outside its segment (internal error)";
        return nullptr;
      }
      return it->second.first + off;
    }
  }
  // Not mapped yet: the owner sent it just now (on_use, or a segment younger than the
  // allocator thread's last round); the receiver thread maps it. Counted as a registration on
  // the critical path.
  const auto t0 = Clock::now();
  std::unique_lock<std::shared_mutex> lock(map_mu_);
  auto it = mapped_.end();
  map_cv_.wait_until(lock, deadline, [&] {
    it = mapped_.find(key);
    return it != mapped_.end() || !peer_alive(proc) || map_errors_.count(key);
  });
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  stats().reg_critical.fetch_add(1, std::memory_order_relaxed);
  stats().reg_critical_ns.fetch_add(ns, std::memory_order_relaxed);
  if (it == mapped_.end() && map_errors_.count(key)) {
    *err = map_errors_[key];
    return nullptr;
  }
  if (it == mapped_.end()) {
    *err = "segment " + std::to_string(seg) + " of process " + std::to_string(job_proc(proc)) +
           (peer_alive(proc) ? " was never registered here (timed out)"
                             : ": the process disconnected (exited or killed)");
    return nullptr;
  }
  if (off + bytes > it->second.second) {
    *err = "a peer's buffer lies outside its segment (internal error)";
    return nullptr;
  }
  return it->second.first + off;
}

void ShmFabric::receiver_main() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);  // signals belong to the application's threads
  const bool prefault = prefault_enabled();
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (int j = 0; j < nprocs_; ++j)
    if (j != proc_) {
      fds.push_back(pollfd{links_[j], POLLIN, 0});
      who.push_back(j);
    }
  while (!fds.empty()) {
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "strata_jax: fabric receiver: poll: %s\n", strerror(errno));
      return;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      LinkMsg m{};
      int fd = -1;
      ssize_t n = (fds[i].revents & POLLIN) ? recv_msg(fds[i].fd, &m, &fd) : 0;
      if (n <= 0) {  // closed: the peer exited or was killed
        alive_[who[i]].store(false, std::memory_order_release);
        {
          std::lock_guard<std::shared_mutex> lock(map_mu_);  // waiters re-check liveness
        }
        map_cv_.notify_all();
        fds.erase(fds.begin() + i);
        who.erase(who.begin() + i);
        --i;
        continue;
      }
      if (m.type == kBye) {  // read before the close that follows it on the same link
        left_[who[i]].store(true, std::memory_order_release);
        continue;
      }
      if (m.type == kNewSeg && fd >= 0) {
        void* base = mmap(nullptr, m.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (base == MAP_FAILED) {
          // A collective waiting for this segment fails at once with this (translate), not at
          // the timeout. ENOMEM here is nearly always vm.max_map_count (maps per process).
          const int e = errno;
          std::string why = "mapping segment " + std::to_string(m.id) + " (" +
                            std::to_string(m.size >> 20) + " MiB) of process " +
                            std::to_string(who[i]) + " failed: " + strerror(e);
          if (e == ENOMEM)
            why +=
                " (the process may have reached vm.max_map_count, its limit of memory maps; "
                "raise it as root: sysctl -w vm.max_map_count=N)";
          std::fprintf(stderr, "strata_jax: %s\n", why.c_str());
          {
            std::lock_guard<std::shared_mutex> lock(map_mu_);
            map_errors_[{who[i], m.id}] = why;
          }
          map_cv_.notify_all();
          continue;
        }
#ifdef MADV_POPULATE_WRITE
        if (prefault) madvise(base, m.size, MADV_POPULATE_WRITE);
#endif
        {
          std::lock_guard<std::shared_mutex> lock(map_mu_);
          mapped_[{who[i], m.id}] = {static_cast<char*>(base), m.size};
        }
        map_cv_.notify_all();
#ifdef MADV_POPULATE_WRITE
        // on_alloc: a segment the owner made and faulted in ahead of demand gets its page-table
        // entries here too, now (after it is usable), so no collective takes a fault on it.
        if (!prefault && mode_ == RegMode::kOnAlloc && all_resident(base, m.size))
          madvise(base, m.size, MADV_POPULATE_WRITE);
#endif
        stats().mapped_segments.fetch_add(1, std::memory_order_relaxed);
        stats().mapped_bytes.fetch_add(m.size, std::memory_order_relaxed);
      } else if (m.type == kFreeSeg) {
        std::lock_guard<std::shared_mutex> lock(map_mu_);
        auto it = mapped_.find({who[i], m.id});
        if (it != mapped_.end()) {
          munmap(it->second.first, it->second.second);
          stats().mapped_segments.fetch_sub(1, std::memory_order_relaxed);
          stats().mapped_bytes.fetch_sub(it->second.second, std::memory_order_relaxed);
          mapped_.erase(it);
        }
      } else if (fd >= 0) {
        close(fd);
      }
    }
  }
}

}  // namespace strata
