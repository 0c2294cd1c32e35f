// Every function of the ABI that library.cc does not implement: a weak definition that fails
// naming itself (library.cc's strong definitions replace the rest at link time). XLA never calls
// these; MPItrampoline only needs them to exist.
#include <stdint.h>
#include <stdio.h>

__attribute__((visibility("hidden"))) int strata_mpi_unsupported(const char* name);

namespace {
// Prints once per function (a stub called in a loop would flood stderr), fails every time.
int stub(const char* name, int* said) {
  if (!__atomic_exchange_n(said, 1, __ATOMIC_RELAXED))
    fprintf(stderr, "strata_jax: %s is not implemented by strata's MPI engine\n", name);
  return strata_mpi_unsupported(name);
}
}  // namespace

#define STRATA_STUB_INT(Name) \
  static int said = 0;        \
  return stub("MPI_" #Name, &said)
#define STRATA_STUB_OTHER(Name, VALUE) \
  static int said = 0;                 \
  stub("MPI_" #Name, &said);           \
  return VALUE

#define STRATA_MPI_FUNCTION_INT(Name)                                           \
  extern "C" __attribute__((weak, visibility("default"))) int MPIABI_##Name() { \
    STRATA_STUB_INT(Name);                                                      \
  }
#define STRATA_MPI_FUNCTION_FINT(Name)                                          \
  extern "C" __attribute__((weak, visibility("default"))) int MPIABI_##Name() { \
    STRATA_STUB_OTHER(Name, -1);                                                \
  }
#define STRATA_MPI_FUNCTION_HANDLE(Name)                                              \
  extern "C" __attribute__((weak, visibility("default"))) uintptr_t MPIABI_##Name() { \
    STRATA_STUB_OTHER(Name, 0);                                                       \
  }
#define STRATA_MPI_FUNCTION_AINT(Name)                                               \
  extern "C" __attribute__((weak, visibility("default"))) intptr_t MPIABI_##Name() { \
    STRATA_STUB_OTHER(Name, 0);                                                      \
  }
#define STRATA_MPI_FUNCTION_DOUBLE(Name)                                           \
  extern "C" __attribute__((weak, visibility("default"))) double MPIABI_##Name() { \
    STRATA_STUB_OTHER(Name, 0.0);                                                  \
  }
#define STRATA_MPI_FUNCTION(KIND, Name) STRATA_MPI_FUNCTION_##KIND(Name)
// The MPIX_ extensions (GPU support queries): "no" is a valid answer, not a failure.
#define STRATA_MPIX_FUNCTION(KIND, Name) \
  extern "C" __attribute__((weak, visibility("default"))) int MPIXABI_##Name() { return 0; }
#include "mpiabi/abi/functions.inc"
