// STRATA_MPI_DELEGATE: libstrata_mpi.so over a real MPI (see delegate.h).
#include "mpiabi/abi/delegate.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// The library's exported constants (library.cc), overwritten with the real MPI's values.
extern "C" {
#define STRATA_MPI_INT(N, V) extern int MPIABI_##N;
#define STRATA_MPI_DATATYPE(I, N, B, X) extern uintptr_t MPIABI_##N;
#define STRATA_MPI_OP(I, N) extern uintptr_t MPIABI_##N;
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP
#define STRATA_MPI_PTR(N, V) extern void* MPIABI_##N;
#define STRATA_MPI_HANDLE(N, V) extern uintptr_t MPIABI_##N;
#include "mpiabi/abi/handles.inc"
#undef STRATA_MPI_PTR
#undef STRATA_MPI_HANDLE
extern int64_t MPIABI_DISPLACEMENT_CURRENT;
}

namespace strata_mpi {
namespace {

Real g_real{};
bool g_on = false;

[[noreturn]] void die(const char* what, const char* lib) {
  const char* e = dlerror();
  fprintf(stderr, "strata_jax libstrata_mpi.so: STRATA_MPI_DELEGATE=%s: %s%s%s\n", lib, what,
          e ? ": " : "", e ? e : "");
  _exit(1);
}

template <class T>
void copy(void* h, const char* lib, T* ours, const char* name) {
  const void* p = dlsym(h, name);
  if (!p) die(name, lib);
  memcpy(ours, p, sizeof(T));
}

template <class F>
void fn(void* h, const char* lib, F* slot, const char* name) {
  *slot = reinterpret_cast<F>(dlsym(h, name));
  if (!*slot) die(name, lib);
}

// Runs when the library is loaded (MPItrampoline's dlopen), before MPItrampoline copies its
// constants; does nothing unless STRATA_MPI_DELEGATE is set.
__attribute__((constructor)) void load() {
  const char* lib = getenv("STRATA_MPI_DELEGATE");
  if (!lib || !*lib) return;
  void* h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL | RTLD_DEEPBIND);
  if (!h) die("cannot load it", lib);
#define STRATA_MPI_INT(N, V) copy(h, lib, &MPIABI_##N, "MPIABI_" #N);
#define STRATA_MPI_DATATYPE(I, N, B, X) copy(h, lib, &MPIABI_##N, "MPIABI_" #N);
#define STRATA_MPI_OP(I, N) copy(h, lib, &MPIABI_##N, "MPIABI_" #N);
#include "mpiabi/abi/constants.inc"
#undef STRATA_MPI_INT
#undef STRATA_MPI_DATATYPE
#undef STRATA_MPI_OP
#define STRATA_MPI_PTR(N, V) copy(h, lib, &MPIABI_##N, "MPIABI_" #N);
#define STRATA_MPI_HANDLE(N, V) copy(h, lib, &MPIABI_##N, "MPIABI_" #N);
#include "mpiabi/abi/handles.inc"
#undef STRATA_MPI_PTR
#undef STRATA_MPI_HANDLE
  copy(h, lib, &MPIABI_DISPLACEMENT_CURRENT, "MPIABI_DISPLACEMENT_CURRENT");
  g_real.thread_multiple = MPIABI_THREAD_MULTIPLE;
#define STRATA_REAL(N) fn(h, lib, &g_real.N, "MPIABI_" #N);
  STRATA_REAL(Init_thread)
  STRATA_REAL(Finalize)
  STRATA_REAL(Finalized)
  STRATA_REAL(Initialized)
  STRATA_REAL(Query_thread)
  STRATA_REAL(Get_library_version)
  STRATA_REAL(Error_string)
  STRATA_REAL(Error_class)
  STRATA_REAL(Comm_rank)
  STRATA_REAL(Comm_size)
  STRATA_REAL(Comm_split)
  STRATA_REAL(Comm_free)
  STRATA_REAL(Barrier)
  STRATA_REAL(Allreduce)
  STRATA_REAL(Allgather)
  STRATA_REAL(Reduce_scatter)
  STRATA_REAL(Reduce_scatter_block)
  STRATA_REAL(Sendrecv)
  STRATA_REAL(Isend)
  STRATA_REAL(Irecv)
  STRATA_REAL(Send)
  STRATA_REAL(Recv)
  STRATA_REAL(Wait)
  STRATA_REAL(Waitall)
#undef STRATA_REAL
  g_on = true;
}

}  // namespace

const Real* real() { return g_on ? &g_real : nullptr; }

}  // namespace strata_mpi
