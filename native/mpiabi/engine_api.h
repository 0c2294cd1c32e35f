// The seam between libstrata_mpi.so (the MPI ABI layer jaxlib loads, library.cc) and strata's
// engine, which lives in the native extension (engine.cc) with the fabric it runs on.
//
// Why two pieces: jaxlib's MPItrampoline dlopens the library named by MPITRAMPOLINE_LIB at
// `import jax` (RTLD_LOCAL | RTLD_DEEPBIND), while strata's fabric and algorithms live in the
// nanobind extension that Python loads (also RTLD_LOCAL). A second copy of the fabric inside
// the library would be a second fabric: strata's own custom calls and XLA's collectives must
// share one fabric and one matching of calls. So the library only translates the ABI (handles,
// datatypes, ops, statuses, error strings) and forwards every call through this table of plain
// C function pointers, which the extension hands to the library when it is loaded
// (engine_attach: dlopen(RTLD_NOLOAD) of the library jaxlib already loaded, then dlsym of
// strata_mpi_attach). Nothing here is C++ across the boundary.
//
// Conventions: every function returns 0 on success, else an error class of the library's
// (kEngine*); the message of the failure is then last_error() of the calling thread, which the
// library keeps for MPI_Error_string. Communicators and requests are opaque engine objects.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped on any change of the table below: the library refuses an engine of another version.
#define STRATA_MPI_ENGINE_VERSION 2

enum StrataMpiErrorClass {
  kEngineOk = 0,
  kEngineErrArg = 1,      // a bad argument (count, rank, datatype, op)
  kEngineErrComm = 2,     // a bad or freed communicator
  kEngineErrNotInit = 3,  // the engine is not configured (strata_jax.init() not called)
  kEngineErrFailed = 4,   // the call failed across ranks (disagreement, timeout, dead peer)
  kEngineErrUnsupported = 5,
};

// Reduction ops are the codes of strata's reductions (ReduceOp, common/ops.h's
// STRATA_REDUCTIONS): the library maps MPI_SUM, MPI_MAX, MPI_MIN and MPI_PROD to them (XLA
// lowers an all-reduce whose computation multiplies to MPI_PROD).

typedef struct StrataMpiComm StrataMpiComm;  // opaque
typedef struct StrataMpiRequest StrataMpiRequest;

typedef struct StrataMpiEngine {
  uint32_t version;  // STRATA_MPI_ENGINE_VERSION
  // MPI_Init_thread: this process's rank and size in the world (set from Python before JAX
  // creates its backend: strata_jax.init()).
  int (*init)(int* rank, int* size);
  int (*finalize)(void);
  StrataMpiComm* (*world)(void);
  StrataMpiComm* (*self)(void);
  int (*comm_rank)(StrataMpiComm* comm, int* rank);
  int (*comm_size)(StrataMpiComm* comm, int* size);
  // MPI_Comm_split: collective over `parent`; *out is null for color < 0 (MPI_UNDEFINED).
  int (*comm_split)(StrataMpiComm* parent, int color, int key, StrataMpiComm** out);
  int (*comm_free)(StrataMpiComm* comm);
  // Collectives. `dtype`: the XLA FFI element type (XLA_FFI_DataType_*, INVALID for bytes);
  // `count` elements of `elem_bytes` each; `op`: a ReduceOp code. in == out is allowed.
  int (*all_reduce)(StrataMpiComm* comm, const void* in, void* out, uint64_t count, int32_t dtype,
                    int32_t elem_bytes, int32_t op);
  int (*all_gather)(StrataMpiComm* comm, const void* in, void* out, uint64_t count, int32_t dtype,
                    int32_t elem_bytes);
  // Every rank receives `count` elements (MPI_Reduce_scatter with equal counts).
  int (*reduce_scatter)(StrataMpiComm* comm, const void* in, void* out, uint64_t count,
                        int32_t dtype, int32_t elem_bytes, int32_t op);
  int (*barrier)(StrataMpiComm* comm);
  // Point to point (matched by communicator, peer and order; the tag is compared).
  // `what` names the call for messages ("MPI_Sendrecv" ...).
  int (*isend)(StrataMpiComm* comm, const void* buf, uint64_t bytes, int dest, int tag,
               const char* what, StrataMpiRequest** req);
  int (*irecv)(StrataMpiComm* comm, void* buf, uint64_t bytes, int source, int tag,
               const char* what, StrataMpiRequest** req);
  // Completes and frees a request; *source, *tag, *bytes describe a received message.
  int (*wait)(StrataMpiRequest* req, int* source, int* tag, uint64_t* bytes);
  // The message of the calling thread's last failure ("" if none).
  const char* (*last_error)(void);
} StrataMpiEngine;

// Exported by libstrata_mpi.so: hands it the engine (returns 0, or nonzero for a version the
// library does not know).
typedef int (*StrataMpiAttachFn)(const StrataMpiEngine* engine);

#ifdef __cplusplus
}
#endif
