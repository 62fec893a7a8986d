// harness/backends/cpu/mpi_comm.hpp — the Open MPI communicator for host buffers (cpu backend).
//
// Data-plane calls are queued on the stream's worker thread and run there as blocking MPI
// calls, so a collective overlaps compute queued on other streams exactly as a NCCL call on
// its own CUDA stream would. That needs MPI_THREAD_MULTIPLE (see world.hpp). Each
// communicator owns two MPI communicators: one for the data plane (used from one stream)
// and one for the host's control-plane calls, so the two never interleave.
#pragma once
#include <mpi.h>

#include <memory>

#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/comm/communicator.hpp"

namespace moelab {

// Takes a duplicate of `comm` (the caller keeps ownership of its own).
std::unique_ptr<Communicator> make_mpi_communicator(CpuBackend& backend, MPI_Comm comm);

}  // namespace moelab
