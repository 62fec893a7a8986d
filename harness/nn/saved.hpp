// harness/nn/saved.hpp — what a forward leaves for its backward, as a value.
//
// Every layer of the model level (blocks, the MoE layer, whole models) follows one pattern,
// so that any number of microbatches can be in flight on a rank and a pipeline schedule can
// run their passes in any order it likes:
//
//   Forwarded f = layer.forward(x, key);       // y, and the saved state of this microbatch
//   Tensor dx   = layer.backward_input(*f.saved, dy);   // "B": the input gradient
//   layer.backward_weight(*f.saved);                    // "W": the parameter gradients
//   f.saved.reset();                                    // frees what was saved
//
// Zero-bubble schedules (Qi et al., ICLR 2024) run W later than B; everyone else runs W right
// after B. A layer whose weight gradients are cheap or inseparable may do them in B and
// leave W empty (it says so). The tensors a Saved holds are freed when it is destroyed,
// ordered after every op issued on them (the backends' stream-ordered frees).
#pragma once
#include <cstdint>
#include <memory>

#include "harness/runtime/tensor.hpp"

namespace moelab {

// Which piece of work a call is. Random streams (the gate's noise, ...) are keyed by it, not
// by call order, so every schedule of the same work sees the same numbers; memory allocated
// for it is charged to its microbatch (Backend::MicrobatchScope).
struct WorkKey {
  int layer = 0;           // the layer's index in its model (0 for a lone layer)
  int microbatch = 0;      // index within the step
  std::uint64_t step = 0;  // training step, from 1
};

class Saved {
 public:
  explicit Saved(WorkKey k) : key(k) {}
  virtual ~Saved() = default;
  Saved(const Saved&) = delete;
  Saved& operator=(const Saved&) = delete;
  WorkKey key;
  bool input_done = false;   // backward_input ran
  bool weight_done = false;  // backward_weight ran
};
using SavedPtr = std::unique_ptr<Saved>;

struct Forwarded {
  Tensor y;
  SavedPtr saved;
};

// The concrete Saved type a layer made, or a clear error (a handle passed to the wrong layer).
template <class T>
T& saved_as(Saved& s, const char* layer) {
  auto* p = dynamic_cast<T*>(&s);
  if (!p) throw std::logic_error(std::string(layer) + ": backward given a saved state of another layer");
  return *p;
}

}  // namespace moelab
