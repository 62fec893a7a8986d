// harness/comm/world.hpp — the set of ranks a run spans, and its communicators.
//
// Ranks are processes launched by mpirun (or a scheduler's srun); without a launcher the
// world is one rank, and a build without MPI only ever has a world of one.
#pragma once
#include <memory>

#include "harness/comm/communicator.hpp"

namespace moelab {

// MPI_Init_thread(MPI_THREAD_MULTIPLE) when built with MPI and started by an MPI launcher
// (mpirun, srun: every stream may issue MPI calls from its own worker thread); a no-op
// otherwise, the process then being a world of one. Errors on communicators return
// codes (MPI_ERRORS_RETURN) so that a failed collective becomes a CommError naming the rank.
void init_world(int* argc, char*** argv);
void finalize_world();
int world_rank();
int world_size();
// Abort every rank after a fatal error on one (MPI_Abort); exit(code) in a world of one.
[[noreturn]] void abort_world(int code);

// The world communicator suited to the backend: self for one rank, Open MPI for cpu,
// NCCL (bootstrapped over MPI) for cuda. Collective: every rank must call it.
std::unique_ptr<Communicator> make_world_communicator(Backend& backend);

}  // namespace moelab
