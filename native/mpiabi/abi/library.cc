// libstrata_mpi.so: the MPItrampoline C ABI (MPI ABI 2.9) over strata's engine.
//
// jaxlib carries MPItrampoline, which dlopens the library named by MPITRAMPOLINE_LIB when jaxlib
// is loaded (`import jax`), copies every MPIABI_<NAME> constant and resolves every MPIABI_<Name>
// function; with jax_cpu_collectives_implementation="mpi", XLA:CPU then runs its cross-process
// collectives through them. This library is that MPI: it decodes the calls (handles, datatypes,
// ops, statuses), forwards them to strata's engine (engine_api.h), which strata_jax's native
// extension attaches when it is loaded, and turns the engine's failures into error codes whose
// MPI_Error_string is strata's message (XLA puts it into the error it raises).
//
// What XLA:CPU calls (jaxlib 0.10.2, traced): MPI_Init_thread, Comm_rank/size, Is_thread_main,
// Comm_split, Allreduce, Allgather, Reduce_scatter, Sendrecv (its all-to-all), Irecv/Isend/Wait
// (its collective-permute), Error_string, Finalize, Comm_free; MPItrampoline itself calls
// Get_library_version. Those, and the few that complete the same family (Send, Recv, Waitall,
// Barrier, Reduce_scatter_block, the queries), are implemented here; every other function of
// the ABI is a stub that fails naming itself (stubs.cc).
//
// Two rules of XLA over a real MPI do not apply: MPI_Is_thread_main is true on every thread (the
// engine is thread-safe: XLA may open a communicator on any of its threads, so async dispatch
// stays on), and MPI_Finalize only marks the end (XLA's communicators, freed after it at exit,
// are freed quietly: the process exits 0).
//
// Constructors: none but static data. The library is loaded into every process that imports jax
// with MPITRAMPOLINE_LIB set, and nothing runs until MPI_Init_thread.
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "common/ops.h"
#include "mpiabi/abi/delegate.h"
#include "mpiabi/engine_api.h"
#include "xla/ffi/api/c_api.h"

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using Handle = uintptr_t;
// Handle encoding: datatypes and ops are indices into the tables of constants.inc plus a base;
// communicators are the engine's objects, except the predefined ones; requests are the engine's.
constexpr Handle kDatatypeBase = 0x5d00;
constexpr Handle kOpBase = 0x5e00;
constexpr Handle kCommWorld = 0x5c01, kCommSelf = 0x5c02;

struct Datatype {
  const char* name;
  int bytes;
  int32_t xla;  // XLA_FFI_DataType_INVALID: bytes to move, never reduced
};
constexpr Datatype kDatatypes[] = {
#define STRATA_MPI_INT(N, V)
#define STRATA_MPI_DATATYPE(I, N, B, X) {"MPI_" #N, B, XLA_FFI_DataType_##X},
#define STRATA_MPI_OP(I, N)
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP
};
constexpr int kNumDatatypes = sizeof(kDatatypes) / sizeof(kDatatypes[0]);

constexpr const char* kOps[] = {
#define STRATA_MPI_INT(N, V)
#define STRATA_MPI_DATATYPE(I, N, B, X)
#define STRATA_MPI_OP(I, N) "MPI_" #N,
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP
};
constexpr int kNumOps = sizeof(kOps) / sizeof(kOps[0]);

// The standard's error classes, for MPI_Error_string of a code the library did not make.
struct ErrName {
  const char* name;
  int value;
};
constexpr ErrName kErrNames[] = {
#define STRATA_MPI_INT(N, V) {"MPI_" #N, V},
#define STRATA_MPI_DATATYPE(I, N, B, X)
#define STRATA_MPI_OP(I, N)
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP
};

// Sentinels: addresses nothing else can have.
char g_sentinel[8];

}  // namespace

// ---- the exported constants ----
extern "C" {
#define STRATA_MPI_INT(N, V) __attribute__((visibility("default"))) int MPIABI_##N = V;
#define STRATA_MPI_DATATYPE(I, N, B, X) \
  __attribute__((visibility("default"))) uintptr_t MPIABI_##N = kDatatypeBase + I;
#define STRATA_MPI_OP(I, N) \
  __attribute__((visibility("default"))) uintptr_t MPIABI_##N = kOpBase + I;
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP

#define STRATA_MPI_PTR(N, V) __attribute__((visibility("default"))) void* MPIABI_##N = V;
#define STRATA_MPI_HANDLE(N, V) __attribute__((visibility("default"))) uintptr_t MPIABI_##N = V;
#define STRATA_MPI_SENTINEL(i) (&g_sentinel[i])
#include "mpiabi/abi/handles.inc"
#undef STRATA_MPI_PTR
#undef STRATA_MPI_HANDLE
#undef STRATA_MPI_SENTINEL
__attribute__((visibility("default"))) int64_t MPIABI_DISPLACEMENT_CURRENT = -54278278;

// Versions MPItrampoline reads: the ABI (major 2, minor >= 9), and this library's own, which it
// prints as "MPIwrapper" (it knows only that name).
__attribute__((visibility("default"))) int mpiabi_version_major = 2;
__attribute__((visibility("default"))) int mpiabi_version_minor = 9;
__attribute__((visibility("default"))) int mpiabi_version_patch = 0;
__attribute__((visibility("default"))) int mpiwrapper_version_major = 0;
__attribute__((visibility("default"))) int mpiwrapper_version_minor = 3;
__attribute__((visibility("default"))) int mpiwrapper_version_patch = 0;
}

STRATA_EXPORT void mpiwrapper_export_fortran_constants_() {}

namespace {

// The layout of MPIABI_Status (40 bytes: the implementation's part, then the three public
// fields at the offsets mpiabi.h gives them).
struct Status {
  uint64_t count_bytes;
  int32_t cancelled;
  int32_t unused[3];
  int32_t source, tag, error;
  int32_t pad;
};
static_assert(sizeof(Status) == 40 && offsetof(Status, source) == 24, "MPIABI_Status layout");

std::atomic<const StrataMpiEngine*> g_engine{nullptr};
std::atomic<bool> g_initialized{false}, g_finalized{false};
std::atomic<int> g_trace{-1};

bool tracing() {
  int t = g_trace.load(std::memory_order_relaxed);
  if (t < 0) {
    const char* e = getenv("STRATA_MPI_TRACE");
    t = e && e[0] && e[0] != '0' ? 1 : 0;
    g_trace.store(t, std::memory_order_relaxed);
  }
  return t != 0;
}

// One stderr line per call: process, thread, CLOCK_MONOTONIC seconds (comparable across the
// processes of one host), then the call.
#define TRACE(...)                                                                       \
  do {                                                                                   \
    if (tracing()) {                                                                     \
      timespec ts_;                                                                      \
      clock_gettime(CLOCK_MONOTONIC, &ts_);                                              \
      fprintf(stderr, "[strata_mpi %d %lx %ld.%09ld] ", static_cast<int>(getpid()),      \
              static_cast<unsigned long>(pthread_self()), static_cast<long>(ts_.tv_sec), \
              static_cast<long>(ts_.tv_nsec));                                           \
      fprintf(stderr, __VA_ARGS__);                                                      \
      fputc('\n', stderr);                                                               \
    }                                                                                    \
  } while (0)

// Messages behind error codes: MPI_Error_string(code) must give the message of the failure
// that returned `code`, possibly on another thread and after other failures, so each failure
// gets a code of its own from a ring (kMsgCodes recent messages).
constexpr int kMsgCodeBase = 1000;
constexpr int kMsgCodes = 64;
constexpr int kMsgBytes = 1024;  // MPIABI_MAX_ERROR_STRING
struct Messages {
  std::mutex mu;
  int next = 0;
  char text[kMsgCodes][kMsgBytes];
  int cls[kMsgCodes];
};
Messages& messages() {
  static Messages* m = new Messages();  // made at the first failure, never freed
  return *m;
}

int record(int cls, const char* msg) {
  Messages& m = messages();
  std::lock_guard<std::mutex> lock(m.mu);
  const int i = m.next;
  m.next = (m.next + 1) % kMsgCodes;
  snprintf(m.text[i], kMsgBytes, "%s", msg);
  m.cls[i] = cls;
  TRACE("error %d: %s", kMsgCodeBase + i, msg);
  return kMsgCodeBase + i;
}

int error_class_value(int engine_cls) {
  switch (engine_cls) {
    case kEngineErrArg:
      return MPIABI_ERR_ARG;
    case kEngineErrComm:
      return MPIABI_ERR_COMM;
    case kEngineErrUnsupported:
      return MPIABI_ERR_UNSUPPORTED_OPERATION;
    default:
      return MPIABI_ERR_OTHER;
  }
}

int fail(int engine_cls, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int fail(int engine_cls, const char* fmt, ...) {
  char buf[kMsgBytes];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return record(error_class_value(engine_cls), buf);
}

// An engine call's result as an MPI error code.
int check(int rc, const StrataMpiEngine* e) {
  if (rc == 0) return 0;
  return record(error_class_value(rc), e->last_error());
}

const StrataMpiEngine* engine(const char* fn, int* rc) {
  const StrataMpiEngine* e = g_engine.load(std::memory_order_acquire);
  if (!e)
    *rc = fail(kEngineErrNotInit,
               "%s: libstrata_mpi.so is strata_jax's engine for XLA's MPI collectives and runs "
               "only in a process that imported strata_jax (which attaches the engine) and "
               "called strata_jax.init(); this one did not. Import strata_jax first, or unset "
               "MPITRAMPOLINE_LIB to use another MPI",
               fn);
  return e;
}

const Datatype* datatype(Handle h) {
  const Handle i = h - kDatatypeBase;
  return h >= kDatatypeBase && i < static_cast<Handle>(kNumDatatypes) && kDatatypes[i].bytes
             ? &kDatatypes[i]
             : nullptr;
}

const char* op_name(Handle h) {
  const Handle i = h - kOpBase;
  return h >= kOpBase && i < static_cast<Handle>(kNumOps) ? kOps[i] : "an unknown op";
}

// The engine's op for an MPI op handle (a reduction of common/ops.h), or -1.
int engine_op(Handle h) {
  if (h == MPIABI_SUM) return strata::reduce_code::sum;
  if (h == MPIABI_MAX) return strata::reduce_code::max;
  if (h == MPIABI_MIN) return strata::reduce_code::min;
  if (h == MPIABI_PROD) return strata::reduce_code::prod;
  return -1;
}

StrataMpiComm* comm_of(const StrataMpiEngine* e, Handle h) {
  if (h == kCommWorld) return e->world();
  if (h == kCommSelf) return e->self();
  return reinterpret_cast<StrataMpiComm*>(h);
}

bool ignored(const void* status) {
  return status == nullptr || status == MPIABI_STATUS_IGNORE || status == MPIABI_STATUSES_IGNORE;
}

void set_status(void* status, int source, int tag, uint64_t bytes) {
  if (ignored(status)) return;
  auto* s = static_cast<Status*>(status);
  memset(s, 0, sizeof(*s));
  s->count_bytes = bytes;
  s->source = source;
  s->tag = tag;
  s->error = MPIABI_SUCCESS;
}

// A typed buffer's size in bytes, or -1 (with *rc) for a bad count or datatype.
int64_t typed_bytes(const char* fn, const char* which, int count, Handle dt, int* rc) {
  const Datatype* d = datatype(dt);
  if (!d) {
    *rc = fail(kEngineErrArg, "%s: %s datatype is not a predefined MPI datatype", fn, which);
    return -1;
  }
  if (count < 0) {
    *rc = fail(kEngineErrArg, "%s: negative %s count %d", fn, which, count);
    return -1;
  }
  return static_cast<int64_t>(count) * d->bytes;
}

}  // namespace

// The stubs' failure (stubs.cc): a message naming the function, once on stderr, and a code whose
// MPI_Error_string repeats it.
__attribute__((visibility("hidden"))) int strata_mpi_unsupported(const char* name) {
  return fail(kEngineErrUnsupported,
              "%s is not implemented by strata_jax's MPI engine (libstrata_mpi.so), which "
              "implements what XLA's collectives call; run this program with another MPI "
              "(MPITRAMPOLINE_LIB naming MPIwrapper's library)",
              name);
}

STRATA_EXPORT int strata_mpi_attach(const StrataMpiEngine* e) {
  if (!e || e->version != STRATA_MPI_ENGINE_VERSION) return 1;
  g_engine.store(e, std::memory_order_release);
  return 0;
}

// ---- start and end ----

STRATA_EXPORT int MPIABI_Init_thread(int* argc, char*** argv, int required, int* provided) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Init_thread(argc, argv, r->thread_multiple, provided);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Init_thread", &rc);
  if (!e) return rc;
  int rank = -1, size = 0;
  if ((rc = check(e->init(&rank, &size), e))) return rc;
  if (provided) *provided = MPIABI_THREAD_MULTIPLE;  // every call is thread-safe
  g_initialized.store(true, std::memory_order_release);
  TRACE("MPI_Init_thread(required %d): rank %d of %d", required, rank, size);
  return 0;
}

STRATA_EXPORT int MPIABI_Init(int* argc, char*** argv) {
  int provided = 0;
  return MPIABI_Init_thread(argc, argv, MPIABI_THREAD_MULTIPLE, &provided);
}

STRATA_EXPORT int MPIABI_Initialized(int* flag) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Initialized(flag);
  *flag = g_initialized.load(std::memory_order_acquire) ? 1 : 0;
  return 0;
}

STRATA_EXPORT int MPIABI_Finalize() {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Finalize();
  TRACE("MPI_Finalize");
  g_finalized.store(true, std::memory_order_release);
  const StrataMpiEngine* e = g_engine.load(std::memory_order_acquire);
  if (e) e->finalize();
  return 0;
}

STRATA_EXPORT int MPIABI_Finalized(int* flag) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Finalized(flag);
  *flag = g_finalized.load(std::memory_order_acquire) ? 1 : 0;
  return 0;
}

STRATA_EXPORT int MPIABI_Query_thread(int* provided) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Query_thread(provided);
  *provided = MPIABI_THREAD_MULTIPLE;
  return 0;
}

STRATA_EXPORT int MPIABI_Is_thread_main(int* flag) {
  *flag = 1;  // no thread is special (XLA asks before opening a communicator on any thread)
  return 0;
}

STRATA_EXPORT int MPIABI_Abort(Handle, int errorcode) {
  fprintf(stderr, "strata_jax MPI_Abort(%d): ending this process\n", errorcode);
  fflush(stderr);
  _exit(errorcode ? errorcode : 1);
}

STRATA_EXPORT int MPIABI_Get_version(int* version, int* subversion) {
  *version = 3;
  *subversion = 1;
  return 0;
}

STRATA_EXPORT int MPIABI_Get_library_version(char* version, int* resultlen) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Get_library_version(version, resultlen);
  const int n =
      snprintf(version, 8192, "strata_jax MPI engine (libstrata_mpi.so, MPI ABI %d.%d.%d)",
               mpiabi_version_major, mpiabi_version_minor, mpiabi_version_patch);
  *resultlen = n;
  return 0;
}

STRATA_EXPORT int MPIABI_Get_processor_name(char* name, int* resultlen) {
  if (gethostname(name, 256) != 0) snprintf(name, 256, "unknown");
  name[255] = 0;
  *resultlen = static_cast<int>(strlen(name));
  return 0;
}

STRATA_EXPORT double MPIABI_Wtime() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

STRATA_EXPORT double MPIABI_Wtick() { return 1e-9; }

STRATA_EXPORT intptr_t MPIABI_Aint_add(intptr_t base, intptr_t disp) { return base + disp; }
STRATA_EXPORT intptr_t MPIABI_Aint_diff(intptr_t a, intptr_t b) { return a - b; }

STRATA_EXPORT int MPIABI_Error_class(int errorcode, int* errorclass) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Error_class(errorcode, errorclass);
  if (errorcode >= kMsgCodeBase && errorcode < kMsgCodeBase + kMsgCodes) {
    Messages& m = messages();
    std::lock_guard<std::mutex> lock(m.mu);
    *errorclass = m.cls[errorcode - kMsgCodeBase];
  } else {
    *errorclass = errorcode;
  }
  return 0;
}

STRATA_EXPORT int MPIABI_Error_string(int errorcode, char* string, int* resultlen) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Error_string(errorcode, string, resultlen);
  if (errorcode >= kMsgCodeBase && errorcode < kMsgCodeBase + kMsgCodes) {
    Messages& m = messages();
    std::lock_guard<std::mutex> lock(m.mu);
    snprintf(string, kMsgBytes, "%s", m.text[errorcode - kMsgCodeBase]);
  } else {
    const char* name = nullptr;
    for (const ErrName& n : kErrNames)
      if (n.value == errorcode && (strncmp(n.name, "MPI_ERR_", 8) == 0 || errorcode == 0)) {
        name = n.name;
        break;
      }
    snprintf(string, kMsgBytes, "%s (strata_jax MPI engine, error code %d)",
             errorcode == 0 ? "MPI_SUCCESS"
             : name         ? name
                            : "unknown error",
             errorcode);
  }
  *resultlen = static_cast<int>(strlen(string));
  return 0;
}

STRATA_EXPORT int MPIABI_Type_size(Handle dt, int* size) {
  const Datatype* d = datatype(dt);
  if (!d) return fail(kEngineErrArg, "MPI_Type_size: not a predefined MPI datatype");
  *size = d->bytes;
  return 0;
}

STRATA_EXPORT int MPIABI_Get_count(const void* status, Handle dt, int* count) {
  const Datatype* d = datatype(dt);
  if (!d) return fail(kEngineErrArg, "MPI_Get_count: not a predefined MPI datatype");
  const auto* s = static_cast<const Status*>(status);
  *count =
      s->count_bytes % d->bytes ? MPIABI_UNDEFINED : static_cast<int>(s->count_bytes / d->bytes);
  return 0;
}

// ---- communicators ----

STRATA_EXPORT int MPIABI_Comm_rank(Handle comm, int* rank) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Comm_rank(comm, rank);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Comm_rank", &rc);
  if (!e) return rc;
  return check(e->comm_rank(comm_of(e, comm), rank), e);
}

STRATA_EXPORT int MPIABI_Comm_size(Handle comm, int* size) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Comm_size(comm, size);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Comm_size", &rc);
  if (!e) return rc;
  return check(e->comm_size(comm_of(e, comm), size), e);
}

STRATA_EXPORT int MPIABI_Comm_split(Handle comm, int color, int key, Handle* newcomm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Comm_split(comm, color, key, newcomm);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Comm_split", &rc);
  if (!e) return rc;
  StrataMpiComm* out = nullptr;
  if (color == MPIABI_UNDEFINED) color = -1;
  rc = check(e->comm_split(comm_of(e, comm), color, key, &out), e);
  *newcomm = reinterpret_cast<Handle>(out);
  TRACE("MPI_Comm_split(color %d, key %d) -> %p (rc %d)", color, key, static_cast<void*>(out), rc);
  return rc;
}

STRATA_EXPORT int MPIABI_Comm_free(Handle* comm) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Comm_free(comm);
  const StrataMpiEngine* e = g_engine.load(std::memory_order_acquire);
  if (e && *comm != kCommWorld && *comm != kCommSelf && *comm != 0)
    e->comm_free(reinterpret_cast<StrataMpiComm*>(*comm));
  *comm = 0;
  return 0;  // after MPI_Finalize too (XLA frees its communicators at exit, after it)
}

// ---- collectives ----

STRATA_EXPORT int MPIABI_Barrier(Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Barrier(comm);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Barrier", &rc);
  if (!e) return rc;
  return check(e->barrier(comm_of(e, comm)), e);
}

STRATA_EXPORT int MPIABI_Allreduce(const void* sendbuf, void* recvbuf, int count, Handle dt,
                                   Handle op, Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Allreduce(sendbuf, recvbuf, count, dt, op, comm);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Allreduce", &rc);
  if (!e) return rc;
  const Datatype* d = datatype(dt);
  const int eop = engine_op(op);
  TRACE("MPI_Allreduce(%p, %p, %d, %s, %s)", sendbuf, recvbuf, count, d ? d->name : "?",
        op_name(op));
  if (!d || count < 0) return fail(kEngineErrArg, "MPI_Allreduce: bad datatype or count %d", count);
  if (eop < 0)
    return fail(kEngineErrUnsupported,
                "MPI_Allreduce: strata's engine reduces with MPI_SUM, MPI_PROD, MPI_MAX and "
                "MPI_MIN (what XLA uses), not %s",
                op_name(op));
  const void* in = sendbuf == MPIABI_IN_PLACE ? recvbuf : sendbuf;
  return check(e->all_reduce(comm_of(e, comm), in, recvbuf, static_cast<uint64_t>(count), d->xla,
                             d->bytes, eop),
               e);
}

STRATA_EXPORT int MPIABI_Allgather(const void* sendbuf, int sendcount, Handle sendtype,
                                   void* recvbuf, int recvcount, Handle recvtype, Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Allgather", &rc);
  if (!e) return rc;
  const int64_t rbytes = typed_bytes("MPI_Allgather", "receive", recvcount, recvtype, &rc);
  if (rbytes < 0) return rc;
  const Datatype* d = datatype(recvtype);
  StrataMpiComm* c = comm_of(e, comm);
  TRACE("MPI_Allgather(%p, %d, %p, %d, %s)", sendbuf, sendcount, recvbuf, recvcount, d->name);
  const void* in = sendbuf;
  if (sendbuf == MPIABI_IN_PLACE) {
    int rank = 0;
    if ((rc = check(e->comm_rank(c, &rank), e))) return rc;
    in = static_cast<const char*>(recvbuf) + rank * rbytes;
  } else {
    const int64_t sbytes = typed_bytes("MPI_Allgather", "send", sendcount, sendtype, &rc);
    if (sbytes < 0) return rc;
    if (sbytes != rbytes)
      return fail(kEngineErrArg,
                  "MPI_Allgather: sends %lld bytes per rank but receives %lld per rank",
                  static_cast<long long>(sbytes), static_cast<long long>(rbytes));
  }
  return check(e->all_gather(c, in, recvbuf, static_cast<uint64_t>(recvcount), d->xla, d->bytes),
               e);
}

namespace {
int reduce_scatter(const char* fn, const void* sendbuf, void* recvbuf, int count, Handle dt,
                   Handle op, Handle comm) {
  int rc = 0;
  const StrataMpiEngine* e = engine(fn, &rc);
  if (!e) return rc;
  const Datatype* d = datatype(dt);
  const int eop = engine_op(op);
  if (!d || count < 0) return fail(kEngineErrArg, "%s: bad datatype or count %d", fn, count);
  if (eop < 0)
    return fail(kEngineErrUnsupported,
                "%s: strata's engine reduces with MPI_SUM, MPI_PROD, MPI_MAX and MPI_MIN (what "
                "XLA uses), not %s",
                fn, op_name(op));
  StrataMpiComm* c = comm_of(e, comm);
  const void* in = sendbuf;
  if (sendbuf == MPIABI_IN_PLACE) in = recvbuf;  // the whole input is in recvbuf
  return check(
      e->reduce_scatter(c, in, recvbuf, static_cast<uint64_t>(count), d->xla, d->bytes, eop), e);
}
}  // namespace

STRATA_EXPORT int MPIABI_Reduce_scatter_block(const void* sendbuf, void* recvbuf, int recvcount,
                                              Handle dt, Handle op, Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Reduce_scatter_block(sendbuf, recvbuf, recvcount, dt, op, comm);
  return reduce_scatter("MPI_Reduce_scatter_block", sendbuf, recvbuf, recvcount, dt, op, comm);
}

STRATA_EXPORT int MPIABI_Reduce_scatter(const void* sendbuf, void* recvbuf, const int* recvcounts,
                                        Handle dt, Handle op, Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Reduce_scatter(sendbuf, recvbuf, recvcounts, dt, op, comm);
  int rc = 0;
  const StrataMpiEngine* e = engine("MPI_Reduce_scatter", &rc);
  if (!e) return rc;
  int size = 0, rank = 0;
  StrataMpiComm* c = comm_of(e, comm);
  if ((rc = check(e->comm_size(c, &size), e)) || (rc = check(e->comm_rank(c, &rank), e))) return rc;
  TRACE("MPI_Reduce_scatter(%p, %p, %d per rank of %d)", sendbuf, recvbuf, recvcounts[0], size);
  for (int j = 1; j < size; ++j)
    if (recvcounts[j] != recvcounts[0])
      return fail(kEngineErrUnsupported,
                  "MPI_Reduce_scatter: strata's engine scatters equal blocks (as XLA does), "
                  "got %d elements for rank 0 and %d for rank %d",
                  recvcounts[0], recvcounts[j], j);
  return reduce_scatter("MPI_Reduce_scatter", sendbuf, recvbuf, recvcounts[rank], dt, op, comm);
}

// ---- point to point ----

namespace {
int isend(const char* fn, const void* buf, int count, Handle dt, int dest, int tag, Handle comm,
          Handle* request) {
  *request = 0;
  int rc = 0;
  const StrataMpiEngine* e = engine(fn, &rc);
  if (!e) return rc;
  if (dest == MPIABI_PROC_NULL) return 0;
  const int64_t bytes = typed_bytes(fn, "send", count, dt, &rc);
  if (bytes < 0) return rc;
  StrataMpiRequest* r = nullptr;
  rc = check(e->isend(comm_of(e, comm), buf, static_cast<uint64_t>(bytes), dest, tag, fn, &r), e);
  *request = reinterpret_cast<Handle>(r);
  return rc;
}

int irecv(const char* fn, void* buf, int count, Handle dt, int source, int tag, Handle comm,
          Handle* request) {
  *request = 0;
  int rc = 0;
  const StrataMpiEngine* e = engine(fn, &rc);
  if (!e) return rc;
  if (source == MPIABI_PROC_NULL) return 0;
  if (source == MPIABI_ANY_SOURCE || tag == MPIABI_ANY_TAG)
    return fail(kEngineErrUnsupported,
                "%s: strata's engine matches messages by source and tag (XLA names both); "
                "MPI_ANY_SOURCE and MPI_ANY_TAG are not supported",
                fn);
  const int64_t bytes = typed_bytes(fn, "receive", count, dt, &rc);
  if (bytes < 0) return rc;
  StrataMpiRequest* r = nullptr;
  rc = check(e->irecv(comm_of(e, comm), buf, static_cast<uint64_t>(bytes), source, tag, fn, &r), e);
  *request = reinterpret_cast<Handle>(r);
  return rc;
}

int wait(Handle* request, void* status) {
  const StrataMpiEngine* e = g_engine.load(std::memory_order_acquire);
  if (!*request || !e) {
    set_status(status, MPIABI_PROC_NULL, MPIABI_ANY_TAG, 0);
    return 0;
  }
  int source = 0, tag = 0;
  uint64_t bytes = 0;
  const int rc =
      check(e->wait(reinterpret_cast<StrataMpiRequest*>(*request), &source, &tag, &bytes), e);
  *request = 0;
  set_status(status, source, tag, bytes);
  if (rc && !ignored(status)) static_cast<Status*>(status)->error = rc;
  return rc;
}
}  // namespace

STRATA_EXPORT int MPIABI_Isend(const void* buf, int count, Handle dt, int dest, int tag,
                               Handle comm, Handle* request) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Isend(buf, count, dt, dest, tag, comm, request);
  TRACE("MPI_Isend(%p, %d, to %d, tag %d)", buf, count, dest, tag);
  return isend("MPI_Isend", buf, count, dt, dest, tag, comm, request);
}

STRATA_EXPORT int MPIABI_Irecv(void* buf, int count, Handle dt, int source, int tag, Handle comm,
                               Handle* request) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Irecv(buf, count, dt, source, tag, comm, request);
  TRACE("MPI_Irecv(%p, %d, from %d, tag %d)", buf, count, source, tag);
  return irecv("MPI_Irecv", buf, count, dt, source, tag, comm, request);
}

STRATA_EXPORT int MPIABI_Wait(Handle* request, void* status) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Wait(request, status);
  return wait(request, status);
}

STRATA_EXPORT int MPIABI_Waitall(int count, Handle* requests, void* statuses) {
  if (const strata_mpi::Real* r = strata_mpi::real()) return r->Waitall(count, requests, statuses);
  int first = 0;
  for (int i = 0; i < count; ++i) {
    void* st = ignored(statuses) ? nullptr : static_cast<Status*>(statuses) + i;
    const int rc = wait(&requests[i], st);
    if (rc && !first) first = rc;
  }
  return first ? MPIABI_ERR_IN_STATUS : 0;
}

STRATA_EXPORT int MPIABI_Send(const void* buf, int count, Handle dt, int dest, int tag,
                              Handle comm) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Send(buf, count, dt, dest, tag, comm);
  Handle r = 0;
  const int rc = isend("MPI_Send", buf, count, dt, dest, tag, comm, &r);
  if (rc) return rc;
  return wait(&r, nullptr);
}

STRATA_EXPORT int MPIABI_Recv(void* buf, int count, Handle dt, int source, int tag, Handle comm,
                              void* status) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Recv(buf, count, dt, source, tag, comm, status);
  Handle r = 0;
  const int rc = irecv("MPI_Recv", buf, count, dt, source, tag, comm, &r);
  if (rc) return rc;
  return wait(&r, status);
}

// XLA's all-to-all: one round of (send to rank + i, receive from rank - i) per call.
STRATA_EXPORT int MPIABI_Sendrecv(const void* sendbuf, int sendcount, Handle sendtype, int dest,
                                  int sendtag, void* recvbuf, int recvcount, Handle recvtype,
                                  int source, int recvtag, Handle comm, void* status) {
  if (const strata_mpi::Real* r = strata_mpi::real())
    return r->Sendrecv(sendbuf, sendcount, sendtype, dest, sendtag, recvbuf, recvcount, recvtype,
                       source, recvtag, comm, status);
  TRACE("MPI_Sendrecv(%p, %d, to %d; %p, %d, from %d)", sendbuf, sendcount, dest, recvbuf,
        recvcount, source);
  Handle s = 0, r = 0;
  int rc = isend("MPI_Sendrecv", sendbuf, sendcount, sendtype, dest, sendtag, comm, &s);
  if (rc) return rc;
  rc = irecv("MPI_Sendrecv", recvbuf, recvcount, recvtype, source, recvtag, comm, &r);
  const int rrc = rc ? rc : wait(&r, status);
  const int src = wait(&s, nullptr);  // always: the receiver may be reading our buffer
  return rrc ? rrc : src;
}
