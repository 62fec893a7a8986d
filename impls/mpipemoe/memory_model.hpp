// impls/mpipemoe/memory_model.hpp — MPipeMoE's memory model (§III-C, Eq. 1–6) and the
// layer's peak of activations + buffers predicted from it.
//
// The paper, in elements (B tokens per rank after the gate, M d_model, H d_hidden, n
// partitions):
//   Eq. 1  M_ms   = 4 (E·M + 2·H·M)                         model states with Adam
//   Eq. 2  M_act  = 4·B·M + B·H     T_I, T_DI, T_DO, T_O [B,M] and T_M [B,H] kept for backward
//   Eq. 3  M_buf  = B·M + B·H       temporaries (unpipelined)
//   Eq. 4  M_act^pipe = M_buf^pipe = 4·B·M + B·H    pipelined, no reuse: the gradient of each
//                                                   kept tensor is a buffer of its size
//   Eq. 5  reuse: two rotating buffers for T_DI and T_DO, one for T_M, of B/n rows each:
//          ΔM_act = ΔM_buf = B (2M(n−2)/n + H(n−1)/n)
//   Eq. 6  φ = (ΔM_act + ΔM_buf) / (M_ms + M_act^pipe + M_buf^pipe)
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moelab {

struct MemoryModelInput {
  std::int64_t T = 0;          // tokens per rank (the layer input's rows)
  int top_k = 1;
  std::int64_t E = 0, M = 0, H = 0;
  int n = 1;                   // partitions
  std::string strategy = "none";  // "none" (no reuse) or S1..S4 (reuse)
  double elem_bytes = 4;       // bytes per element of the layer's dtype
  std::int64_t b_max = 0;      // rows of the largest partition; 0: ceil(T/n)·top_k
  std::int64_t local_experts = 1;  // experts on this rank (Eq. 1 counts one expert per GPU)
  int t_m_buffers = 1;         // 1: the paper's one T_M buffer; 2: double-buffered T_M (S1, S2 only)
  bool noisy_gate = false;     // the noisy top-k gate: its noise [T,E] kept for backward, and its gradient
};

struct MemoryPrediction {
  double B = 0;                       // dispatched rows per rank: T·k (one rank, no dropping)
  double m_act_pipe = 0, m_buf_pipe = 0;  // Eq. 4, elements
  double delta_act = 0, delta_buf = 0;    // Eq. 5, elements (0 without reuse)
  double m_ms = 0;                        // Eq. 1, elements: 4 (E·M + El·2·H·M)
  double phi = 0;                         // Eq. 6: the saving ratio of reuse
  double paper_bytes = 0;             // (M_act^pipe + M_buf^pipe − ΔM_act − ΔM_buf) · elem_bytes
  // Where this implementation's layout differs from the paper's accounting, each term named.
  std::vector<std::pair<std::string, double>> adjustments;  // bytes, signed
  double predicted_bytes = 0;         // paper_bytes + Σ adjustments: peak activations + buffers
  double host_bytes = 0;              // pinned host memory of the offloads
};

MemoryPrediction predict_memory(const MemoryModelInput& in);

}  // namespace moelab
