// harness/backends/cuda/cuda_backend.hpp — the cuda backend: real fp32/bf16 data on one GPU,
// cuBLAS GEMMs, CUB-based gate, hand-written transformer-block kernels (block_kernels.cu),
// CUDA streams and events, cudaMallocAsync pools for device memory and a caching pool for
// pinned host memory (harness/runtime/host_pool.hpp).
//
// Plain C++ (the registry and the tests include it with the host compiler): nothing here
// needs nvcc, only the CUDA runtime's C header for cudaStream_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/runtime/backend.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/runtime/host_pool.hpp"

namespace moelab {

struct CudaOptions {
  int device = 0;
  // fp32 GEMMs may run on TF32 tensor cores (10-bit mantissa, ~8x faster on A100/H100).
  // Off by default so that fp32 results agree with the cpu backend to fp32 rounding.
  bool allow_tf32 = false;
};

// A usable CUDA device exists. Any CUDA error (no driver, driver too old, no device) means
// no; never throws.
bool cuda_device_present();

// The device a process of a multi-process run takes: its node-local rank, as the launcher
// exports it (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, MPICH's MPI_LOCALRANKID, MVAPICH's
// MV2_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID, torchrun's LOCAL_RANK; the first one set),
// modulo the visible devices; 0 without a launcher, or where the launcher gives each process
// one device through CUDA_VISIBLE_DEVICES (devices = 1). `getenv` is the lookup (a test's).
int local_device(int devices, const char* (*getenv)(const char*));
// The same with the process's environment and this machine's device count.
int local_device();

// Throws Unsupported (with the CUDA error's text) when there is no usable device.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);
std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options);

// ---- hooks for code that issues its own CUDA work on the backend's streams (NCCL) --------

bool is_cuda_backend(const Backend& b);
int cuda_device_of(const Backend& b);       // throws std::invalid_argument if not a cuda backend
cudaStream_t cuda_native_stream(Stream& s);  // throws std::invalid_argument if not a cuda stream

// ---- the pinned host pool ----------------------------------------------------------------
// MemSpace::host_pinned tensors come from a caching pool: after a warm-up step, a step that
// repeats its pattern of pinned allocations makes no cudaHostAlloc and no cudaFreeHost
// (which would synchronise the device). Its counters; throws std::invalid_argument if not a
// cuda backend. (Backend::release_cached_host_memory empties its cache.)
HostPool::Stats cuda_host_pool_stats(const Backend& b);

// ---- the GEMM paths of grouped_gemm (harness/runtime/gemm_paths.hpp, docs/GPU.md) ---------------
// Each grouped_gemm call runs its problems as a loop of cublasGemmEx, one
// cublasGemmStridedBatchedEx (equal, equally strided problems) or one
// cublasGemmGroupedBatchedEx, as choose_gemm_path decides from the backend's crossover table
// (default_gemm_path_table() until one is set, e.g. from a calibration profile's
// "gemm_paths"). All three throw std::invalid_argument if not a cuda backend.
void cuda_set_gemm_path_table(Backend& b, GemmPathTable table);
GemmPathTable cuda_gemm_path_table(const Backend& b);  // the table calls are chosen by
// Every call on that path where the path can run (strided: one strided batch covers the
// problems; grouped: the library has the kernel), the choice elsewhere; nullopt: choose.
// For tests and measurements of one path.
void cuda_force_gemm_path(Backend& b, std::optional<GemmPath> path);
// The paths taken so far, per op name and path: calls, and the last decision's reason
// (Backend::gemm_path_uses of a cuda backend).
using CudaGemmPathUse = GemmPathUse;
std::vector<CudaGemmPathUse> cuda_gemm_path_uses(const Backend& b);
// Fused-epilogue problems run unfused so far (cuBLASLt had no kernel for them: cublasGemmEx,
// then the activation kernel). moelab calibrate leaves a sample out when this rose.
std::int64_t cuda_unfused_epilogues(const Backend& b);

struct CudaOpTicket;

// Times the work issued on `s` during its lifetime as one op of the backend's timeline:
// a timing event is recorded on `s` at construction and another at destruction, and the
// record carries `name`, the backend's phase at construction, the stream, the rank and
// `cost`. Times resolve lazily in Backend::timeline().
class CudaOpScope {
 public:
  CudaOpScope(Backend& cuda_backend, Stream& s, std::string name, const OpCost& cost);
  ~CudaOpScope();
  void set_detail(std::string detail);  // OpRecord::detail of this op
  CudaOpScope(const CudaOpScope&) = delete;
  CudaOpScope& operator=(const CudaOpScope&) = delete;

 private:
  Backend& backend_;
  std::unique_ptr<CudaOpTicket> ticket_;
};

}  // namespace moelab
