// harness/nn/moe_impl.hpp — the interface every MoE system implements (FastMoE, FasterMoE,
// MPipeMoE, ...), and the registry that finds one by name for `moelab run --impl NAME`.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/nn/moe_layer.hpp"
#include "harness/nn/saved.hpp"

namespace moelab {

class MoEImpl {
 public:
  virtual ~MoEImpl() = default;
  virtual std::string name() const = 0;
  virtual void init_parameters(std::uint64_t seed) = 0;
  virtual void zero_grad() = 0;
  virtual MoEParams& params() = 0;
  virtual MoEParams& grads() = 0;
  virtual const RoutingStats& routing() const = 0;
  // The GEMMs of the experts in the last forward+backward, for the bare-library yardstick.
  virtual std::vector<GemmProblem> expert_gemms() = 0;
  // The layer whose parameters, gate and experts this implementation schedules.
  virtual MoELayer& layer() = 0;
  // Implementation-specific facts for the result file (chosen n, strategy, ...).
  virtual nlohmann::json report() { return nlohmann::json::object(); }
  // Whether each token reaches the experts once although every rank of a TP group holds it (a
  // TP-deduplicated all-to-all); otherwise the experts see it once per TP rank and the model
  // averages their gradients over those copies (harness/nn/grad_sync.hpp).
  virtual bool tp_deduplicated() const { return false; }

  // ---- any number of microbatches in flight (harness/nn/saved.hpp; MoELayer documents each)
  Forwarded forward(const Tensor& x, const WorkKey& key) { return layer().forward(x, key); }  // [T,M] -> [T,M]
  Tensor backward_input(Saved& s, const Tensor& dy, float grad_aux) {                        // [T,M] -> [T,M]
    return layer().backward_input(s, dy, grad_aux);
  }
  void backward_weight(Saved& s) { layer().backward_weight(s); }
  float aux_loss(const Saved& s) { return layer().aux_loss(s); }  // synchronises

  // ---- one microbatch in flight (a handle held inside the layer) ----------------------------
  Tensor forward(const Tensor& x) { return layer().forward(x); }                      // [T,M] -> [T,M]
  Tensor backward(const Tensor& dy, float grad_aux) { return layer().backward(dy, grad_aux); }  // [T,M] -> [T,M]
  float aux_loss() { return layer().aux_loss(); }
};

// The part of MoEImpl every implementation built on a layer (MoELayer or a schedule derived
// from it) forwards unchanged; an implementation adds its name, report and GEMM list.
template <class Layer>
class LayerBackedImpl : public MoEImpl {
 public:
  template <class... Args>
  explicit LayerBackedImpl(Args&&... args) : layer_(std::forward<Args>(args)...) {}
  void init_parameters(std::uint64_t seed) override { layer_.init_parameters(seed); }
  void zero_grad() override { layer_.zero_grad(); }
  MoEParams& params() override { return layer_.params(); }
  MoEParams& grads() override { return layer_.grads(); }
  const RoutingStats& routing() const override { return layer_.routing(); }
  MoELayer& layer() override { return layer_; }

 protected:
  Layer layer_;
};

// channels: the streams and communicators to share with the model's other MoE layers, or
// nullptr for a layer of its own (MoEChannels).
using ImplFactory = std::function<std::unique_ptr<MoEImpl>(Backend&, Communicator&, const ModelConfig&,
                                                           const nlohmann::json& options, MoEChannels* channels)>;

// Checks an implementation's options against the run before anything is built: the world
// size and tokens per rank are known, no backend or communicator exists yet. Optional; it
// throws ConfigError naming the option and its value. `moelab run` calls it on every path
// (cpu, cuda, mpirun, sim) in its validation phase, so that a bad option is exit 2 with one
// message before the cluster is built or any rank starts work.
struct ImplCheckContext {
  const ModelConfig& model;
  int world = 1;                    // expert-parallel ranks
  std::int64_t tokens_per_rank = 0;  // T of one forward
  std::int64_t shared_expert_hidden = 0;  // the model's dense MLP beside the routed experts (0: none)
};
using ImplOptionsCheck = std::function<void(const nlohmann::json& options, const ImplCheckContext& run)>;

void register_impl(const std::string& name, ImplFactory f, ImplOptionsCheck check = {});
// The registered check of `name` (nothing when none was registered); ConfigError on an unknown name.
void check_impl_options(const std::string& name, const nlohmann::json& options, const ImplCheckContext& run);
// Throws ConfigError naming the unknown implementation and listing the known ones.
std::unique_ptr<MoEImpl> make_impl(const std::string& name, Backend& b, Communicator& c, const ModelConfig& m,
                                   const nlohmann::json& options = nlohmann::json::object(),
                                   MoEChannels* channels = nullptr);
std::vector<std::string> impl_names();
// Registers every system and baseline built into this binary (impls/registry.cpp).
void register_builtin_impls();

}  // namespace moelab
