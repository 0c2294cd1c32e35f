// libstrata_mpi.so handing every call to a real MPI: STRATA_MPI_DELEGATE=<libmpiwrapper.so>.
//
// Why: XLA over a real MPI refuses to open a communicator on any thread but the one that
// initialised MPI ("Communicator requested from a thread that is not the one MPI was
// initialized from"), so a jit + sharding training step, whose collectives XLA's executor runs
// on its pool threads, fails on every rank even with async dispatch off. To compare strata's
// engine with XLA over MPI on such programs (benchmarks/gspmd_step.py), this mode runs XLA over
// the real MPI (MPIwrapper over Open MPI, loaded here with RTLD_LOCAL | RTLD_DEEPBIND, as
// MPItrampoline loads it) with MPI initialised MPI_THREAD_MULTIPLE and MPI_Is_thread_main true
// on every thread; everything else is forwarded as it is. The library's constants then are the
// real MPI's (copied when the library is loaded, before MPItrampoline reads them).
#pragma once

#include <stdint.h>

namespace strata_mpi {

using Handle = uintptr_t;

// The real MPI's entry points XLA's collectives use (null members: not forwarding).
struct Real {
  int (*Init_thread)(int*, char***, int, int*);
  int (*Finalize)();
  int (*Finalized)(int*);
  int (*Initialized)(int*);
  int (*Query_thread)(int*);
  int (*Get_library_version)(char*, int*);
  int (*Error_string)(int, char*, int*);
  int (*Error_class)(int, int*);
  int (*Comm_rank)(Handle, int*);
  int (*Comm_size)(Handle, int*);
  int (*Comm_split)(Handle, int, int, Handle*);
  int (*Comm_free)(Handle*);
  int (*Barrier)(Handle);
  int (*Allreduce)(const void*, void*, int, Handle, Handle, Handle);
  int (*Allgather)(const void*, int, Handle, void*, int, Handle, Handle);
  int (*Reduce_scatter)(const void*, void*, const int*, Handle, Handle, Handle);
  int (*Reduce_scatter_block)(const void*, void*, int, Handle, Handle, Handle);
  int (*Sendrecv)(const void*, int, Handle, int, int, void*, int, Handle, int, int, Handle, void*);
  int (*Isend)(const void*, int, Handle, int, int, Handle, Handle*);
  int (*Irecv)(void*, int, Handle, int, int, Handle, Handle*);
  int (*Send)(const void*, int, Handle, int, int, Handle);
  int (*Recv)(void*, int, Handle, int, int, Handle, void*);
  int (*Wait)(Handle*, void*);
  int (*Waitall)(int, Handle*, void*);
  int thread_multiple;  // the real MPI's MPI_THREAD_MULTIPLE
};

// The real MPI when STRATA_MPI_DELEGATE named one, else nullptr.
const Real* real();

}  // namespace strata_mpi
