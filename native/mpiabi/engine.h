// strata's engine for XLA's MPI collectives: the calls jaxlib makes through MPItrampoline
// (engine_api.h), run on the shared-memory fabric with the same rendezvous, algorithms and
// checks as strata's own custom calls.
//
// - The world is the jax.distributed processes (rank = process index), set from Python
//   (strata_jax.init()) before JAX creates its backend, which calls MPI_Init_thread.
// - A communicator is an ordered list of world ranks with a context: a hash of its parent's
//   context, the split's place among the parent's calls and the color, so every member computes
//   the same context without sharing anything derived from a program. MPI_Comm_split is itself
//   a collective over the parent (an all-gather of every rank's color and key).
// - Collectives meet by (context, the call's number on the communicator): the fabric's key
//   (fabric/shm.h) with the communicator as the group, and each rank's op, dtype, sizes and
//   reduce op compared at arrival: ranks that disagree fail at once naming each other.
//   Calls of XLA and of strata's custom calls use different contexts, so they never pair,
//   while sharing the slots, the low-latency channels and the registered buffers.
// - Each rank is one device: XLA's MPI path runs one device per process, whose global device id
//   names the rank in messages and maps it to its process (dead peers are seen at once).
// - Point-to-point messages (permute, all-to-all rounds): p2p.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mpiabi/engine_api.h"

namespace strata {
namespace mpiabi {

// The engine's function table (its address is stable; handed to libstrata_mpi.so).
const StrataMpiEngine* engine_table();

// From Python, before JAX creates its backend: this process's rank and the world's size.
void engine_configure(int rank, int size);
// After the fabric is connected: each world rank's global device id and its process index in
// this process's fabric (-1: another fabric). Starts the point-to-point box.
std::string engine_set_world(const std::vector<int64_t>& devices, const std::vector<int>& procs);
// Hands the engine to the copy of `library` (libstrata_mpi.so) that jaxlib loaded; false when
// that library is not loaded in this process (JAX runs another engine), with *why.
bool engine_attach(const char* library, std::string* why);
// What the engine has done: {"configured", "initialized", "finalized", "communicators"}.
struct EngineInfo {
  bool attached = false, configured = false, initialized = false, finalized = false;
  int rank = -1, size = 0;
  uint64_t communicators = 0;
};
EngineInfo engine_info();

}  // namespace mpiabi
}  // namespace strata
