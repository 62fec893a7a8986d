// harness/runtime/op_types.hpp — small value types that name what an op computes; shared by
// the Backend interface (backend.hpp) and the one cost descriptor of each op (cost.hpp).
#pragma once
#include <cstdint>
#include <string>

namespace moelab {

enum class Activation { gelu, relu };
const char* activation_name(Activation a);
Activation parse_activation(const std::string& s);  // throws ConfigError

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
