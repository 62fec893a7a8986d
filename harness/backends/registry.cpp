// harness/backends/registry.cpp — the one place that knows which backends were built.
#include <memory>

#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/runtime/error.hpp"
#ifdef MOELAB_HAVE_CUDA
#include "harness/backends/cuda/cuda_backend.hpp"
#endif

namespace moelab {

bool cuda_available() {
#ifdef MOELAB_HAVE_CUDA
  return cuda_device_present();
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cuda") {
#ifdef MOELAB_HAVE_CUDA
    if (!cuda_device_present()) throw ConfigError("--backend cuda: no CUDA device is available on this machine");
    return make_cuda_backend(local_device());  // one device per process of a node
#else
    throw ConfigError("--backend cuda: this build has no cuda backend (nvcc or NCCL was not found at configure time)");
#endif
  }
  if (name == "sim")
    throw ConfigError("--backend sim: a simulated backend belongs to a cluster model; use moelab run --backend sim --cluster NAME");
  throw ConfigError("--backend " + name + ": unknown backend (expected cpu or cuda)");
}

}  // namespace moelab
