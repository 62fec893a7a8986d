// harness/runtime/dtype.hpp — element types, memory spaces and memory categories.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace moelab {

enum class DType { f32, bf16, f64, i32, i64 };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "fp32", "bf16", "fp64", "int32", "int64"
DType parse_dtype(const std::string& s);  // accepts the names above (and "float32", "bfloat16"); throws ConfigError

// Where a tensor's bytes live. On the cpu backend "device" memory is ordinary host memory.
enum class MemSpace { device, host_pinned };

// What the bytes are for. Every allocation is charged to exactly one category, so that the
// peak can be broken down the way the papers do (model states / activations / buffers).
enum class MemCategory { weights, gradients, optimizer, activations, buffers, host_pinned, count };
constexpr int kNumMemCategories = static_cast<int>(MemCategory::count);
const char* category_name(MemCategory c);

// bf16 <-> f32 on the host (round to nearest even), used by uploads, downloads and tests.
std::uint16_t f32_to_bf16(float f);
float bf16_to_f32(std::uint16_t h);

}  // namespace moelab
