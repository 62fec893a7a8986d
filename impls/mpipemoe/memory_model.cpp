// impls/mpipemoe/memory_model.cpp — see memory_model.hpp.
//
// The predicted peak is that of one forward + backward, reached in backward while the last
// partition's experts run: every kept activation, every gradient buffer, and the experts'
// temporaries of one partition are alive at once (the forward holds less: T_I and T_DO
// instead of the output gradients); or, with many small partitions, just after them, when
// dx and the gate's backward take more than the experts' buffers gave back (the last
// adjustment).
#include "impls/mpipemoe/memory_model.hpp"

#include <algorithm>

#include "impls/mpipemoe/strategy.hpp"

namespace moelab {

MemoryPrediction predict_memory(const MemoryModelInput& in) {
  MemoryPrediction p;
  const double B = static_cast<double>(in.T) * in.top_k, M = static_cast<double>(in.M),
               H = static_cast<double>(in.H), n = in.n, eb = in.elem_bytes;
  const bool reuse = in.strategy != "none";
  const double b = B / n;  // the paper's partition
  // The layer cuts the tokens into n parts (plan_chunks), so its largest partition holds the k
  // rows of ceil(T/n) tokens: more than ceil(B/n) when n does not divide T.
  const double b_max = in.b_max > 0 ? static_cast<double>(in.b_max)
                                    : static_cast<double>((in.T + in.n - 1) / in.n * in.top_k);
  p.B = B;
  p.m_act_pipe = p.m_buf_pipe = 4 * B * M + B * H;  // Eq. 4
  if (reuse) {
    // Eq. 5. With n = 1 there is one buffer of each, not two: nothing saved, nothing added.
    p.delta_act = p.delta_buf = in.n >= 2 ? B * (2 * M * (n - 2) / n + H * (n - 1) / n) : 0;
  }
  // Eq. 1 (weights, gradients and Adam's two moments) and Eq. 6.
  p.m_ms = 4 * (static_cast<double>(in.E) * M + static_cast<double>(in.local_experts) * 2 * H * M);
  p.phi = (p.delta_act + p.delta_buf) / (p.m_ms + p.m_act_pipe + p.m_buf_pipe);
  p.paper_bytes = (p.m_act_pipe + p.m_buf_pipe - p.delta_act - p.delta_buf) * eb;

  // The paper's size of one kept tensor (and of its gradient): [B,M] / [B,H] without reuse,
  // its rotating buffers with reuse.
  const double t_do = reuse && in.n >= 2 ? 2 * b * M : B * M;
  const double t_m = reuse ? b * H : B * H;
  auto add = [&](std::string name, double bytes) { p.adjustments.emplace_back(std::move(name), bytes); };
  // T_I is not kept: the permute's backward needs only the slots. S2/S4 keep it to re-run
  // the dispatch all-to-all in backward.
  if (!recommunicates(in.strategy)) add("T_I not kept for backward", -B * M * eb);
  // T_DO is freed after the forward's combine: backward needs only T_DI and T_M.
  add("T_DO not kept for backward", -t_do * eb);
  // dT_M: the experts' backward holds the recomputed activation A and dA (dT_M in place) of
  // one partition at a time, [b_max,H] each, instead of the paper's dT_M.
  add("dT_M: A and dA of one partition instead of the paper's dT_M", (2 * b_max * H - t_m) * eb);
  // Rotating buffers hold the largest partition, not B/n rows: T_DI ×2, T_M, dT_DI ×2, dT_DO ×2.
  if (reuse) add("rotating buffers sized for the largest partition", (b_max - b) * (6 * M + H) * eb);
  // t_m_buffers = 2 (not in the paper): a second T_M so that offloading T_M_p overlaps the
  // next partition's FC1 instead of delaying it.
  if (offloads_t_m(in.strategy) && in.n >= 2 && in.t_m_buffers == 2) add("second T_M buffer (t_m_buffers = 2)", b_max * H * eb);
  // The layer's input x, output y and the output gradient dy [T,M] (activations).
  add("x, y, dy [T,M]", 3.0 * static_cast<double>(in.T) * M * eb);
  // The gate's tensors (fp32/int32): probs [T,E], top-k index, weight, slot [T,k], routed
  // fractions [E], aux loss [1]; in backward the gate-weight gradient [T,k].
  add("gate: probs [T,E], topk/slot [T,k] x3, d_w [T,k], f_e [E], aux [1]",
      4.0 * (static_cast<double>(in.T) * static_cast<double>(in.E) + 4.0 * static_cast<double>(in.T) * in.top_k +
             static_cast<double>(in.E) + 1));
  // The noisy gate (Shazeer et al. 2017) keeps its raw noise logits and the drawn noise for
  // backward: two more fp32 [T,E].
  if (in.noisy_gate)
    add("noisy gate: noise logits and noise [T,E] kept", 2 * 4.0 * static_cast<double>(in.T) * static_cast<double>(in.E));
  // The moment after the experts' backward: the layer frees the experts' gradient buffers (with
  // reuse the rotating dT_DI and dT_DO, min(n, 2) each of the largest partition; without, every
  // partition's own, [B,M] each) and the last partition's A and dA, then allocates dx [T,M] and
  // the gate's d_logits [T,E] (fp32, and a copy in the layer's dtype when that is not fp32). With
  // many small partitions that moment holds more than the experts' (MoE-GPT3-S, 64 experts, n = 16
  // with reuse: 12 MB more in bf16); the excess, where there is one, is the layer's peak.
  const double Td = static_cast<double>(in.T), Ed = static_cast<double>(in.E);
  const double freed = (reuse ? 2.0 * std::min(in.n, 2) * b_max * M : 2 * B * M) + 2 * b_max * H;
  // The noisy gate's backward adds d_noise [T,E] (fp32 and its copy) while d_logits lives.
  const double gate_bwd = Td * Ed * (4.0 + (eb == 4 ? 0.0 : eb)) * (in.noisy_gate ? 2 : 1);
  const double after_experts = Td * M * eb + gate_bwd - freed * eb;
  if (after_experts > 0) add("after the experts: dx [T,M] and the gate's d_logits [T,E] above the experts' peak", after_experts);
  p.predicted_bytes = p.paper_bytes;
  for (const auto& a : p.adjustments) p.predicted_bytes += a.second;
  // Host: every partition's offloaded T_DI [b,M] and/or T_M [b,H].
  p.host_bytes = ((offloads_t_di(in.strategy) ? B * M : 0) + (offloads_t_m(in.strategy) ? B * H : 0)) * eb;
  return p;
}

}  // namespace moelab
