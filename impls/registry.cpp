// impls/registry.cpp — every system and baseline built into moelab, registered by name.
#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"
#include "baselines/fastermoe/fastermoe.hpp"
#include "baselines/fastmoe/fastmoe.hpp"
#include "baselines/topk/topk.hpp"
#include "impls/monta/monta.hpp"
#include "impls/mpipemoe/mpipemoe.hpp"
#include "impls/scmoe/scmoe.hpp"
#include "harness/nn/moe_impl.hpp"

#include <mutex>

namespace moelab {

void register_builtin_impls() {
  // Simulated ranks are threads: registration must happen exactly once, and nobody may see a
  // half-filled registry.
  static std::once_flag once;
  std::call_once(once, [] {
    register_fastmoe();
    register_fastermoe();
    register_topk_baselines();  // ScMoE's baselines
    register_mpipemoe();
    register_scmoe();  // ScMoE's block pair for models with "scmoe" (not an --impl)
    register_deepspeed_tp_ep();  // MoNTA's baselines
    register_monta();
  });
}

}  // namespace moelab
