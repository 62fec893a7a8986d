// harness/nn/layer_group.hpp — a block that spans whole layers of a model and issues them
// together, so that its schedule can interleave their work across the layers' boundaries
// (ScMoE's block pair, impls/scmoe: the routed MoE of layer l+1 fed from inside layer l, its
// all-to-alls beside the pair's attention, MLP and shared expert).
//
// A LayerGroup is one Block of a Model (harness/nn/model.hpp) in place of the blocks of its
// layers; it follows the Block contract (saved state as a value, B and W split). The Model
// asks it for its layers, its MoE layer and its auxiliary loss; which layers form groups is
// the model file's (TransformerConfig::scmoe), and the group is made by the factory its
// implementation registered (register_builtin_impls).
#pragma once
#include <functional>
#include <memory>

#include "harness/nn/blocks.hpp"

namespace moelab {

class LayerGroup : public Block {
 public:
  virtual int first_layer() const = 0;
  virtual int num_layers() const = 0;
  // The MoE layer's implementation inside the group (its report says how the group scheduled it).
  virtual MoEImpl* moe() = 0;
  // The group's parameters other than its MoE layer's: the Model names those itself, pointing
  // at the layer's own tensors as it does for an FfnBlock's (Model::param_slots), so that what
  // rebinds or releases them (GradSync's buckets, inference) reaches the tensors the layer's
  // GEMMs use. collect() gives these and the MoE layer's, named alike.
  virtual void collect_own(std::vector<Param*>& out) = 0;
  // The auxiliary loss of a forward's MoE layer (synchronises); dL/d aux as FfnBlock's.
  virtual float aux_loss(const Saved& saved) = 0;
  virtual void set_aux_grad_scale(float s) = 0;
};

// What a group is built from: the model, the group's first layer, its MoE layer's implementation
// (made by the model with --impl, on the model's shared MoE channels) and the aux loss weight.
struct LayerGroupArgs {
  Backend& backend;
  Stream& stream;
  const TransformerConfig& cfg;
  int first_layer = 0;
  std::unique_ptr<MoEImpl> moe;
  float aux_loss_coef = 0.0f;
};
using LayerGroupFactory = std::function<std::unique_ptr<LayerGroup>(LayerGroupArgs)>;

// The factory of ScMoE's block pairs (impls/scmoe registers it); null when none is built in.
void register_shortcut_pair(LayerGroupFactory f);
const LayerGroupFactory& shortcut_pair_factory();

}  // namespace moelab
