// harness/runtime/cost.cpp — the FLOP and byte counts of every op (see cost.hpp).
#include "harness/runtime/cost.hpp"

#include "harness/runtime/backend.hpp"

namespace moelab {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::gemm: return "gemm";
    case OpKind::elementwise: return "elementwise";
    case OpKind::gate: return "gate";
    case OpKind::permute: return "permute";
    case OpKind::copy_d2d: return "copy_d2d";
    case OpKind::copy_h2d: return "copy_h2d";
    case OpKind::copy_d2h: return "copy_d2h";
    case OpKind::collective: return "collective";
    case OpKind::host: return "host";
  }
  return "?";
}

OpCost cost_grouped_gemm(std::span<const GemmProblem> problems) {
  OpCost c;
  c.kind = OpKind::gemm;
  c.launches = 0;
  for (const auto& p : problems) {
    const double m = static_cast<double>(p.m), n = static_cast<double>(p.n), k = static_cast<double>(p.k);
    const double ea = static_cast<double>(dtype_size(p.a.defined() ? p.a.dtype() : DType::f32));
    const double ec = static_cast<double>(dtype_size(p.c.defined() ? p.c.dtype() : DType::f32));
    c.flops += 2.0 * m * n * k;
    c.bytes_read += (m * k + k * n) * ea + (p.beta != 0.0f ? m * n * ec : 0.0);
    c.bytes_written += m * n * ec;
    if (p.m > 0 && p.n > 0) ++c.launches;
  }
  return c;
}

OpCost cost_elementwise(std::int64_t elements, DType dtype, int inputs, int outputs, double flops_per_elem) {
  const double e = static_cast<double>(elements), b = static_cast<double>(dtype_size(dtype));
  return {OpKind::elementwise, e * flops_per_elem, e * b * inputs, e * b * outputs, 0, 1};
}

// Gate forward: softmax (~5 flops/elem incl. exp), top-k scan (k passes over E), capacity
// assignment (sort of T*k keys), aux statistics. Reads logits, writes probs and small
// per-token outputs.
OpCost cost_gate_forward(std::int64_t tokens, std::int64_t experts, int top_k) {
  const double te = static_cast<double>(tokens * experts), tk = static_cast<double>(tokens * top_k);
  return {OpKind::gate, te * (5.0 + top_k), te * 4.0 * (1 + top_k), te * 4.0 + tk * 12.0, 0, 3};
}

OpCost cost_gate_backward(std::int64_t tokens, std::int64_t experts, int top_k) {
  const double te = static_cast<double>(tokens * experts), tk = static_cast<double>(tokens * top_k);
  return {OpKind::gate, te * 4.0, te * 4.0 + tk * 12.0, te * 4.0, 0, 1};
}

OpCost cost_rows(OpKind kind, std::int64_t rows_read, std::int64_t rows_written, std::int64_t width, DType dtype,
                 double flops_per_elem) {
  const double w = static_cast<double>(width), b = static_cast<double>(dtype_size(dtype));
  return {kind, static_cast<double>(rows_read) * w * flops_per_elem, static_cast<double>(rows_read) * w * b,
          static_cast<double>(rows_written) * w * b, 0, 1};
}

OpCost cost_copy(OpKind kind, std::int64_t bytes) {
  const double b = static_cast<double>(bytes);
  return {kind, 0, b, b, 0, 1};
}

OpCost cost_collective(double bytes_sent_to_others, double bytes_local) {
  return {OpKind::collective, 0, bytes_sent_to_others + bytes_local, bytes_sent_to_others + bytes_local,
          bytes_sent_to_others, 1};
}

}  // namespace moelab
