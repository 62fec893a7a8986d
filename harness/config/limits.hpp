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
// tensor is built. Tested by harness/tests/config_test.cpp and model_config_test.cpp.
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
