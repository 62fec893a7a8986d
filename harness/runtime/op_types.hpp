// harness/runtime/op_types.hpp — small value types that name what an op computes; shared by
// the Backend interface (backend.hpp) and the one cost descriptor of each op (cost.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moelab {

// gelu: the exact erf form x·Φ(x); gelu_tanh: its tanh approximation (Hendrycks & Gimpel 2016,
// §2; GPT-2's and PyTorch's gelu(approximate="tanh")), the GELU that cuBLASLt's epilogues
// compute, so the experts' GEMMs can fuse it (Backend::grouped_gemm_epilogue); relu: max(x, 0).
enum class Activation { gelu, relu, gelu_tanh };
const char* activation_name(Activation a);          // "gelu", "relu", "gelu_tanh"
Activation parse_activation(const std::string& s);  // throws ConfigError
const std::vector<std::string>& activation_names();  // what parse_activation accepts

// What a GEMM's epilogue does with its product P = op(A)·op(B) (Backend::grouped_gemm_epilogue;
// cuBLASLt's CUBLASLT_EPILOGUE_GELU_AUX and CUBLASLT_EPILOGUE_DGELU):
//   none     C = P
//   act_aux  aux = P (the pre-activation, kept for backward); C = act(P)
//   dact     C = P * act'(aux) (aux: the saved pre-activation; P is d_act, C is d_pre)
enum class GemmEpilogue { none, act_aux, dact };
const char* gemm_epilogue_name(GemmEpilogue e);  // "none", "act_aux", "dact"

enum class NormKind { layernorm, rmsnorm };
const char* norm_name(NormKind k);
NormKind parse_norm(const std::string& s);  // "layernorm" | "rmsnorm"; throws ConfigError

enum class OptimizerKind { sgd, adam };

// The rows [start, start + rows of the table) of a vocabulary of `total` tokens that a rank
// holds: Megatron-LM's vocabulary-parallel embedding (the table split by rows) and
// cross-entropy (the logits split by columns), Shoeybi et al. 2019, §3. The default, total 0,
// is the whole vocabulary in one table.
struct VocabShard {
  std::int64_t start = 0;
  std::int64_t total = 0;
};

// The shape of one attention call: B sequences of S tokens, Hq query heads and Hkv
// key/value heads (Hq % Hkv == 0) of head_dim D; scores scaled by 1/sqrt(D).
struct AttentionShape {
  std::int64_t batch = 1, seq = 1;
  int heads = 1, kv_heads = 1, head_dim = 1;
  bool causal = true;  // false: bidirectional (BERT-style)
  std::int64_t tokens() const { return batch * seq; }
  std::int64_t qkv_width() const { return static_cast<std::int64_t>(heads + 2 * kv_heads) * head_dim; }
};

}  // namespace moelab
