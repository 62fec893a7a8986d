// harness/comm/world.cpp — see world.hpp.
#include "harness/comm/world.hpp"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "harness/comm/watchdog.hpp"
#include "harness/runtime/error.hpp"

#ifdef MOELAB_HAVE_MPI
#include <mpi.h>

#include "harness/backends/cpu/mpi_comm.hpp"
#endif
#ifdef MOELAB_HAVE_CUDA
#include "harness/backends/cuda/nccl_comm.hpp"
#endif

namespace moelab {

#ifdef MOELAB_HAVE_MPI
namespace {
bool g_mpi_initialised_here = false;

// Whether an MPI launcher started this process: mpirun / orted (Open MPI), a PMIx launcher (srun
// with PMIx, prterun) or a PMI one (MPICH's hydra, srun with PMI-2) sets one of these.
bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}
}  // namespace
#endif

void init_world(int* argc, char*** argv) {
#ifdef MOELAB_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return;
  // A process no launcher started is a world of one: MPI_Init would only start Open MPI's
  // singleton daemon (a fork, and a failure of its own when the daemon cannot start).
  if (!launched_by_mpi()) return;
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  g_mpi_initialised_here = true;
  if (provided < MPI_THREAD_MULTIPLE && world_size() > 1) {
    std::cerr << "moelab: error: this MPI library does not provide MPI_THREAD_MULTIPLE, which the cpu backend "
                 "needs to run collectives on several streams\n";
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
#else
  (void)argc;
  (void)argv;
#endif
}

void finalize_world() {
#ifdef MOELAB_HAVE_MPI
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_mpi_initialised_here && !finalized) MPI_Finalize();
#endif
}

int world_rank() {
#ifdef MOELAB_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
#endif
  return 0;
}

int world_size() {
#ifdef MOELAB_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
#endif
  return 1;
}

void abort_world(int code) {
#ifdef MOELAB_HAVE_MPI
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized && world_size() > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::exit(code);
}

std::unique_ptr<Communicator> make_world_communicator(Backend& backend) {
  const int size = world_size();
  if (backend.name() == "cpu") {
    if (size == 1) return make_self_communicator(backend);
#ifdef MOELAB_HAVE_MPI
    return make_mpi_communicator(dynamic_cast<CpuBackend&>(backend), MPI_COMM_WORLD);
#endif
  }
#ifdef MOELAB_HAVE_CUDA
  if (backend.name() == "cuda") {
    if (size == 1) return make_nccl_communicator(backend, nccl_unique_id(), 0, 1);
#ifdef MOELAB_HAVE_MPI
    // NCCL's unique id travels from rank 0 to every rank over MPI (one rank per GPU).
    std::array<char, 128> id{};
    if (world_rank() == 0) id = nccl_unique_id();
    MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
    // A collective that cannot complete leaves every rank waiting on its device for ever: the
    // watchdog's thread reports it and stops the world (harness/comm/watchdog.hpp).
    NcclWatch watch;
    watch.timeout_s = collective_timeout_from_env();
    watch.on_failure = [rank = world_rank()](const std::string& message) {
      std::fprintf(stderr, "moelab: error (rank %d): %s; stopping every rank\n", rank, message.c_str());
      std::fflush(stderr);
      abort_world(1);
    };
    return make_nccl_communicator(backend, id, world_rank(), size, std::move(watch));
#endif
  }
#endif
  throw ConfigError("no communicator for backend \"" + backend.name() + "\" with " + std::to_string(size) +
                    " ranks in this build");
}

}  // namespace moelab
