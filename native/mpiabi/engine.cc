// strata's engine for XLA's MPI collectives (see engine.h and engine_api.h).
#include "mpiabi/engine.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <complex>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "coll/collectives.h"
#include "coll/kernels.h"
#include "common/ops.h"
#include "common/settings.h"
#include "fabric/op_stats.h"
#include "fabric/shm.h"
#include "fabric/shm_ll.h"
#include "fabric/stats.h"
#include "mpiabi/p2p.h"
#include "xla/ffi/api/c_api.h"

// The engine's objects, opaque to the library (engine_api.h).
struct StrataMpiComm {
  uint64_t ctx = 0;  // the communicator's context: the rendezvous group of its calls
  int rank = 0, size = 1, color = 0;
  bool predefined = false;       // MPI_COMM_WORLD / MPI_COMM_SELF: never freed
  std::vector<int> members;      // world rank of each rank
  std::vector<int64_t> devices;  // global device id of each rank
  std::vector<int64_t> parts;    // 0..size-1 (Placement::member_parts)
  std::vector<int> procs;        // process index in this fabric of each rank (-1: elsewhere)
  // Collective calls made on it: the call's number is its key on the fabric. XLA runs the
  // collectives of a communicator one at a time, in program order.
  std::atomic<uint64_t> calls{0};
  std::mutex mu;                         // guards sent/received
  std::vector<uint64_t> sent, received;  // messages per peer rank (point to point)
};

struct StrataMpiRequest {
  bool is_send = false;
  StrataMpiComm* comm = nullptr;
  strata::mpiabi::P2pSend send;  // a send's posted slot
  strata::mpiabi::P2pKey key;    // a receive's expected message
  void* buf = nullptr;
  uint64_t bytes = 0;
  const char* what = "";
};

namespace strata {
namespace mpiabi {
namespace {

// The kind of an engine call (common/ops.h's STRATA_ENGINE_CALLS), which ranks compare at
// arrival.
constexpr int32_t kind_of(EngineCall call) { return static_cast<int32_t>(call); }

struct State {
  std::mutex mu;
  bool attached = false, configured = false, initialized = false, finalized = false;
  bool world_set = false;
  int rank = -1, size = 0;
  StrataMpiComm* world = nullptr;  // made at configure, filled at set_world
  StrataMpiComm* self = nullptr;
  std::atomic<uint64_t> comms{0};  // communicators made by splits, live
};
State& st() {
  static State* s = new State();  // never destroyed: XLA frees communicators after exit starts
  return *s;
}

thread_local std::string t_error;

// Why the last MPI_Comm_split failed (XLA does not check its result and goes on with a null
// communicator, so the calls on it repeat the reason). Guarded by State::mu.
std::string g_split_error;

int fail(int cls, const std::string& msg) {
  t_error = msg;
  stats().failures.fetch_add(1, std::memory_order_relaxed);
  if (msg.find("timed out") != std::string::npos) {
    stats().timeouts.fetch_add(1, std::memory_order_relaxed);
    t_error += timeout_hint();
  }
  return cls;
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xBF58476D1CE4E5B9ull;
}

constexpr uint64_t kWorldSalt = 0x5354524154414D50ull;  // "STRATAMP": apart from custom calls

Placement placement(const StrataMpiComm& c) {
  Placement pl;
  pl.group = c.color;
  pl.rank = c.rank;
  pl.size = c.size;
  pl.partition = c.members[c.rank];
  pl.device = c.devices[c.rank];
  pl.comm = c.ctx;
  pl.member_parts = c.parts.data();
  pl.device_ids = c.devices.data();
  return pl;
}

// Whether a call on `c` can run now; 0, or the error.
int ready(const StrataMpiComm* c, const char* name) {
  State& s = st();
  if (!c) {
    std::lock_guard<std::mutex> lock(s.mu);
    return fail(kEngineErrComm,
                std::string("strata_jax ") + name + ": a null communicator" +
                    (g_split_error.empty()
                         ? std::string()
                         : " (XLA goes on after MPI_Comm_split failed: " + g_split_error + ")"));
  }
  if (!s.world_set)
    return fail(kEngineErrNotInit,
                std::string("strata_jax ") + name +
                    ": the engine has no fabric yet: strata_jax.init() connects it before the "
                    "first collective (call it before any other use of jax)");
  if (c->size > 1 && !ShmFabric::active())
    return fail(kEngineErrNotInit,
                std::string("strata_jax ") + name + ": the shared-memory fabric is not connected");
  for (int p : c->procs)
    if (p < 0)
      return fail(kEngineErrUnsupported,
                  std::string("strata_jax ") + name +
                      ": this communicator spans processes of another fabric (host), which "
                      "strata's engine does not reach: run with `--engine gloo` "
                      "(STRATA_ENGINE=gloo) across hosts");
  return 0;
}

// Ranges [a, a+na) and [b, b+nb) overlap.
bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return na && nb && x < y + nb && y < x + na;
}

// A private copy of an input that overlaps its output (MPI_IN_PLACE, or XLA handing the same
// buffer twice): peers read the input while this rank writes its output. From posix_memalign,
// so that a preloaded allocator serves it from a fabric segment (zero-copy for the peers).
struct Scratch {
  void* p = nullptr;
  explicit Scratch(const void* src, size_t bytes) {
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) p = nullptr;
    if (p && bytes) std::memcpy(p, src, bytes);
  }
  ~Scratch() { std::free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// A complex product, which strata's reduce kernels do not compute (their complex types sum
// only): every rank reduces the whole product into its own output, folding the ranks in order
// 0..n-1 (as the kernels do: every rank gets bitwise the same result). `first`/`count`: the
// output's elements within the inputs.
template <class T>
void complex_prod_fold(Team& t, size_t first, size_t count) {
  T* out = static_cast<T*>(t.peer_out(t.rank()));
  const T* s0 = static_cast<const T*>(t.peer_in(0)) + first;
  for (size_t i = 0; i < count; ++i) out[i] = s0[i];
  for (int j = 1; j < t.size(); ++j) {
    const T* sj = static_cast<const T*>(t.peer_in(j)) + first;
    for (size_t i = 0; i < count; ++i) out[i] = out[i] * sj[i];
  }
}

bool is_complex(int32_t dtype) {
  return dtype == XLA_FFI_DataType_C64 || dtype == XLA_FFI_DataType_C128;
}

// The product of complex elements (complex_prod_fold), for the all-reduce (first 0) and the
// reduce-scatter (first: this rank's block).
std::string complex_prod(Team& t, int32_t dtype, size_t first, size_t count) {
  if (dtype == XLA_FFI_DataType_C64)
    complex_prod_fold<std::complex<float>>(t, first, count);
  else
    complex_prod_fold<std::complex<double>>(t, first, count);
  return {};
}

// A reduction call can go on: its element type and op (a ReduceOp code of common/ops.h; MPI has
// no mean) are ones this engine reduces, and its communicator is there (ready); 0, or the error.
int check_reduce(const StrataMpiComm* c, const char* name, int32_t dtype, int32_t op) {
  if (op < 0 || op >= kReductions || op == reduce_code::mean)
    return fail(kEngineErrArg, std::string("strata_jax ") + name + ": unsupported reduction op " +
                                   std::to_string(op));
  if (!(op == reduce_code::prod && is_complex(dtype)) &&
      !(dtype_size(dtype) && reduce_supported(dtype, static_cast<ReduceOp>(op))))
    return fail(kEngineErrArg, std::string("strata_jax ") + name + ": cannot reduce elements of " +
                                   (dtype ? dtype_name(dtype) : "an untyped datatype") +
                                   (op == reduce_code::prod ? " by product" : ""));
  return c ? 0 : ready(c, name);
}

bool peers_publish_outputs(const Team& t) {
  return t.peer_out((t.rank() + 1) % t.size()) != nullptr;
}

// Joins the call on the fabric (the low-latency path when `may_ll` and small enough, else the
// general rendezvous), arrives with this rank's buffers, runs body(Team&) -> error, departs.
template <class Body>
int run(StrataMpiComm* c, const char* name, OpDesc d, const void* in, void* out, bool may_ll,
        Body body) {
  if (int rc = ready(c, name)) return rc;
  ShmFabric* f = ShmFabric::active();
  d.name = name;
  const Placement pl = placement(*c);
  // The call's number on the communicator is its key: the fabric takes a new execution for
  // every new run id on (device, communicator), so call k has execution number k everywhere.
  const int64_t run_id = static_cast<int64_t>(c->calls.fetch_add(1, std::memory_order_relaxed)) + 1;
  stats().calls.fetch_add(1, std::memory_order_relaxed);
  OpTimer timer(name, d.in_bytes, d.algo);
  std::string err;
  if (may_ll) {
    auto ll = ShmLlTeam::join(f, pl, run_id, 0, d, d.in_bytes, name, &err);
    if (!err.empty()) return fail(kEngineErrFailed, err);
    if (ll) {
      err = ll->arrive(d, in, out);
      OpTimer::arrived();
      if (err.empty()) err = body(*ll);
      std::string derr = ll->depart();
      if (err.empty()) err = derr;
      return err.empty() ? 0 : fail(kEngineErrFailed, err);
    }
  }
  auto team = f->join(pl, run_id, 0, name, &err);
  if (!team) return fail(kEngineErrFailed, err);
  prepare_output(out, d.out_bytes);
  err = team->arrive(d, in, out);
  OpTimer::arrived();
  if (!err.empty()) return fail(kEngineErrFailed, err);
  err = body(*team);
  std::string derr = team->depart();
  if (err.empty()) err = derr;
  return err.empty() ? 0 : fail(kEngineErrFailed, err);
}

// A collective call of descriptor `d` (its byte counts: the input's and the output's). On a
// communicator of one rank it is a copy of the input to the output; elsewhere an input that
// overlaps its output is read from a private copy (Scratch), and `body` runs on the team (run),
// counting what each peer reads of this rank (`peer_bytes`: zero-copy or through a bounce).
template <class Body>
int collective(StrataMpiComm* c, const char* name, const OpDesc& d, const void* in, void* out,
               uint64_t peer_bytes, Body body) {
  if (c->size == 1) {
    if (in != out && d.out_bytes) std::memmove(out, in, d.out_bytes);
    c->calls.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }
  std::unique_ptr<Scratch> copy;
  if (overlap(in, d.in_bytes, out, d.out_bytes)) {
    copy = std::make_unique<Scratch>(in, d.in_bytes);
    if (!copy->p)
      return fail(kEngineErrFailed, std::string("strata_jax ") + name + ": out of memory");
    in = copy->p;
  }
  return run(c, name, d, in, out, true, [&](Team& t) -> std::string {
    (t.zero_copy() ? stats().zero_copy_bytes : stats().peer_bounce_bytes)
        .fetch_add(peer_bytes * (t.size() - 1), std::memory_order_relaxed);
    return body(t);
  });
}

// ---- the table's functions ----

int e_init(int* rank, int* size) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.configured)
    return fail(kEngineErrNotInit,
                "strata_jax's MPI engine (libstrata_mpi.so) is not configured: strata_jax.init() "
                "configures it before JAX creates its backend. Call strata_jax.init() before "
                "any other use of jax, or choose another engine (STRATA_ENGINE=gloo)");
  s.initialized = true;
  *rank = s.rank;
  *size = s.size;
  return 0;
}

int e_finalize() {
  st().finalized = true;  // nothing to tear down: the fabric outlives XLA's communicators
  return 0;
}

StrataMpiComm* e_world() { return st().world; }
StrataMpiComm* e_self() { return st().self; }

int e_comm_rank(StrataMpiComm* c, int* rank) {
  if (!c) return fail(kEngineErrComm, "MPI_Comm_rank: a null communicator");
  *rank = c->rank;
  return 0;
}

int e_comm_size(StrataMpiComm* c, int* size) {
  if (!c) return fail(kEngineErrComm, "MPI_Comm_size: a null communicator");
  *size = c->size;
  return 0;
}

// MPI_Comm_split: every rank of the parent contributes (color, key); the ranks of one color
// form the new communicator, ordered by (key, parent rank).
int e_comm_split(StrataMpiComm* parent, int color, int key, StrataMpiComm** out) {
  *out = nullptr;
  const char* name = "engine.comm_split";
  if (!parent) return fail(kEngineErrComm, "MPI_Comm_split: a null communicator");
  const int n = parent->size;
  std::vector<int32_t> all(2 * static_cast<size_t>(n));
  const uint64_t number = parent->calls.load(std::memory_order_relaxed);
  if (n == 1) {
    all[0] = color;
    all[1] = key;
    parent->calls.fetch_add(1, std::memory_order_relaxed);
  } else {
    int32_t mine[2] = {color, key};
    OpDesc d;
    d.kind = kind_of(EngineCall::comm_split);
    d.dtype = XLA_FFI_DataType_S32;
    d.in_bytes = sizeof(mine);
    d.out_bytes = sizeof(mine) * n;
    d.may_stage = true;
    int rc = run(parent, name, d, mine, all.data(), true,
                 [&](Team& t) { return all_gather(t, sizeof(mine), peers_publish_outputs(t)); });
    if (rc) {
      // MPI_Comm_split is collective over the parent (XLA splits MPI_COMM_WORLD): a program
      // on a subset of the processes leaves the others out, and the split cannot complete.
      std::lock_guard<std::mutex> lock(st().mu);
      g_split_error = t_error +
                      " [XLA's MPI path splits MPI_COMM_WORLD, so every process must run a "
                      "program with collectives; a program on a subset of the processes "
                      "needs --engine gloo]";
      t_error = g_split_error;
      return rc;
    }
  }
  if (color < 0) return 0;                 // MPI_UNDEFINED: not a member of any new communicator
  std::vector<std::pair<int, int>> order;  // (key, parent rank) of the members
  for (int j = 0; j < n; ++j)
    if (all[2 * j] == color) order.emplace_back(all[2 * j + 1], j);
  std::sort(order.begin(), order.end());
  auto* c = new StrataMpiComm();
  c->ctx = mix(mix(mix(parent->ctx, number), static_cast<uint64_t>(color)), 0x53504C4954ull);
  c->size = static_cast<int>(order.size());
  c->color = color;
  for (int r = 0; r < c->size; ++r) {
    const int j = order[r].second;
    if (j == parent->rank) c->rank = r;
    c->members.push_back(parent->members[j]);
    c->devices.push_back(parent->devices[j]);
    c->procs.push_back(parent->procs[j]);
    c->parts.push_back(r);
  }
  c->sent.assign(c->size, 0);
  c->received.assign(c->size, 0);
  st().comms.fetch_add(1, std::memory_order_relaxed);
  *out = c;
  return 0;
}

int e_comm_free(StrataMpiComm* c) {
  if (!c || c->predefined) return 0;
  st().comms.fetch_sub(1, std::memory_order_relaxed);
  delete c;
  return 0;
}

int e_all_reduce(StrataMpiComm* c, const void* in, void* out, uint64_t count, int32_t dtype,
                 int32_t eb, int32_t op) {
  const char* name = "engine.all_reduce";
  if (int rc = check_reduce(c, name, dtype, op)) return rc;
  const uint64_t bytes = count * static_cast<uint64_t>(eb);
  OpDesc d;
  d.kind = kind_of(EngineCall::all_reduce);
  d.dtype = dtype;
  d.reduce = op;
  d.in_bytes = d.out_bytes = bytes;
  const bool complex_prod_call = op == reduce_code::prod && is_complex(dtype);
  d.algo = !complex_prod_call && use_two_shot(bytes) ? 1 : 0;
  d.may_stage = bytes <= kLlMaxBytes;
  return collective(c, name, d, in, out, bytes, [&](Team& t) -> std::string {
    if (complex_prod_call) {
      stats().one_shot.fetch_add(1, std::memory_order_relaxed);
      return complex_prod(t, dtype, 0, count);
    }
    // Every rank follows rank 0's choice (as AllReduceImpl does).
    const bool two =
        two_shot_for(t.size(), bytes) && t.peer_desc(0).algo == 1 && peers_publish_outputs(t);
    (two ? stats().two_shot : stats().one_shot).fetch_add(1, std::memory_order_relaxed);
    return all_reduce(t, dtype, static_cast<ReduceOp>(op), count, two);
  });
}

int e_all_gather(StrataMpiComm* c, const void* in, void* out, uint64_t count, int32_t dtype,
                 int32_t eb) {
  const char* name = "engine.all_gather";
  const uint64_t bytes = count * static_cast<uint64_t>(eb);
  if (!c) return ready(c, name);
  OpDesc d;
  d.kind = kind_of(EngineCall::all_gather);
  d.dtype = dtype ? dtype : XLA_FFI_DataType_U8;
  d.in_bytes = bytes;
  d.out_bytes = bytes * c->size;
  d.may_stage = true;
  return collective(c, name, d, in, out, bytes, [&](Team& t) -> std::string {
    return all_gather(t, bytes, peers_publish_outputs(t));
  });
}

int e_reduce_scatter(StrataMpiComm* c, const void* in, void* out, uint64_t count, int32_t dtype,
                     int32_t eb, int32_t op) {
  const char* name = "engine.reduce_scatter";
  if (int rc = check_reduce(c, name, dtype, op)) return rc;
  const uint64_t out_bytes = count * static_cast<uint64_t>(eb);
  const uint64_t in_bytes = out_bytes * c->size;
  OpDesc d;
  d.kind = kind_of(EngineCall::reduce_scatter);
  d.dtype = dtype;
  d.reduce = op;
  d.in_bytes = in_bytes;
  d.out_bytes = out_bytes;
  d.may_stage = true;
  return collective(c, name, d, in, out, out_bytes, [&](Team& t) -> std::string {
    if (op == reduce_code::prod && is_complex(dtype))
      return complex_prod(t, dtype, count * t.rank(), count);
    return reduce_scatter(t, dtype, static_cast<ReduceOp>(op), count);
  });
}

int e_barrier(StrataMpiComm* c) {
  const char* name = "engine.barrier";
  if (!c) return ready(c, name);
  if (c->size == 1) return 0;
  OpDesc d;
  d.kind = kind_of(EngineCall::barrier);
  d.dtype = XLA_FFI_DataType_U8;
  d.may_stage = true;
  return run(c, name, d, nullptr, nullptr, true, [](Team&) { return std::string(); });
}

// Where a peer of a point-to-point call is; 0, or the error.
int peer_of(StrataMpiComm* c, int peer, const char* what, const char* role) {
  if (int rc = ready(c, what)) return rc;
  if (peer < 0 || peer >= c->size)
    return fail(kEngineErrArg, std::string("strata_jax ") + what + ": " + role + " rank " +
                                   std::to_string(peer) + " is not in the communicator of " +
                                   std::to_string(c->size));
  return 0;
}

// The request of a send to `peer` (is_send) or a receive from it, keyed by the message's number
// on the communicator: the sender's count of its sends to that rank, the receiver's of its
// receives from it (both in program order).
std::unique_ptr<StrataMpiRequest> new_request(StrataMpiComm* c, bool is_send, int peer, int tag,
                                              const char* what, uint64_t bytes) {
  auto r = std::make_unique<StrataMpiRequest>();
  r->is_send = is_send;
  r->comm = c;
  r->what = what;
  r->bytes = bytes;
  std::lock_guard<std::mutex> lock(c->mu);
  r->key = is_send ? P2pKey{c->ctx, c->sent[peer]++, c->rank, peer, tag}
                   : P2pKey{c->ctx, c->received[peer]++, peer, c->rank, tag};
  return r;
}

int e_isend(StrataMpiComm* c, const void* buf, uint64_t bytes, int dest, int tag, const char* what,
            StrataMpiRequest** req) {
  *req = nullptr;
  if (int rc = peer_of(c, dest, what, "destination")) return rc;
  std::string err;
  P2p* p2p = P2p::get(ShmFabric::active(), &err);
  if (!p2p) return fail(kEngineErrFailed, std::string("strata_jax ") + what + ": " + err);
  auto r = new_request(c, true, dest, tag, what, bytes);
  err = p2p->post_send(r->key, c->procs[dest], c->devices[dest], buf, bytes, what, &r->send);
  if (!err.empty()) return fail(kEngineErrFailed, err);
  *req = r.release();
  return 0;
}

int e_irecv(StrataMpiComm* c, void* buf, uint64_t bytes, int source, int tag, const char* what,
            StrataMpiRequest** req) {
  *req = nullptr;
  if (int rc = peer_of(c, source, what, "source")) return rc;
  auto r = new_request(c, false, source, tag, what, bytes);
  r->buf = buf;
  *req = r.release();
  return 0;
}

int e_wait(StrataMpiRequest* req, int* source, int* tag, uint64_t* bytes) {
  std::unique_ptr<StrataMpiRequest> r(req);
  if (!r) return 0;
  std::string err;
  P2p* p2p = P2p::get(ShmFabric::active(), &err);
  if (!p2p) return fail(kEngineErrFailed, std::string("strata_jax ") + r->what + ": " + err);
  const bool sendrecv = std::strcmp(r->what, "MPI_Sendrecv") == 0;
  StrataMpiComm* c = r->comm;
  if (r->is_send) {
    // A Sendrecv is counted once, by its receive (the half that waits for data).
    std::unique_ptr<OpTimer> timer;
    if (!sendrecv) {
      stats().calls.fetch_add(1, std::memory_order_relaxed);
      timer = std::make_unique<OpTimer>("engine.send", r->bytes, 0);
    }
    err = p2p->wait_send(r->send);
    if (source) *source = c->rank;
    if (tag) *tag = r->key.tag;
    if (bytes) *bytes = r->bytes;
  } else {
    stats().calls.fetch_add(1, std::memory_order_relaxed);
    OpTimer timer(sendrecv ? "engine.sendrecv" : "engine.recv", r->bytes, 0);
    uint64_t got = 0;
    const int src = r->key.src;
    err = p2p->recv(r->key, c->procs[src], c->devices[src], r->buf, r->bytes, r->what, &got);
    OpTimer::arrived();
    if (source) *source = src;
    if (tag) *tag = r->key.tag;
    if (bytes) *bytes = got;
  }
  return err.empty() ? 0 : fail(kEngineErrFailed, err);
}

const char* e_last_error() { return t_error.c_str(); }

const StrataMpiEngine kTable = {
    STRATA_MPI_ENGINE_VERSION,
    e_init,
    e_finalize,
    e_world,
    e_self,
    e_comm_rank,
    e_comm_size,
    e_comm_split,
    e_comm_free,
    e_all_reduce,
    e_all_gather,
    e_reduce_scatter,
    e_barrier,
    e_isend,
    e_irecv,
    e_wait,
    e_last_error,
};

}  // namespace

const StrataMpiEngine* engine_table() { return &kTable; }

void engine_configure(int rank, int size) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.configured) return;  // the communicators XLA holds keep the first world
  s.rank = rank;
  s.size = size;
  auto* w = new StrataMpiComm();
  w->ctx = mix(kWorldSalt, static_cast<uint64_t>(size));
  w->rank = rank;
  w->size = size;
  w->predefined = true;
  for (int r = 0; r < size; ++r) {
    w->members.push_back(r);
    w->parts.push_back(r);
  }
  w->devices.assign(size, -1);
  w->procs.assign(size, -1);
  w->sent.assign(size, 0);
  w->received.assign(size, 0);
  auto* self = new StrataMpiComm();
  self->ctx = mix(mix(w->ctx, 0x53454C46ull), static_cast<uint64_t>(rank));
  self->rank = 0;
  self->size = 1;
  self->predefined = true;
  self->members = {rank};
  self->parts = {0};
  self->devices = {-1};
  self->procs = {-1};
  self->sent = {0};
  self->received = {0};
  s.world = w;
  s.self = self;
  s.configured = true;
}

std::string engine_set_world(const std::vector<int64_t>& devices, const std::vector<int>& procs) {
  State& s = st();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.configured) return "the engine is not configured (engine_configure first)";
    if (devices.size() != static_cast<size_t>(s.size) || procs.size() != devices.size())
      return "one device and one process index per world rank expected";
    s.world->devices = devices;
    s.world->procs = procs;
    s.self->devices = {devices[s.rank]};
    s.self->procs = {procs[s.rank]};
    s.world_set = true;
  }
  // The point-to-point box, exported to every peer now (off the critical path).
  if (ShmFabric* f = ShmFabric::active()) {
    std::string err;
    if (!P2p::get(f, &err)) return err;
  }
  return {};
}

bool engine_attach(const char* library, std::string* why) {
  void* h = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
  if (!h) {
    *why = std::string(library) + " is not loaded in this process";
    return false;
  }
  auto attach = reinterpret_cast<StrataMpiAttachFn>(dlsym(h, "strata_mpi_attach"));
  if (!attach) {
    *why = std::string(library) + " has no strata_mpi_attach: it is not strata's MPI library";
    dlclose(h);
    return false;
  }
  if (attach(&kTable) != 0) {
    *why = std::string(library) + " refused the engine (a library of another strata_jax build)";
    dlclose(h);
    return false;
  }
  st().attached = true;
  return true;  // the handle stays open: the library holds our table
}

EngineInfo engine_info() {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  EngineInfo i;
  i.attached = s.attached;
  i.configured = s.configured;
  i.initialized = s.initialized;
  i.finalized = s.finalized;
  i.rank = s.rank;
  i.size = s.size;
  i.communicators = s.comms.load(std::memory_order_relaxed);
  return i;
}

}  // namespace mpiabi
}  // namespace strata
