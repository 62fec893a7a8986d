// harness/runtime/dtype.cpp
#include "harness/runtime/dtype.hpp"

#include <cstring>

#include "harness/runtime/error.hpp"

namespace moelab {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f64: return "fp64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  if (s == "fp32" || s == "float32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "fp64" || s == "float64") return DType::f64;
  if (s == "int32") return DType::i32;
  if (s == "int64") return DType::i64;
  throw ConfigError("unknown dtype \"" + s + "\" (expected fp32 or bf16)");
}

const char* category_name(MemCategory c) {
  switch (c) {
    case MemCategory::weights: return "weights";
    case MemCategory::gradients: return "gradients";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::buffers: return "buffers";
    case MemCategory::host_pinned: return "host_pinned";
    case MemCategory::count: break;
  }
  return "?";
}

std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

float bf16_to_f32(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace moelab
