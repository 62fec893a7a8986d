// harness/backends/cuda/nccl_comm.hpp — the NCCL communicator: collectives on device buffers of the
// cuda backend, issued on the backend's CUDA streams and timed into its timeline.
//
// Bootstrapping is split so that the cuda library needs no MPI: rank 0 makes the unique id,
// the caller broadcasts it (world.cpp does so over MPI), and every rank builds its
// communicator from it.
#pragma once
#include <array>
#include <memory>

#include "harness/comm/communicator.hpp"

namespace moelab {

// ncclGetUniqueId: an opaque token naming one communicator (valid for one init).
std::array<char, 128> nccl_unique_id();

// ncclCommInitRank on the cuda backend's device. Collective: all `size` ranks must call it
// with the same id. Its ranks are world ranks 0..size-1 (world_ranks() is the identity);
// split() derives sub-communicators with ncclCommSplit. Throws CommError on any NCCL failure.
std::unique_ptr<Communicator> make_nccl_communicator(Backend& cuda_backend, const std::array<char, 128>& id, int rank,
                                                     int size);

}  // namespace moelab
