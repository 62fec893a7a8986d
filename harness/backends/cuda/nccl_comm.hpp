// harness/backends/cuda/nccl_comm.hpp — the NCCL communicator: collectives on device buffers of the
// cuda backend, issued on the backend's CUDA streams and timed into its timeline.
//
// Bootstrapping is split so that the cuda library needs no MPI: rank 0 makes the unique id,
// the caller broadcasts it (world.cpp does so over MPI), and every rank builds its
// communicator from it.
#pragma once
#include <array>
#include <functional>
#include <memory>
#include <string>

#include "harness/comm/communicator.hpp"

namespace moelab {

// ncclGetUniqueId: an opaque token naming one communicator (valid for one init).
std::array<char, 128> nccl_unique_id();

// A collective watchdog for the communicator and every communicator split from it
// (harness/comm/watchdog.hpp): a thread polls NCCL's asynchronous error and the completion of
// every op (a CUDA event recorded after it), and calls on_failure(message) from that thread
// when one fails or stays pending timeout_s (0: no limit). Without on_failure, no watchdog.
struct NcclWatch {
  double timeout_s = 600;
  std::function<void(const std::string&)> on_failure;
};

// ncclCommInitRank on the cuda backend's device. Collective: all `size` ranks must call it
// with the same id. Its ranks are world ranks 0..size-1 (world_ranks() is the identity);
// split() derives sub-communicators with ncclCommSplit. Throws CommError on any NCCL failure.
std::unique_ptr<Communicator> make_nccl_communicator(Backend& cuda_backend, const std::array<char, 128>& id, int rank,
                                                     int size, NcclWatch watch = {});

}  // namespace moelab
