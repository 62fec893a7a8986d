// impls/registry.cpp — every system and baseline built into moelab, registered by name.
#include "baselines/fastermoe/fastermoe.hpp"
#include "baselines/fastmoe/fastmoe.hpp"
#include "impls/mpipemoe/mpipemoe.hpp"
#include "harness/nn/moe_impl.hpp"

namespace moelab {

void register_builtin_impls() {
  static bool done = false;
  if (done) return;
  done = true;
  register_fastmoe();
  register_fastermoe();
  register_mpipemoe();
}

}  // namespace moelab
