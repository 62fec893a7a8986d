// harness/config/limits.hpp — the largest sizes moelab's input files may hold, and checked
// 64-bit arithmetic for every size derived from them.
//
// Every size field of a workload, model or cluster file has an upper bound here. The bounds
// lie far above any published model or machine (GPT-3 175B: d_model 12288, 96 layers;
// Gemma's vocabulary: 256000; DeepSeek-V3: 256 routed experts; clusters of 10^5 GPUs) and
// far below where arithmetic on them could wrap. Sizes derived from several fields (a
// weight matrix E·M·H, the activations T·k·H, the GPUs nodes × gpus, a parameter count) are
// computed with Checked, which refuses anything above kMaxDerived instead of wrapping; the
// readers turn that into a ConfigError naming the fields, before any cluster, backend or
// tensor is built. Cluster and profile figures have physical ranges here too. Tested by
// harness/tests/config_test.cpp, model_config_test.cpp and sim_cluster_test.cpp; the readers are
// fuzzed by harness/fuzz/.
#pragma once
#include <cstdint>

#include "harness/runtime/error.hpp"

namespace moelab::limits {

// Models (workload "model" objects and model files).
constexpr std::int64_t kMaxDModel = std::int64_t{1} << 20;      // d_model
constexpr std::int64_t kMaxHidden = std::int64_t{1} << 22;      // d_ffn, d_hidden, shared_expert_hidden
constexpr std::int64_t kMaxExperts = std::int64_t{1} << 16;     // num_experts
constexpr std::int64_t kMaxLayers = 4096;                       // num_layers
constexpr std::int64_t kMaxVocab = std::int64_t{1} << 24;       // vocab_size
constexpr std::int64_t kMaxSeqLen = std::int64_t{1} << 22;      // seq_len
constexpr std::int64_t kMaxTokensPerRank = std::int64_t{1} << 24;  // tokens_per_rank
// A factor of E/k already lets every expert take every token; beyond the largest E nothing
// changes but the size of the number.
constexpr double kMaxCapacityFactor = static_cast<double>(kMaxExperts);
// Routed slots per rank, T·k: slot and expert indices are int32 tensors (harness/nn/moe_layer.cpp).
constexpr std::int64_t kMaxRoutedSlots = (std::int64_t{1} << 31) - 1;

// Clusters (experiments/hardware/).
constexpr std::int64_t kMaxNodes = std::int64_t{1} << 16;       // nodes
constexpr std::int64_t kMaxGpusPerNode = 1024;                  // node.gpus, gpus_per_pcie_switch
constexpr std::int64_t kMaxNicsPerNode = 1024;                  // node.nics
constexpr std::int64_t kMaxWorld = std::int64_t{1} << 20;       // nodes × gpus

// Figures of clusters and calibration profiles (SI units), each bounded to a physical range:
// a figure outside it is a typo (a unit slip, a missing exponent) or not a machine at all, and
// the discrete-event simulation needs finite, representable times (a latency of 1e308 s sums
// to infinity, and a task then never ends). The ranges are generous: today's GPUs have about
// 1e15 FLOP/s and 1e12-1e13 B/s of HBM, links 1e9-1e12 B/s, latencies of microseconds.
constexpr double kMinFlops = 1e6, kMaxFlops = 1e18;                // FLOP/s (peaks, a profile's implied rates)
constexpr double kMinBandwidth = 1e3, kMaxBandwidth = 1e15;        // bytes/s (HBM, NVLink, PCIe, NIC, copies)
constexpr double kMinMemoryBytes = 1 << 20;                        // a GPU's or a node's memory
constexpr double kMaxMemoryBytes = static_cast<double>(std::int64_t{1} << 56);
constexpr double kMaxLatency = 1.0;                                // seconds, any latency (>= 0)
constexpr double kMinFraction = 1e-3;                              // efficiencies, interference factors: [this, 1]
constexpr double kMaxGemmHalfDim = static_cast<double>(std::int64_t{1} << 20);  // efficiency.gemm_half_dim
constexpr std::int64_t kMaxGemmDim = std::int64_t{1} << 31;        // a profile's GEMM m, n, k
constexpr double kMinSeconds = 1e-12, kMaxSeconds = 1e6;           // a measured duration (GEMM, collective)

// Any count derived from several fields (elements of a tensor, parameters, bytes at 8 per
// element included): 2^56 leaves room for bytes (16 per parameter with Adam) and the sums
// that allocators and cost models form of a few such sizes, all inside int64.
constexpr std::int64_t kMaxDerived = std::int64_t{1} << 56;

}  // namespace moelab::limits

namespace moelab {

// A non-negative count computed in 64-bit arithmetic that remembers a step beyond
// limits::kMaxDerived instead of wrapping: build it with + and *, then test ok() once.
//   const Checked w = Checked(E) * 2 * M * H;  if (!w.ok()) ...;  w.value()
class Checked {
 public:
  constexpr Checked(std::int64_t v = 0) : v_(v), ok_(v >= 0 && v <= limits::kMaxDerived) {}  // NOLINT: implicit by design
  friend Checked operator*(Checked a, Checked b) {
    Checked r;
    r.ok_ = a.ok_ && b.ok_ && !__builtin_mul_overflow(a.v_, b.v_, &r.v_) && r.v_ <= limits::kMaxDerived;
    return r;
  }
  friend Checked operator+(Checked a, Checked b) {
    Checked r;
    r.ok_ = a.ok_ && b.ok_ && !__builtin_add_overflow(a.v_, b.v_, &r.v_) && r.v_ <= limits::kMaxDerived;
    return r;
  }
  Checked& operator+=(Checked b) { return *this = *this + b; }
  bool ok() const { return ok_; }
  std::int64_t value() const {
    MOELAB_CHECK(ok_, "a size beyond limits::kMaxDerived was used (its reader should have rejected it)");
    return v_;
  }

 private:
  std::int64_t v_ = 0;
  bool ok_ = true;
};

}  // namespace moelab
